"""Divergence terms: hand-computed values, and value + expected on-policy gradient by exact enumeration of a
small softmax policy against the targets documented in sage/divergences.py."""

import math

import pytest
import torch

from sage.objective.divergences import ForwardKL, NoDivergence, ReverseKL, forward_kl, k1, k2, k3


def test_hand_values():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    # token 0: log(m/p) = -ln 2; token 1: +ln 2
    ln2 = math.log(2)
    assert torch.allclose(k1(logp, ref), torch.tensor([ln2, -ln2]))
    assert torch.allclose(k2(logp, ref), torch.tensor([0.5 * ln2**2, 0.5 * ln2**2]))
    # k3 = exp(d) - d - 1: d=-ln2 -> 0.5 + ln2 - 1 = 0.193147; d=+ln2 -> 2 - ln2 - 1 = 0.306853
    assert torch.allclose(k3(logp, ref), torch.tensor([0.193147, 0.306853]), atol=1e-6)
    # forward: r log r - r + 1: r=0.5 -> -0.346574 - 0.5 + 1 = 0.153426; r=2 -> 1.386294 - 2 + 1 = 0.386294
    assert torch.allclose(forward_kl(logp, ref), torch.tensor([0.153426, 0.386294]), atol=1e-6)
    # identical distributions: every term is 0
    for f in (k1, k2, k3, forward_kl):
        assert torch.all(f(ref, ref) == 0)


def pseudo_kl(p, m):
    """KL~(p || m) = sum p log(p/m) - sum p + sum m."""
    return (p * (p.log() - m.log())).sum() - p.sum() + m.sum()


@pytest.fixture(params=["normalised", "shaped"])
def setup(request):
    g = torch.Generator().manual_seed(0)
    V = 7
    theta = torch.randn(V, generator=g, dtype=torch.float64)
    ref = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), 0)
    q = torch.ones(V, dtype=torch.float64)
    if request.param == "shaped":
        q = 0.6 + 0.8 * torch.rand(V, generator=g, dtype=torch.float64)  # guide in [0.6, 1.4]
    return theta, ref * q  # m = q * pi_ref, unnormalised when shaped


def expected(term, theta, m):
    """On-policy expectation of a per-token loss: sum_y p(y) term(y), the sampling weights held fixed (a
    sampled loss has no score-function term). Returns (value, gradient wrt the logits)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    value = (logp.exp().detach() * term(logp, m.log())).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def target(fn, theta):
    theta = theta.clone().requires_grad_(True)
    v = fn(torch.softmax(theta, 0))
    (grad,) = torch.autograd.grad(v, theta)
    return v.detach(), grad


def test_k1_value_is_log_ratio_and_gradient_is_zero(setup):
    theta, m = setup
    v, g = expected(k1, theta, m)
    tv, _ = target(lambda p: (p * (p.log() - m.log())).sum(), theta)
    assert torch.allclose(v, tv)
    assert torch.allclose(g, torch.zeros_like(g), atol=1e-12)


def test_k2_gradient_is_reverse_pseudo_kl(setup):
    theta, m = setup
    v, g = expected(k2, theta, m)
    tv, tg = target(lambda p: 0.5 * (p * (p.log() - m.log()) ** 2).sum(), theta)
    _, kl_grad = target(lambda p: pseudo_kl(p, m), theta)
    assert torch.allclose(v, tv)
    assert torch.allclose(g, kl_grad, atol=1e-12)


def test_k3_value_is_reverse_pseudo_kl_and_gradient_is_forward_kl(setup):
    theta, m = setup
    v, g = expected(k3, theta, m)
    tv, _ = target(lambda p: pseudo_kl(p, m), theta)
    _, fwd_grad = target(lambda p: pseudo_kl(m, p), theta)
    _, rev_grad = target(lambda p: pseudo_kl(p, m), theta)
    assert torch.allclose(v, tv, atol=1e-12)
    assert torch.allclose(g, fwd_grad, atol=1e-12)
    assert not torch.allclose(g, rev_grad, atol=1e-3)  # the documented pitfall is real


def test_forward_kl_value_and_gradient(setup):
    theta, m = setup
    v, g = expected(forward_kl, theta, m)
    tv, tg = target(lambda p: (m * (m.log() - p.log())).sum() - m.sum() + 1, theta)
    assert torch.allclose(v, tv, atol=1e-12)
    assert torch.allclose(g, tg, atol=1e-12)
    # the pathwise gradient of the value estimator alone would be wrong
    naive = lambda logp, ref: torch.exp(ref - logp) * (ref - logp) - torch.exp(ref - logp) + 1  # noqa: E731
    _, g_naive = expected(naive, theta, m)
    assert not torch.allclose(g_naive, tg, atol=1e-3)


def test_divergence_objects_check_beta():
    with pytest.raises(ValueError, match="divergence.beta"):
        ReverseKL(beta=0.0)
    with pytest.raises(ValueError, match="divergence.estimator"):
        ReverseKL(beta=0.1, estimator="k4")
    with pytest.raises(ValueError, match="divergence.beta"):
        ForwardKL(beta=-1)
    with pytest.raises(ValueError, match="divergence.beta"):
        NoDivergence(beta=0.1)
    lp, rf = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert torch.equal(ReverseKL(0.1, "k2").per_token(lp, rf), k2(lp, rf))
    assert torch.equal(ReverseKL(0.1).per_token(lp, rf), k3(lp, rf))


def test_k2_with_importance_weighting_is_refused():
    """grad[(pi/pi_old) k2] = log(pi/m) grad log pi + k2 grad log pi on-policy: the extra term is a bias."""
    with pytest.raises(ValueError, match="k2 with divergence.importance_weighted=true"):
        ReverseKL(beta=0.05, estimator="k2", importance_weighted=True)
    ReverseKL(beta=0.05, estimator="k3", importance_weighted=True)
    ReverseKL(beta=0.05, estimator="k2")
