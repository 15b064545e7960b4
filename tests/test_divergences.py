"""Divergence terms: hand-computed values, and value + expected on-policy gradient by exact enumeration of a
small softmax policy against the targets documented in sage/divergences.py."""

import math

import pytest
import torch

from sage.objective.aggregation import aggregate
from sage.objective.divergences import (
    ForwardKL,
    NoDivergence,
    ReverseKL,
    SequenceKL,
    forward_kl,
    k1,
    k2,
    k3,
    sequence_kl,
    sequence_kl_shares,
)


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


# ------------------------------------------------------------------ the anchor of whole completions
# A two-step world, enumerated: y = (y1, y2), two tokens at each step. A guide's q_t depends on the prefix
# only (as every guide's does): q = 1 at the first step; at the second, 1.4 after y1 = 0 (the fork a guide
# would favour) and 1 after y1 = 1. Reward 1 for (0, 0) and (1, 1).
BETA = 0.5
REWARD = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
Q2 = torch.tensor([1.4, 1.0], dtype=torch.float64)


def two_step_ref():
    g = torch.Generator().manual_seed(1)
    first = torch.softmax(torch.randn(2, generator=g, dtype=torch.float64), 0)
    second = torch.softmax(torch.randn(2, 2, generator=g, dtype=torch.float64), 1)  # row: y1
    return first, second


def sequences(theta1, theta2, ref, q2):
    """(4, 2) per-token log-probs of the policy and of the shaped anchor log pi_ref + log q, the (4,)
    rewards and the (4,) on-policy weights pi(y), for y in (0,0), (0,1), (1,0), (1,1)."""
    lp1, lp2 = torch.log_softmax(theta1, 0), torch.log_softmax(theta2, 1)
    ref1, ref2 = ref
    ys = [(a, b) for a in range(2) for b in range(2)]
    logp = torch.stack([torch.stack([lp1[a], lp2[a, b]]) for a, b in ys])
    anchor = torch.stack([torch.stack([ref1[a].log(), ref2[a, b].log() + q2[a].log()]) for a, b in ys])
    rewards = torch.stack([REWARD[a, b] for a, b in ys])
    return logp, anchor, rewards, logp.sum(-1).exp()


def train(anchor_term, q2=Q2, steps=6000):
    """The policy that minimises the expected on-policy loss -r log pi(y) + beta * anchor_term (sampling
    weights held fixed, as a sampled loss has them), by Adam on exact expectations."""
    ref = two_step_ref()
    theta1 = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    theta2 = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta1, theta2], lr=0.05)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.01 ** (1 / steps))  # to lr 5e-4: settles
    for _ in range(steps):
        logp, anchor, rewards, pi = sequences(theta1, theta2, ref, q2)
        loss = (pi.detach() * (-rewards * logp.sum(-1) + BETA * anchor_term(logp, anchor))).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    return sequences(theta1, theta2, ref, q2)[3].detach()


def closed_form(q2=Q2):
    """pi*(y) ∝ q(y) pi_ref(y) exp(r(y)/beta): the paper's stationary solution."""
    (ref1, ref2), ys = two_step_ref(), [(a, b) for a in range(2) for b in range(2)]
    w = torch.stack([q2[a] * ref1[a] * ref2[a, b] * torch.exp(REWARD[a, b] / BETA) for a, b in ys])
    return w / w.sum()


def sequence_term(logp, anchor):
    return sequence_kl(logp, anchor, torch.ones_like(logp))


def token_k3(logp, anchor):
    return k3(logp, anchor).sum(-1)


def test_the_sequence_anchor_converges_to_the_papers_stationary_solution():
    trained = train(sequence_term)
    assert torch.allclose(trained, closed_form(), atol=1e-5), (trained, closed_form())
    # and the guide moved it: without q the optimum is another policy
    assert (closed_form() - closed_form(torch.ones(2, dtype=torch.float64))).abs().max() > 0.02


def test_per_token_k3_with_a_prefix_guide_is_a_per_position_beta_not_that_solution():
    """Under k3 a prefix-only q_t multiplies the pull towards pi_ref at position t: training with q equals
    training with q = 1 and beta * q_t at each position; its optimum is not the paper's solution."""
    shaped = train(token_k3)
    assert (shaped - closed_form()).abs().max() > 0.02

    def stronger_beta(logp, anchor):
        unshaped = anchor.clone()
        unshaped[:, 1] -= torch.log(Q2)[[0, 0, 1, 1]]  # the anchor without q, i.e. pi_ref
        return (k3(logp, unshaped) * torch.stack([torch.ones(4), Q2[[0, 0, 1, 1]]], -1)).sum(-1)

    assert torch.allclose(shaped, train(stronger_beta), atol=1e-5)


