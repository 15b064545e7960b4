"""The testbed's fork world (model=tiny_fork): the strategy is chosen at one marker token among six, only the
rare strategy solves tail problems, and what the study measures there (figures by tier, the rare
strategy's share, the guide at the fork tokens, the fork-only control guide)."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from sage.config import ConfigError, register_configs, validate
from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START
from sage.eval.analyses import strategy_mix, tier_figures
from sage.eval.testbed_measure import fork_figures
from sage.objective.divergences import k3
from sage.objective.guides import BranchGuide, ForkGuide, RareForkGuide, branch_q, rare_fork_q
from sage.testbed.task import (
    CARRY,
    FORK_MARKERS,
    FORK_PRIOR,
    FORK_RULES,
    FORK_STRATEGIES,
    RARE_STRATEGY,
    classify_strategy,
    extract_answer,
    is_correct,
    make_problems,
    problem_tier,
    teacher_completion,
)
from sage.testbed.tokenizer import CHARS, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
register_configs()


def traces(n: int, seed: int = 0) -> list[tuple[dict, str, str]]:
    rng = random.Random(seed)
    return [
        (p, *teacher_completion(p["a"], p["b"], p["c"], rng, FORK_PRIOR, world="fork"))
        for p in make_problems("train", n, seed)
    ]


def test_the_prior_at_the_fork_has_the_entropy_the_study_needs():
    entropy = -sum(p * math.log(p) for p in FORK_PRIOR)
    assert entropy == pytest.approx(1.4956, abs=1e-4)  # by hand: .45 ln .45 + .2 ln .2 + ... (nats)
    # the branch guide at the testbed's default threshold (0.3) and ratio (0.3), were the model's entropy
    # there the prior's: q = 1 + 0.3 * (1.4956 - 0.3)
    q = branch_q(torch.tensor([entropy]), 0.3, 0.3).item()
    assert q == pytest.approx(1.3587, abs=1e-4) and q >= 1.2


def test_every_trace_announces_its_strategy_in_one_token_and_follows_it():
    tokenizer = build_tokenizer(markers=tuple(FORK_MARKERS.values()))
    plain = build_tokenizer()
    # the markers are added after the format tags: the ids of every other token are those of the plain
    # vocabulary (the first worlds' models keep theirs)
    assert all(
        tokenizer.convert_tokens_to_ids(t) == plain.convert_tokens_to_ids(t) for t in plain.get_vocab()
    )
    found = Counter()
    for _, completion, strategy in traces(3000):
        marker = FORK_MARKERS[strategy]
        assert completion.startswith(WORK_START + marker)
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        assert ids[1] == tokenizer.convert_tokens_to_ids(marker)  # the fork: the completion's 2nd token
        assert tokenizer.decode(ids) == completion
        assert classify_strategy(completion) == strategy
        found[strategy] += 1
    n = sum(found.values())
    for name, prob in zip(FORK_STRATEGIES, FORK_PRIOR, strict=True):
        assert abs(found[name] / n - prob) <= 4 * (prob * (1 - prob) / n) ** 0.5, name
    # a marker followed by another strategy's working is no strategy
    split_work = "50*9=450 4*9=36 450+36=486 486+35=521"
    bad = f"{WORK_START}{FORK_MARKERS['direct']}{split_work}{WORK_END}{SOLUTION_START}521{SOLUTION_END}"
    assert classify_strategy(bad) == "other"
    assert set(CHARS) >= set(split_work)


def test_only_the_rare_strategy_solves_tail_problems():
    """By tier: a CARRY cell answers with the carry of the units product dropped, always; the others slip
    at their rate. A tail problem (multiplier 8 or 9, a carry in the units product) is solved by `round`
    alone; a problem without that carry is easy whatever its multiplier."""
    assert problem_tier("fork", 41, 9) == "easy" and problem_tier("fork", 42, 9) == "tail"
    assert problem_tier("fork", 42, 6) == "hard" and problem_tier("fork", 42, 5) == "easy"
    assert problem_tier("graded", 41, 9) == "tail"  # the graded world's tiers are the multiplier's only
    ok: Counter = Counter()
    seen: Counter = Counter()
    for p, completion, strategy in traces(20000):
        tier = problem_tier("fork", p["a"], p["b"])
        seen[(tier, strategy)] += 1
        ok[(tier, strategy)] += is_correct(completion, p["answer"])
        if FORK_RULES[tier][strategy] == CARRY:
            assert not is_correct(completion, p["answer"]), completion
            if strategy in ("direct", "cfirst", "ctens"):
                dropped = p["a"] * p["b"] - p["a"] % 10 * p["b"] // 10 * 10 + p["c"]
                assert extract_answer(completion) == str(dropped)
    assert len(seen) == 18  # every (tier, strategy) cell drawn
    for (tier, strategy), n in seen.items():
        rule = FORK_RULES[tier][strategy]
        if rule != CARRY:
            sd = (rule * (1 - rule) / n) ** 0.5
            assert abs(1 - ok[(tier, strategy)] / n - rule) <= 4 * sd + 1e-9, (tier, strategy, n)
    assert [s for s in FORK_STRATEGIES if ok[("tail", s)]] == [RARE_STRATEGY]


WORK = {  # 42*9+10 by each strategy
    "direct": "42*9=378 378+10=388",
    "split": "40*9=360 2*9=18 360+18=378 378+10=388",
    "cfirst": "42*9=378 10+378=388",
    "double": "42*8=336 336+42=378 378+10=388",
    "ctens": "42*9=378 378+10=388 388+0=388",
    "round": "50*9=450 8*9=72 450-72=378 378+10=388",
}


def _completion(strategy: str, answer: str) -> str:
    work = FORK_MARKERS[strategy] + WORK[strategy]
    return f"{WORK_START}{work}{WORK_END}{SOLUTION_START}{answer}{SOLUTION_END}"


def test_each_strategy_is_told_by_its_marker_and_its_shape():
    assert [classify_strategy(_completion(s, "388")) for s in FORK_STRATEGIES] == list(FORK_STRATEGIES)


def test_tier_figures_by_hand():
    """Two tail problems and one easy one, 4 samples each: pass@k by tier from the unbiased estimator, and
    the rare strategy's share of each tier's samples."""
    rows = [{"problem": "42*9+10="}, {"problem": "43*8+11="}, {"problem": "41*3+12="}]
    assert [problem_tier("fork", a, b) for a, b in [(42, 9), (43, 8), (41, 3)]] == ["tail", "tail", "easy"]
    completions = [
        [
            _completion("round", "1"),
            _completion("direct", "1"),
            _completion("direct", "1"),
            _completion("split", "1"),
        ],
        [_completion("direct", "1")] * 4,
        [_completion("direct", "1")] * 3 + [_completion("round", "1")],
    ]
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=bool)
    figures = tier_figures(rows, completions, correct)
    assert figures == pytest.approx(
        {
            "tier/tail/pass@1": (1 / 4 + 0) / 2,
            "tier/tail/pass@4": (1 + 0) / 2,
            "tier/easy/pass@1": 3 / 4,
            "tier/easy/pass@4": 1.0,
            "rare_share/tail": 1 / 8,
            "rare_share/easy": 1 / 4,
        }
    )
    # the first worlds have no markers: tiers by multiplier, no rare share; a math benchmark has no tiers
    plain = [
        [c.replace(FORK_MARKERS["round"], "").replace(FORK_MARKERS["direct"], "")] for c, *_ in completions
    ]
    assert set(tier_figures(rows, plain, correct[:, :1])) == {f"tier/{t}/pass@1" for t in ("tail", "easy")}
    assert tier_figures([{"problem": "What is $1+1$?"}], [["2"]], np.array([[True]])) == {}


def test_strategy_mix_names_the_fork_worlds_six_strategies():
    mix = strategy_mix([[_completion("round", "1"), _completion("ctens", "1").replace("388+0", "x")]])
    assert set(mix) == {*FORK_STRATEGIES, "other"} and mix["round"] == 0.5 and mix["other"] == 0.5


def test_fork_figures_by_hand():
    """The entropy at the tokens that chose a marker, the branch guide's clamped q there and its active
    share; NaN (after eos) positions are not tokens."""
    marker, other = 100, 7
    entropies = [torch.tensor([[0.1, 1.5, 0.2, float("nan")], [0.05, 0.2, 0.9, 0.1]])]
    tokens = [torch.tensor([[3, marker, other, marker], [3, marker, other, other]])]
    figures = fork_figures(entropies, tokens, [marker], ratio=0.3, threshold=0.3)
    assert figures["fork_entropy_nats"] == pytest.approx((1.5 + 0.2) / 2)
    assert figures["fork_q_mean"] == pytest.approx((1 + 0.3 * 1.2 + 1.0) / 2)
    assert figures["fork_guide_active"] == pytest.approx(0.5)
    assert figures["guide_active_all_tokens"] == pytest.approx(2 / 7)
    clamp = BranchGuide()
    high = fork_figures([torch.tensor([[9.0]])], [torch.tensor([[marker]])], [marker], 0.3, 0.3)
    assert high["fork_q_mean"] == pytest.approx(clamp.q_max)  # clamped as in training
    with pytest.raises(ValueError, match="fork-world model"):
        fork_figures(entropies, [torch.zeros(2, 4, dtype=torch.long)], [marker], 0.3, 0.3)


def test_the_fork_guide_acts_at_the_fork_tokens_only():
    logps = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    fork = torch.tensor([[False, True, False], [False, False, True]])  # the second one is padding
    q = ForkGuide(q=1.4)(logps=logps, ref_logps=logps, entropies=logps, mask=mask, step=0, fork=fork)
    assert torch.allclose(q, torch.tensor([[1.0, 1.4, 1.0], [1.0, 1.0, 1.0]]))
    with pytest.raises(ValueError, match="model=tiny_fork"):
        ForkGuide()(logps=logps, ref_logps=logps, entropies=logps, mask=mask, step=0)


def test_the_rare_fork_guide_acts_on_the_tokens_pi_ref_makes_rare_at_the_fork():
    # reference probabilities of the sampled tokens; only row 0's positions 0-3 and row 1's 0 are fork tokens
    p_ref = torch.tensor([[0.45, 0.05, 0.064, 0.066, 0.01], [0.05, 0.9, 0.02, 0.05, 0.05]])
    fork = torch.tensor([[True, True, True, True, False], [True, False, False, False, True]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # row 1's last token is padding
    q = RareForkGuide(q=4.0, p_max=0.065)(
        logps=p_ref.log(), ref_logps=p_ref.log(), entropies=p_ref, mask=mask, step=0, fork=fork & mask.bool()
    )
    # 0.05 and 0.064 < 0.065 at a fork token: 4; 0.45, 0.066 at the fork and 0.01, 0.02 off it: 1; padding 1
    assert torch.equal(q, torch.tensor([[1.0, 4.0, 4.0, 1.0, 1.0], [4.0, 1.0, 1.0, 1.0, 1.0]]))
    # at p_max 0.5 every fork token of row 0 is rare (0.45 too); position 4 is not a fork token
    assert torch.equal(rare_fork_q(p_ref.log(), fork, 2.5, 0.5)[0], torch.tensor([2.5, 2.5, 2.5, 2.5, 1.0]))
    with pytest.raises(ValueError, match="model=tiny_fork"):
        RareForkGuide()(logps=q, ref_logps=q, entropies=q, mask=mask, step=0)
    with pytest.raises(ValueError, match="divergence=none"):
        RareForkGuide()(logps=q, ref_logps=None, entropies=q, mask=mask, step=0, fork=fork)
    with pytest.raises(ValueError, match="guide.p_max must be in"):
        RareForkGuide(p_max=1.5)


def test_k3_with_the_rare_fork_guide_tilts_the_fork_towards_the_rare_strategies():
    """The expected per-token k3 gradient at the fork (the sampled token's weight pi(v) held fixed, as an
    on-policy sample's is) has its zero at q pi_ref / sum(q pi_ref). By hand, FORK_PRIOR with q = 4 on its
    two 0.05 strategies: (0.45, 0.2, 0.15, 0.1, 0.2, 0.2) / 1.3."""
    prior = torch.tensor(FORK_PRIOR, dtype=torch.float64)
    fork = torch.ones_like(prior, dtype=torch.bool)
    q = rare_fork_q(prior.log(), fork, 4.0, 0.065)
    logits = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=2.0)
    for _ in range(3000):
        logp = logits.log_softmax(-1)
        loss = (logp.exp().detach() * k3(logp, prior.log() + q.log())).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    expected = torch.tensor([0.45, 0.2, 0.15, 0.1, 0.2, 0.2], dtype=torch.float64) / 1.3
    assert torch.allclose(logits.softmax(-1), expected, atol=1e-6)
    assert dict(zip(FORK_STRATEGIES, q.tolist(), strict=True)) == {
        "direct": 1.0,
        "split": 1.0,
        "cfirst": 1.0,
        "double": 1.0,
        "ctens": 4.0,
        "round": 4.0,
    }


def test_guide_fork_rare_is_composed_and_needs_the_fork_world():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        ok = compose("train", overrides=["model=tiny_fork", "experiment=grpo_fork_rare"])
        wrong = compose("train", overrides=["experiment=grpo_fork_rare"])
    validate(ok)
    assert (ok.guide.q, ok.guide.p_max, ok.method) == (4.0, 0.065, "grpo_fork_rare")
    with pytest.raises(
        ConfigError, match="guide=fork_rare acts at the strategy markers .*use model=tiny_fork"
    ):
        validate(wrong)


def test_guide_fork_needs_the_fork_world_before_anything_runs():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        ok = compose("train", overrides=["model=tiny_fork", "guide=fork"])
        wrong = compose("train", overrides=["guide=fork"])
    validate(ok)
    assert ok.model.source.world == "fork" and ok.guide.q == 1.4
    with pytest.raises(
        ConfigError, match="guide=fork acts at the strategy markers .*world is graded: use model=tiny_fork"
    ):
        validate(wrong)
