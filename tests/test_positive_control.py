"""scripts/positive_control.py, which computes the fork study's declared primary (the rare strategy's share of
the tail's samples) and the positive control's power: shares from constructed run folders by hand, the
per-pair interval it quotes, and the power estimates' size under no effect and reach under a large one."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import bootstrap
from sage.testbed.task import FORK_STRATEGIES, teacher_completion

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("positive_control", REPO / "scripts" / "positive_control.py")
pc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pc  # dataclasses look their module up there
_spec.loader.exec_module(pc)


def completion(strategy: str, rng: random.Random) -> str:
    """A fork-world trace that follows ``strategy`` (the teacher's, all its probability on that one)."""
    probs = tuple(float(s == strategy) for s in FORK_STRATEGIES)
    text, used = teacher_completion(23, 4, 5, rng, strategy_probs=probs, slip_rate=0.0, world="fork")
    assert used == strategy
    return text


def write_run(folder: Path, method: str, seed: int, rounds: list[int], samples: int = 4) -> None:
    """A finished run whose final tail cell has ``rounds[i]`` `round` samples of ``samples`` on problem i
    (the rest `direct`), the first sample of each problem correct."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "seed": seed}))
    cell = folder / "eval" / "trained" / "arith_tail" / "key_seed0"
    cell.mkdir(parents=True)
    texts = [[completion("round" if j < n else "direct", rng) for j in range(samples)] for n in rounds]
    (cell / "completions.json").write_text(json.dumps(texts))
    (cell / "meta.json").write_text(json.dumps({"ids": [f"p{i}" for i in range(len(rounds))]}))
    correct = np.zeros((len(rounds), samples), dtype=bool)
    correct[:, 0] = True
    np.save(cell / "correct.npy", correct)


def test_the_share_is_each_problems_round_samples_and_other_rows_are_not_read(tmp_path, capsys):
    sweep = tmp_path / "fork"
    write_run(sweep / "a", "grpo", 1, [1, 0, 2])  # shares 1/4, 0, 2/4
    write_run(sweep / "b", "grpo", 2, [0, 0, 2])
    write_run(sweep / "c", "grpo_fork_rare", 1, [4, 2, 2])
    write_run(sweep / "d", "grpo_fork_rare", 2, [3, 1, 4])
    write_run(sweep / "e", "grpo_nokl", 1, [4, 4, 4])  # another row of the study
    (sweep / "f").mkdir()  # a run cut short: no config, no cell
    run = pc.load_run(sweep / "a", "arith_tail")
    np.testing.assert_allclose(run.share, [0.25, 0.0, 0.5])
    assert (run.method, run.seed, run.ids) == ("grpo", 1, ["p0", "p1", "p2"])
    assert pc.load_run(sweep / "e", "arith_tail", ("grpo", "grpo_fork_rare")) is None
    assert pc.load_run(sweep / "f", "arith_tail") is None

    assert pc.main([str(sweep), "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 runs, 3 arith_tail problems x 4 samples" in out and "grpo_nokl" not in out
    # by hand: oracle per-problem means (3.5/4, 1.5/4, 3/4), GRPO (0.5/4, 0, 2/4); run means 2/3, 2/3 and
    # 1/4, 1/6; the interval is bootstrap.difference's on those arrays
    oracle = np.array([[1.0, 0.5, 0.5], [0.75, 0.25, 1.0]])
    grpo = np.array([[0.25, 0.0, 0.5], [0.0, 0.0, 0.5]])
    iv = bootstrap.difference(oracle, grpo)
    assert iv.diff == pytest.approx(2 / 3 - 5 / 24)
    assert f"= {iv.diff:+.4f} [{iv.lo:.4f}, {iv.hi:.4f}]" in out
    assert "power" not in out  # --seeds 0: the study's comparison estimates no power


def test_one_seed_on_a_side_gets_no_power_estimate(tmp_path, capsys):
    write_run(tmp_path / "a", "grpo", 1, [1, 0])
    write_run(tmp_path / "b", "grpo", 2, [0, 1])
    write_run(tmp_path / "c", "grpo_fork_rare", 1, [2, 2])
    assert pc.main([str(tmp_path)]) == 1
    assert (
        "no power estimate: grpo_fork_rare has 1 seed(s), grpo 2; each arm needs 2" in capsys.readouterr().out
    )


def pilot(rng: np.random.Generator, effect: float, seeds: int = 4, problems: int = 60, samples: int = 256):
    """Two arms' per-problem shares: problem profiles around 0.05, seed SD 0.002, binomial sampling."""
    profile = rng.uniform(0.02, 0.08, problems)
    arms = []
    for shift in (effect, 0.0):
        true = profile + shift + rng.normal(0, 0.002, (seeds, 1))
        arms.append(rng.binomial(samples, np.clip(true, 0, 1)) / samples)
    return arms


def test_power_is_the_level_without_an_effect_and_near_one_with_a_large_one():
    rng = np.random.default_rng(0)
    null_m, null_r = pilot(rng, 0.0)
    # a null pilot's own observed difference is noise; force it to exactly none so the power is the size
    null_m = null_m - null_m.mean() + null_r.mean()
    size = pc.simulate_power(null_m, null_r, seeds=8, samples=256, sims=400, rng=rng)
    assert size <= 0.10  # the interval's two-sided 5% and one side of it
    power_n, _, _ = pc.normal_power(null_m, null_r, seeds=8)
    assert power_n == pytest.approx(0.05, abs=0.03)
    big_m, big_r = pilot(rng, 0.02)
    assert pc.simulate_power(big_m, big_r, seeds=8, samples=256, sims=200, rng=rng) >= 0.95
    assert pc.normal_power(big_m, big_r, seeds=8)[0] >= 0.95