def test_sequence_kl_value_and_gradient_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    anchor = torch.tensor([[math.log(0.25), math.log(0.5)]])
    out = sequence_kl(logp, anchor, torch.tensor([[1.0, 1.0]]))
    assert out.item() == pytest.approx(0.0)  # log 2 - log 2: the two tokens' log-ratios cancel
    out = sequence_kl(logp, anchor, torch.tensor([[1.0, 0.0]]))  # the second token masked out
    assert out.item() == pytest.approx(math.log(2))
    out.sum().backward()
    # d/d logp of stopgrad(log-ratio) * sum_t mask logp: log 2 on the unmasked token, 0 on the masked one
    assert torch.allclose(logp.grad, torch.tensor([[math.log(2), 0.0]]))
    with pytest.raises(ValueError, match="divergence.beta must be > 0 for sequence_kl"):
        SequenceKL(beta=0.0)


# ------------------------------------------------------------------ the two anchors' strength at one beta
LENGTH, VOCAB = 6, 3


def autoregressive_world(seed: int = 0, displacement: float = 0.5):
    """Every completion of LENGTH tokens from VOCAB (729), a tabular policy (logits per prefix) and a
    reference whose logits differ by ``displacement`` x N(0, 1): a policy displaced from its reference, as
    after some training, not at a true step 0 (there the policy is its reference, where with Branch's q, the
    same for every token at a position, k3's expected gradient is exactly 0 and sequence_kl's in general is
    not).
    Returns (theta, ref logits, (N, LENGTH) prefix ids, (N, LENGTH) tokens)."""
    import itertools

    ys = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    prefixes = {(): 0}
    for t in range(1, LENGTH):
        for p in itertools.product(range(VOCAB), repeat=t):
            prefixes[p] = len(prefixes)
    ids = torch.tensor([[prefixes[tuple(y[:t].tolist())] for t in range(LENGTH)] for y in ys])
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(len(prefixes), VOCAB, generator=g, dtype=torch.float64)
    ref = theta + displacement * torch.randn(len(prefixes), VOCAB, generator=g, dtype=torch.float64)
    return theta.requires_grad_(), ref, ids, ys


def expected_anchor_gradient(per_token_of, theta, ref, ids, ys):
    """The gradient norm of beta = 1 times the anchor as the trainer adds it (TRL's grpo aggregation: the
    mean over a completion's tokens, then over completions), in expectation on-policy: every completion
    weighted by its probability (held fixed, as a sampled loss holds it)."""
    logp = torch.log_softmax(theta, -1)[ids].gather(-1, ys[..., None])[..., 0]  # (N, LENGTH)
    ref_logp = torch.log_softmax(ref, -1)[ids].gather(-1, ys[..., None])[..., 0]
    mask = torch.ones_like(logp)
    weight = logp.sum(-1).exp().detach() * len(ys)  # N pi(y): the mean over completions is E_pi
    per_token = per_token_of(logp, ref_logp, mask) * weight[:, None]
    loss = aggregate(
        per_token,
        mask,
        "grpo",
        max_completion_length=LENGTH,
        num_items_in_batch=None,
        grad_accum_steps=1,
        steps_per_generation=1,
        num_processes=1,
        training=True,
    )
    (grad,) = torch.autograd.grad(loss, theta)
    return grad.norm().item()


@pytest.mark.parametrize("displacement", [0.2, 0.5, 1.0])
def test_sequence_kl_pulls_with_reverse_kls_strength_at_the_same_beta(displacement):
    """The two anchors' expected gradients at one beta, on one policy and its reference (every completion of
    6 tokens): divergence=sequence_kl (its completion term spread over the tokens, aggregated as TRL
    aggregates its policy gradient) is within 2x of divergence=reverse_kl (k3). The undivided sequence
    term (what the trainer added before) pulled about LENGTH times harder."""
    world = autoregressive_world(displacement=displacement)
    reverse = expected_anchor_gradient(lambda lp, rf, m: ReverseKL(1.0).per_token(lp, rf), *world)
    sequence = expected_anchor_gradient(SequenceKL(1.0).per_token, *world)
    # before: each completion's whole sequence_kl, averaged over completions (not divided by its length)
    undivided = expected_anchor_gradient(
        lambda lp, rf, m: sequence_kl(lp, rf, m)[:, None] * m / m.sum(-1, keepdim=True) * LENGTH, *world
    )
    assert reverse > 1e-3
    assert 0.5 < sequence / reverse < 2, (sequence, reverse)
    assert undivided / sequence == pytest.approx(LENGTH)
    assert undivided / reverse > 2 * 2


def test_sequence_kl_shares_sum_to_the_completions_term():
    """Each completion's shares sum to sequence_kl's value and gradient; masked tokens carry nothing; the
    value per token is the completion's mean log-ratio."""
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    shares = sequence_kl_shares(logp, ref, mask)
    whole = sequence_kl(logp, ref, mask)
    assert torch.allclose(shares.sum(-1), whole)
    assert torch.all(shares[mask == 0] == 0)
    assert torch.allclose(shares[1, :2], ((logp - ref)[1, :2].sum() / 2).expand(2))
    (g_shares,) = torch.autograd.grad(shares.sum(), logp)
    (g_whole,) = torch.autograd.grad(whole.sum(), logp)
    assert torch.allclose(g_shares, g_whole)
    assert torch.equal(SequenceKL(0.1).per_token(logp, ref, mask), shares)
