"""Guides against hand-computed values: clamping, padding, schedules, statistics of the random parts."""

import math

import pytest
import torch

from sage.objective.divergences import ReverseKL
from sage.objective.guides import (
    ArcherGuide,
    BranchGuide,
    NoGuide,
    RandomGuide,
    TokenGuide,
    branch_q,
    finalize,
    high_entropy,
    noise_seed,
    normalise_per_sequence,
    token_q,
)
from sage.objective.schedules import ConstantSchedule, CosineSchedule


def test_branch_hand_values_clamp_and_padding():
    H = torch.tensor([[0.5, 1.2, 1.7, 2.2, 9.0], [3.0, 3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    # 1 + 0.3 * max(0, H - 1.2): 1, 1, 1.15, 1.3, 1 + 0.3*7.8 = 3.34 -> clamped 1.4
    q = BranchGuide(ratio=0.3, threshold=1.2)(logps=None, ref_logps=None, entropies=H, mask=mask, step=0)
    expected = torch.tensor([[1.0, 1.0, 1.15, 1.3, 1.4], [1.4, 1.0, 1.0, 1.0, 1.0]])
    assert torch.allclose(q, expected)
    assert torch.equal(branch_q(torch.tensor([1.0]), 0.5, 2.0), torch.tensor([1.0]))


def test_finalize_lower_clamp_and_padding_exactly_one():
    q = torch.tensor([[0.1, 0.9, 5.0]])
    assert torch.equal(finalize(q, torch.tensor([[1, 1, 0]]), 0.6, 1.4), torch.tensor([[0.6, 0.9, 1.0]]))


def test_normalise_minmax_clips_to_quantiles():
    # 21 values 0..20: 5% quantile = 1, 95% = 19 (linear interpolation) -> w = (clip(x, 1, 19) - 1) / 18
    x = torch.arange(21, dtype=torch.float32).unsqueeze(0)
    w = normalise_per_sequence(x, torch.ones_like(x), "minmax")
    assert w[0, 0] == 0 and w[0, 1] == 0 and w[0, 19] == 1 and w[0, 20] == 1
    assert w[0, 10] == pytest.approx(9 / 18)


def test_normalise_rank_zscore_and_padding():
    x = torch.tensor([[3.0, 1.0, 2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert torch.allclose(normalise_per_sequence(x, mask, "rank"), torch.tensor([[1.0, 0.0, 0.5, 0.0]]))
    z = normalise_per_sequence(x, mask, "zscore")  # mean 2, std sqrt(2/3)
    s = (2 / 3) ** 0.5
    assert torch.allclose(
        z, torch.tensor([[torch.sigmoid(torch.tensor(1 / s)), torch.sigmoid(torch.tensor(-1 / s)), 0.5, 0.0]])
    )
    # a constant sequence carries no signal: w == 0 for every method
    const = torch.full((1, 4), 2.0)
    for method in ("minmax", "rank", "zscore"):
        assert torch.all(normalise_per_sequence(const, torch.ones_like(const), method) == 0), method


def test_rank_ties_share_their_average_rank():
    # valid values 5, 1, 5, 3 (padding 0 ignored): sorted 1, 3, 5, 5 -> ranks 0, 1, 2.5, 2.5 over n - 1 = 3
    x = torch.tensor([[5.0, 1.0, 5.0, 3.0, 0.0], [2.0, 2.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    w = normalise_per_sequence(x, mask, "rank")
    assert torch.allclose(w[0], torch.tensor([2.5 / 3, 0.0, 2.5 / 3, 1 / 3, 0.0]))
    # second row: 1 < 2 = 2 -> ranks 0, 1.5, 1.5 over 2
    assert torch.allclose(w[1], torch.tensor([0.75, 0.75, 0.0, 0.0, 0.0]))


def test_token_guide_without_noise_is_one_plus_alpha_w():
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.9]]))  # surprisal ln2, 2ln2, 3ln2, small
    mask = torch.tensor([[1, 1, 1, 0]])
    q = token_q(logps, mask, alpha=0.3, sigma=0.0, normalisation="rank", generator=None)
    assert torch.allclose(q, torch.tensor([[1.0, 1.15, 1.3, 1.0]]))
    g = TokenGuide(schedule=ConstantSchedule(), alpha_start=0.3, sigma_start=0.0, normalisation="rank")
    assert torch.allclose(g(logps=logps, ref_logps=None, entropies=None, mask=mask, step=0), q)
    with pytest.raises(ValueError, match="reference"):
        TokenGuide(schedule=ConstantSchedule(), source="ref")(
            logps=logps, ref_logps=None, entropies=None, mask=mask, step=0
        )


def test_random_guide_rate_scale_and_schedule():
    mask = torch.ones(200, 500)
    g = RandomGuide(
        schedule=ConstantSchedule(), eps_start=0.1, sigma_start=0.15, q_min=1e-3, q_max=10.0, seed=1
    )
    q = g(logps=None, ref_logps=None, entropies=None, mask=mask, step=0)
    active = q != 1
    assert active.float().mean().item() == pytest.approx(0.1, abs=0.005)
    assert (q[active] - 1).std().item() == pytest.approx(0.15, rel=0.03)
    # annealed to eps_end = 0 at the end of a cosine cycle: nothing fires
    cos = RandomGuide(schedule=CosineSchedule(max_steps=8, cycles=1), seed=1)
    assert cos.params(0) == {"eps": pytest.approx(0.1), "sigma": pytest.approx(0.15)}
    assert cos.params(7)["eps"] < cos.params(4)["eps"] < cos.params(1)["eps"]
    # padding stays 1 even when every token fires
    always = RandomGuide(schedule=ConstantSchedule(), eps_start=1.0, seed=0)
    q = always(logps=None, ref_logps=None, entropies=None, mask=torch.tensor([[1, 0]]), step=0)
    assert q[0, 1] == 1.0 and 0.6 <= q[0, 0] <= 1.4


def test_noise_seed_is_a_fixed_hash_of_its_four_integers():
    # pinned: the same (seed, step, rank, micro) must mean the same noise on any machine and interpreter
    assert noise_seed(3, 7, 1, 2) == 8326933190681351764
    seeds = {noise_seed(s, t, r, m) for s in (0, 1) for t in (0, 1) for r in (0, 1) for m in (-1, 0, 1)}
    assert len(seeds) == 24 and all(0 <= x < 2**63 for x in seeds)


@pytest.mark.parametrize(
    "guide",
    [
        RandomGuide(schedule=ConstantSchedule(), eps_start=0.5, q_min=1e-3, q_max=10.0, seed=4),
        TokenGuide(schedule=ConstantSchedule(), sigma_start=0.5, q_min=1e-3, q_max=10.0, seed=4),
    ],
    ids=["random", "token"],
)
def test_guide_noise_is_a_pure_function_of_seed_step_rank_micro(guide):
    """A resumed run calls the guide afresh at step N: it must draw what the uninterrupted run drew there.
    Another process (rank) or micro-batch, or another step, draws other noise."""
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 9, generator=g) * 3  # (B, T): distinct surprisals, so w > 0 for the token guide
    mask = torch.ones(4, 9)

    def q(step, rank, micro, of=guide):
        return of(logps=logps, ref_logps=None, entropies=None, mask=mask, step=step, rank=rank, micro=micro)

    first = q(5, 1, 2)
    for _ in range(3):  # other calls in between do not move it
        q(0, 0, 0)
    assert torch.equal(q(5, 1, 2), first)
    fresh = type(guide)(**{f: getattr(guide, f) for f in guide.__dataclass_fields__})  # a restarted process
    assert torch.equal(q(5, 1, 2, of=fresh), first)
    for other in [(6, 1, 2), (5, 0, 2), (5, 1, 3), (5, 1, -1)]:
        assert not torch.equal(q(*other), first), other
    reseeded = type(guide)(**{**{f: getattr(guide, f) for f in guide.__dataclass_fields__}, "seed": 5})
    assert not torch.equal(q(5, 1, 2, of=reseeded), first)


def test_no_guide_is_one():
    x = torch.randn(3, 4)
    assert torch.equal(
        NoGuide()(logps=x, ref_logps=None, entropies=x, mask=torch.ones(3, 4), step=5), torch.ones(3, 4)
    )


@pytest.mark.parametrize(
    "guide,kwargs,key",
    [
        (BranchGuide, {"ratio": -1.0}, "guide.ratio"),
        (BranchGuide, {"threshold": float("nan")}, "guide.threshold"),
        (BranchGuide, {"threshold": float("inf")}, "guide.threshold"),
        (BranchGuide, {"q_min": 0.0}, "guide.q_min"),
        (BranchGuide, {"q_max": 0.9}, "guide.q_max"),
        (RandomGuide, {"eps_start": 1.5}, "guide.eps_start"),
        (RandomGuide, {"sigma_end": -0.1}, "guide.sigma_end"),
        (TokenGuide, {"alpha_start": float("nan")}, "guide.alpha_start"),
        (ArcherGuide, {"quantile": 0.0}, "guide.quantile"),
        (ArcherGuide, {"quantile": 1.0}, "guide.quantile"),
        (ArcherGuide, {"quantile": float("nan")}, "guide.quantile"),
        (ArcherGuide, {"threshold": -0.1}, "guide.threshold"),
        (ArcherGuide, {"q_high": -0.5}, "guide.q_high"),
        (ArcherGuide, {"q_high": float("inf")}, "guide.q_high"),
        (ArcherGuide, {"q_low": 0.0}, "guide.q_low"),
        (ArcherGuide, {"q_low": float("nan")}, "guide.q_low"),
    ],
)
def test_bad_guide_values_are_refused_with_their_key(guide, kwargs, key):
    extra = {"schedule": ConstantSchedule()} if guide in (RandomGuide, TokenGuide) else {}
    with pytest.raises(ValueError, match=rf"^{key} must be in"):
        guide(**extra, **kwargs)


def test_bad_archer_level_is_refused():
    with pytest.raises(ValueError, match=r"^guide.level must be 'response' or 'batch'"):
        ArcherGuide(level="token")


# Three completions, the last column padding. Row 0: 0.1 0.2 0.3 0.4 1.0 (and 9.0 masked); row 1: 0.5 then
# four ties at 0.6; row 2: one token, 0.7.
ARCHER_H = torch.tensor(
    [[0.1, 0.2, 0.3, 0.4, 1.0, 9.0], [0.5, 0.6, 0.6, 0.6, 0.6, 0.0], [0.7, 0.0, 0.0, 0.0, 0.0, 0.0]],
    dtype=torch.float64,
)
ARCHER_MASK = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])


def test_archer_split_by_each_completions_quantile():
    """The paper's split: each completion's own 0.8-quantile (linear interpolation), strictly above it.
    Row 0: rank 0.8 * (5 - 1) = 3.2 -> 0.4 + 0.2 * (1.0 - 0.4) = 0.52, so only 1.0 (with the masked 9.0
    counted it would be 1.0 itself, and nothing above). Row 1: rank 3.2 falls among the ties, cut 0.6:
    tokens tied at the cut are not above it. Row 2: one token is its own quantile: low."""
    high = high_entropy(ARCHER_H, ARCHER_MASK, 0.8, None, "response")
    expected = torch.zeros_like(high)
    expected[0, 4] = True
    assert torch.equal(high, expected)
    assert not high_entropy(torch.full((1, 4), 2.0), torch.ones(1, 4), 0.8, None, "response").any()
    # q: q_low below the cut, q_high above, 1 on padding (a scalar q_high: no reference needed)
    g = ArcherGuide(q_high=0.5, q_low=1.25)
    q = g(logps=torch.zeros_like(ARCHER_H), ref_logps=None, entropies=ARCHER_H, mask=ARCHER_MASK, step=0)
    assert torch.equal(
        q,
        torch.tensor(
            [
                [1.25, 1.25, 1.25, 1.25, 0.5, 1.0],
                [1.25, 1.25, 1.25, 1.25, 1.25, 1.0],
                [1.25, 1.0, 1.0, 1.0, 1.0, 1.0],
            ],
            dtype=torch.float64,
        ),
    )
    assert g.params(0) == {"quantile": 0.8, "q_high": 0.5, "q_low": 1.25}
    # its strength is its q for a positive q_high; the release (q_high = 0) is strength 0 where q is 1
    assert torch.equal(g.strength(ARCHER_H, ARCHER_MASK), q.to(ARCHER_H.dtype))
    released = ArcherGuide()
    h = ARCHER_H.double()
    q0 = released(
        logps=torch.zeros_like(h), ref_logps=torch.zeros_like(h), entropies=h, mask=ARCHER_MASK, step=0
    )
    assert q0[0, 4] == 1.0 and released.strength(h, ARCHER_MASK)[0, 4] == 0.0
    assert released.strength(h, ARCHER_MASK)[0, 0] == 1.0 and released.strength(h, ARCHER_MASK)[0, 5] == 1.0


def test_archer_split_by_the_batch_quantile_or_a_fixed_threshold():
    """level=batch: one cut over the 11 valid entropies (padding out), sorted 0.1 0.2 0.3 0.4 0.5 0.6 0.6
    0.6 0.6 0.7 1.0; rank 0.8 * 10 = 8 -> 0.6, so 0.7 and 1.0 are high (row 2's lone token now is). A fixed
    threshold replaces the quantile: 0.55 nats makes the four 0.6 ties high too."""
    high = high_entropy(ARCHER_H, ARCHER_MASK, 0.8, None, "batch")
    expected = torch.zeros_like(high)
    expected[0, 4] = expected[2, 0] = True
    assert torch.equal(high, expected)
    fixed = ArcherGuide(threshold=0.55, q_high=0.5)
    q = fixed(logps=torch.zeros_like(ARCHER_H), ref_logps=None, entropies=ARCHER_H, mask=ARCHER_MASK, step=0)
    assert torch.equal(q[0], torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.equal(q[1], torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5, 1.0], dtype=torch.float64))
    assert torch.equal(q[2], torch.tensor([0.5, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert fixed.params(0) == {"threshold": 0.55, "q_high": 0.5, "q_low": 1.0}
    # a micro-batch of padding only: nothing is high, q is 1
    assert not high_entropy(ARCHER_H, torch.zeros_like(ARCHER_MASK), 0.8, None, "batch").any()
    assert not high_entropy(ARCHER_H, torch.zeros_like(ARCHER_MASK), 0.8, None, "response").any()


def test_archer_release_is_the_policys_own_ratio_at_high_entropy_tokens():
    """q_high = 0 (the default): q = pi / pi_ref at the high-entropy token, so q * pi_ref is the policy's
    own (detached) probability there; q_low elsewhere, 1 on padding; it needs the reference."""
    logps = torch.log(torch.full_like(ARCHER_H, 0.5))
    ref = torch.log(torch.full_like(ARCHER_H, 0.25))
    q = ArcherGuide()(logps=logps, ref_logps=ref, entropies=ARCHER_H, mask=ARCHER_MASK, step=0)
    assert torch.allclose(q[0], torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 1.0], dtype=torch.float64))
    assert torch.equal(q[1:], torch.ones_like(q[1:]))
    with pytest.raises(ValueError, match="reads pi_ref"):
        ArcherGuide()(logps=logps, ref_logps=None, entropies=ARCHER_H, mask=ARCHER_MASK, step=0)


def test_archer_release_in_float32_leaves_k3_zero_and_stays_finite():
    """In the trainer's float32, log(pi_ref) + log(q) gives log pi back to rounding, so the k3 term and its
    gradient at a released token are 0 to about 1e-6; a log-ratio beyond 80 nats is clamped, not infinite."""
    g = torch.Generator().manual_seed(0)
    logps = (-20 * torch.rand(2, 50, generator=g)).requires_grad_(True)
    ref = -40 * torch.rand(2, 50, generator=g)
    H, mask = torch.ones(2, 50), torch.ones(2, 50)
    q = ArcherGuide(threshold=0.5)(logps=logps.detach(), ref_logps=ref, entropies=H, mask=mask, step=0)
    term = ReverseKL(beta=1.0).per_token(logps, ref + torch.log(q))
    (grad,) = torch.autograd.grad(term.sum(), logps)
    assert term.abs().max() < 1e-6 and grad.abs().max() < 1e-5
    far = ArcherGuide(threshold=0.5)(
        logps=torch.tensor([[-1.0, -200.0]]),
        ref_logps=torch.tensor([[-150.0, -1.0]]),
        entropies=torch.ones(1, 2),
        mask=torch.ones(1, 2),
        step=0,
    )
    assert torch.isfinite(far.log()).all() and torch.allclose(far.log(), torch.tensor([[80.0, -80.0]]))


# Two kinds of position over a 3-token vocabulary: "low" (pi 0.8 0.1 0.1, H = 0.639 nats) and "high" (pi
# uniform, H = ln 3 = 1.099 nats), each with its own pi_ref. A completion has four low positions then one
# high: its 0.8-quantile is 0.639 + 0.2 * (1.099 - 0.639), so Archer calls the last position high, and so
# does Branch at threshold 0.8.
PI_LOW, REF_LOW = [0.8, 0.1, 0.1], [0.6, 0.2, 0.2]
PI_HIGH, REF_HIGH = [1 / 3, 1 / 3, 1 / 3], [0.5, 0.25, 0.25]


def expected_k3_pulls(guide):
    """The on-policy expected gradient of the trainer's k3 term, k3(log pi, log pi_ref + log q), with
    respect to the logits of each position, by enumerating the sampled token v. Row v of the batch samples
    token v at every position, so q[v, t] is what the guide gives token v at position t. Returns the
    gradient at a low position, at the high one, and the largest per-sample gradient at the high one."""
    pis = torch.tensor([PI_LOW] * 4 + [PI_HIGH], dtype=torch.float64)  # (T, V)
    refs = torch.tensor([REF_LOW] * 4 + [REF_HIGH], dtype=torch.float64)
    entropy = -(pis * pis.log()).sum(-1)  # (T,)
    V, T = pis.shape[1], pis.shape[0]
    logps, ref_logps = pis.log().T.contiguous(), refs.log().T.contiguous()  # (V, T): row v samples v
    q = guide(logps=logps, ref_logps=ref_logps, entropies=entropy.expand(V, T), mask=torch.ones(V, T), step=0)
    k3 = ReverseKL(beta=1.0).per_token
    pulls, per_sample = [], []
    for t in (0, T - 1):
        z = pis[t].log().clone().requires_grad_(True)  # logits whose softmax is pi_t
        logp = torch.log_softmax(z, 0)
        terms = k3(logp, ref_logps[:, t] + q[:, t].log())  # (V,): the term if v is sampled
        (g,) = torch.autograd.grad((pis[t] * terms).sum(), z, retain_graph=True)
        pulls.append(g)
        each = [torch.autograd.grad(terms[v], z, retain_graph=True)[0] for v in range(V)]
        per_sample.append(max(gv.abs().max() for gv in each))
    return pulls[0], pulls[1], per_sample[1], q


def test_archer_anchor_is_weaker_at_high_entropy_and_stronger_at_low_the_opposite_of_branch():
    """With q_t independent of the token, k3's expected gradient is q_t (pi - pi_ref) (docs/anchors.md):
    at the low position pi - pi_ref = (0.2, -0.1, -0.1), at the high one (-1/6, 1/12, 1/12). GRPO (q = 1)
    pulls with those. Archer's default removes the pull at the high position (every sample's gradient is 0,
    not only their mean) and keeps it at the low ones; with q_high 0.5 and q_low 1.25 it halves the first
    and strengthens the second. Branch does the opposite at the same positions: 1 + 0.3 (ln 3 - 0.8) at the
    high one, 1 at the low ones."""
    low_pull = torch.tensor([0.2, -0.1, -0.1], dtype=torch.float64)
    high_pull = torch.tensor([-1 / 6, 1 / 12, 1 / 12], dtype=torch.float64)

    low, high, high_per_sample, q = expected_k3_pulls(ArcherGuide())
    assert torch.allclose(low, low_pull, atol=1e-12)
    assert torch.allclose(high, torch.zeros(3, dtype=torch.float64), atol=1e-12)
    assert high_per_sample < 1e-12
    assert torch.allclose(q[:, -1], torch.tensor([2 / 3, 4 / 3, 4 / 3], dtype=torch.float64))  # pi / pi_ref

    low, high, high_per_sample, _ = expected_k3_pulls(ArcherGuide(q_high=0.5, q_low=1.25))
    assert torch.allclose(low, 1.25 * low_pull, atol=1e-12)
    assert torch.allclose(high, 0.5 * high_pull, atol=1e-12)
    # a scalar q scales only the mean: sampling token 1 still moves the logits by (1 - 0.5 * 0.25 * 3) * 2/3
    assert high_per_sample == pytest.approx(5 / 12, abs=1e-12)

    q_branch = 1 + 0.3 * (math.log(3) - 0.8)
    low, high, _, _ = expected_k3_pulls(BranchGuide(ratio=0.3, threshold=0.8))
    assert torch.allclose(low, low_pull, atol=1e-12)
    assert torch.allclose(high, q_branch * high_pull, atol=1e-12)
    assert q_branch > 1  # Branch: harder at the high-entropy position; Archer: weaker there
