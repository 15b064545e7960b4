"""Guides against hand-computed values: clamping, padding, schedules, statistics of the random parts."""

import pytest
import torch

from sage.objective.guides import (
    BranchGuide,
    NoGuide,
    RandomGuide,
    TokenGuide,
    branch_q,
    finalize,
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
    ],
)
def test_bad_guide_values_are_refused_with_their_key(guide, kwargs, key):
    extra = {} if guide is BranchGuide else {"schedule": ConstantSchedule()}
    with pytest.raises(ValueError, match=rf"^{key} must be in"):
        guide(**extra, **kwargs)
