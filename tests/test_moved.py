"""Which problems moved (analysis.moved): lost and gained problems and curve crossings on hand-made
correctness arrays, the per-problem CSV, and the section sage-report writes from a constructed store."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import moved, report
from analysis.bootstrap import per_problem_pass_at_k
from sage.testbed.task import heldout_rows, problem_tier, tier_of


def matrix(counts, n=4) -> np.ndarray:
    """A (problems x n) correctness matrix whose problem i has counts[i] correct samples."""
    return np.array([[j < c for j in range(n)] for c in counts])


def at_k(counts, k, n=4) -> np.ndarray:
    return per_problem_pass_at_k([matrix(counts, n)], [k])[0]


def curve(counts, n=4) -> np.ndarray:
    return moved.mean_curve(per_problem_pass_at_k([matrix(counts, n)], range(1, n + 1)).T)


# pass@k of one problem with c of n = 4 samples correct, k = 1..4 (1 - C(4-c, k) / C(4, k)):
#   c=0: 0 0 0 0 | c=1: 1/4 1/2 3/4 1 | c=2: 1/2 5/6 1 1 | c=3: 3/4 1 1 1 | c=4: 1 1 1 1
BASE = [2, 2, 1, 1, 0, 0]  # curve sums 1.5, 8/3, 3.5, 4 (over 6 problems)
GRPO = {0: [4, 4, 2, 0, 1, 0], 1: [4, 3, 2, 0, 1, 1]}  # sums 2.75, 10/3, 3.75, 4 | 2.75, 23/6, 4.5, 5
BRANCH = {0: [4, 0, 2, 3, 1, 0], 1: [0, 0, 2, 3, 1, 1]}  # sums 2.5, 10/3, 3.75, 4 | 1.75, 17/6, 3.5, 4
T1 = stats.t.ppf(0.975, 1)  # the t quantile of two seed pairs


def test_lost_and_gained_are_below_the_threshold_times_the_other_row():
    method = np.array([0.0, 0.2, 0.5, 1.0, 0.0])
    ref = np.array([0.5, 0.5, 0.9, 0.4, 0.0])
    assert np.flatnonzero(moved.lost(method, ref)).tolist() == [0, 1]  # 0.5 < 0.45 is not lost
    assert np.flatnonzero(moved.gained(method, ref)).tolist() == [3]  # unsolved by both: neither
    assert np.flatnonzero(moved.lost(method, ref, threshold=1.0)).tolist() == [0, 1, 2]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="threshold must be in"):
            moved.lost(method, ref, bad)
    with pytest.raises(ValueError, match="not paired by problem"):
        moved.lost(method, ref[:4])


def test_lost_and_gained_from_correctness_arrays():
    """At k = 4 of 4 samples a problem's pass@4 is 1 when any sample is right; at k = 1 it is c / 4."""
    b0, g0 = at_k(BRANCH[0], 4), at_k(GRPO[0], 4)
    assert np.flatnonzero(moved.lost(b0, g0)).tolist() == [1]  # GRPO solves it, Branch never
    assert np.flatnonzero(moved.gained(b0, g0)).tolist() == [3]
    # at k = 1: Branch 1, 0, 1/2, 3/4, 1/4, 0 against GRPO 1, 1, 1/2, 0, 1/4, 0
    assert np.flatnonzero(moved.lost(at_k(BRANCH[0], 1), at_k(GRPO[0], 1))).tolist() == [1]
    assert np.flatnonzero(moved.gained(at_k(BRANCH[0], 1), at_k(GRPO[0], 1))).tolist() == [3]
    # 1/4 against 1/2 (c = 1 vs 2): lost at threshold 0.6 (1/4 < 0.3), not at 0.5 (1/4 < 1/4 is false)
    one, two = at_k([1], 1), at_k([2], 1)
    assert not moved.lost(one, two).any() and moved.lost(one, two, 0.6).all()


def test_crossing_k_hand_computed():
    assert moved.crossing([0.5, 0.6, 0.7, 0.75], [0.3, 0.5, 0.7, 0.8]) == 3  # level at k = 3 counts
    assert moved.crossing([0.5, 0.6, 0.7, 0.75], [0.3, 0.4, 0.5, 0.6]) is None  # ahead up to k = n
    assert moved.crossing([0.5, 0.6, 0.7], [0.6, 0.5, 0.4]) == 1  # never ahead: k = 1
    # from correctness arrays: the start model catches up at k = 4 (both solve 4 of 6), k = 3 (3.5 of 6
    # both), or never (GRPO seed 1 solves 5 of 6 at k = 4, the start model 4)
    base = curve(BASE)
    assert base == pytest.approx(np.array([1.5, 8 / 3, 3.5, 4]) / 6)
    assert moved.crossing(curve(GRPO[0]), base) == 4
    assert moved.crossing(curve(BRANCH[1]), base) == 3
    assert moved.crossing(curve(GRPO[1]), base) is None
    assert moved.crossing(curve(BRANCH[0]), curve(GRPO[0])) == 1  # Branch 2.5 / 6 below GRPO 2.75 / 6
    with pytest.raises(ValueError, match="two curves over the same k"):
        moved.crossing([0.1, 0.2], [0.1])


def test_seed_pairs_share_the_training_seed_or_a_lone_seed():
    assert moved.seed_pairs([1, 2, 3], [0]) == [(0, 0), (1, 0), (2, 0)]  # the start model's one evaluation
    assert moved.seed_pairs([5], [1, 2]) == [(0, 0), (0, 1)]
    assert moved.seed_pairs([1, 2], [3, 2]) == [(1, 1)]
    assert moved.seed_pairs([1, 2], [3, 4]) == []


def stack(by_seed, k=None):
    return np.stack([at_k(by_seed[s], k) if k else curve(by_seed[s]) for s in sorted(by_seed)])


def test_counts_and_crossings_over_seed_pairs_with_their_t_interval():
    m = moved.compare(stack(BRANCH, 4), stack(GRPO, 4), stack(BRANCH), stack(GRPO), [0, 1], [0, 1], k=4)
    assert m.seeds == [(0, 0), (1, 1)] and m.problems == 6 and m.n == 4
    assert [np.flatnonzero(x).tolist() for x in m.lost] == [[1], [0, 1]]
    assert [np.flatnonzero(x).tolist() for x in m.gained] == [[3], [3]]
    each = moved.seed_mean([1, 2])  # mean 1.5, se sqrt(0.5 / 2) = 0.5, t on 1 df
    assert (each.diff, each.lo, each.hi) == pytest.approx((1.5, 1.5 - T1 * 0.5, 1.5 + T1 * 0.5))
    lost = m.count("lost")  # 1 and 2 lost: that interval, within the 0 to 6 problems a count can be
    assert (lost.diff, lost.lo, lost.hi) == (1.5, 0.0, 6.0)
    assert m.count_text("gained") == "1.0 [1.0, 1.0]"  # the same in both pairs
    assert m.everywhere("lost").tolist() == [1] and m.share("lost").tolist() == [0.5, 1, 0, 0, 0, 0]
    assert m.crossings == [1, 1] and m.crossing_text() == "1.0 [1.0, 1.0] (per seed pair: 1, 1)"

    base = np.stack([at_k(BASE, 4)]), np.stack([curve(BASE)])
    vs_base = moved.compare(
        stack(BRANCH, 4), base[0], stack(BRANCH), base[1], [0, 1], [0], k=4, ref_is_base=True
    )
    assert vs_base.crossings == [4, 3]
    assert vs_base.crossing_text() == "3.5 [1.0, 4.0] (per seed pair: 4, 3)"  # 3.5 -+ 6.35, within k = 1..4
    mixed = moved.compare(stack(GRPO, 4), base[0], stack(GRPO), base[1], [0, 1], [0], k=4, ref_is_base=True)
    assert mixed.crossings == [4, None]
    assert mixed.crossing_text() == "per seed pair: 4, — (—: no crossing up to k = 4)"
    assert mixed.crossing_interval() is None and math.isnan(mixed.summary()["crossing"])

    one = moved.compare(stack({0: GRPO[1]}, 4), base[0], stack({0: GRPO[1]}), base[1], [0], [0], k=4)
    assert one.count_text("lost") == "1.0 (one seed: no interval)"  # problem 3: the start model only
    assert one.crossing_text() == "no crossing up to k = 4"
    # a trained row with one seed measures no seed noise, however many seeds the other has
    g0 = {0: GRPO[0]}
    lone = moved.compare(stack(BRANCH, 4), stack(g0, 4), stack(BRANCH), stack(g0), [0, 1], [0], k=4)
    assert lone.count_text("lost") == "1.5 (one seed: no interval)"
    assert lone.crossing_text() == "1.0 (one seed: no interval; per seed pair: 1, 1)"
    with pytest.raises(ValueError, match="no seed in common"):
        moved.compare(stack(BRANCH, 4), stack(GRPO, 4), stack(BRANCH), stack(GRPO), [0, 1], [2, 3], k=4)


def test_the_per_problem_frame_and_the_testbed_labels():
    params = {
        "eval.datasets.arith_heldout._target_": "sage.testbed.task.heldout_rows",
        "eval.datasets.arith_heldout.n": "6",
        "eval.limit": "None",
        "model.source.world": "graded",
    }
    ids, tiers = moved.problem_labels(params, "arith_heldout")
    rows = heldout_rows(6)
    assert ids == [r["id"] for r in rows]
    assert tiers == [tier_of(int(r["problem"].split("*")[1].split("+")[0])) for r in rows]
    fork = moved.problem_labels({**params, "model.source.world": "fork", "eval.limit": "3"}, "arith_heldout")
    a_b = [tuple(map(int, r["problem"].rstrip("=").split("+")[0].split("*"))) for r in rows[:3]]
    assert fork == (ids[:3], [problem_tier("fork", a, b) for a, b in a_b])
    assert moved.problem_labels(params, "math500") == "math500 is not the testbed's (no _target_ logged)"

    m = moved.compare(stack(BRANCH, 4), stack(GRPO, 4), stack(BRANCH), stack(GRPO), [0, 1], [0, 1], k=4)
    passes = {
        "GRPO": (stack(GRPO, 1).mean(0), stack(GRPO, 4).mean(0)),
        "GRPO + Branch": (stack(BRANCH, 1).mean(0), stack(BRANCH, 4).mean(0)),
    }
    frame = moved.problems_frame(6, passes, 4, {"GRPO + Branch vs GRPO": m}, ids, tiers)
    assert list(frame.columns) == [
        "problem", "id", "tier", "GRPO pass@1", "GRPO pass@4", "GRPO + Branch pass@1", "GRPO + Branch pass@4",
        "GRPO + Branch vs GRPO lost", "GRPO + Branch vs GRPO gained",
    ]  # fmt: skip
    assert frame["GRPO pass@1"].tolist() == pytest.approx([1, 7 / 8, 0.5, 0, 0.25, 0.125])
    assert frame["GRPO + Branch vs GRPO gained"].tolist() == [0, 0, 0, 1, 0, 0]
    bare = moved.problems_frame(6, passes, 4)
    assert bare["id"].tolist() == [""] * 6 and bare["problem"].tolist() == list(range(6))


# ------------------------------------------------------------------ through sage-report
DS = "arith_heldout"


def constructed_store(root: Path, ds: str = DS, ids: list[str] | None = None) -> str:
    """Two methods x two seeds of finished sage-train runs, as sage logs them without the training: tags,
    the params that name the evaluated problems, pass@1 / pass@4 metrics and the correctness matrices
    (one evaluation seed, 6 testbed problems x 4 samples) of the start model and the trained one."""
    from mlflow.tracking import MlflowClient

    from sage.metrics import metric_name, pass_at_k_curve

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("moved")
    params = {
        f"eval.datasets.{ds}._target_": "sage.testbed.task.heldout_rows",
        f"eval.datasets.{ds}.n": "6",
        "eval.limit": "None",
        "model.source.world": "graded",
    }
    if ds != DS:  # a benchmark: its rows come from a file sage-report does not open
        params = {f"eval.datasets.{ds}._target_": "sage.data.benchmarks.benchmark_rows", "eval.limit": "6"}
    for method, by_seed in (("grpo", GRPO), ("grpo_branch", BRANCH)):
        for seed, counts in by_seed.items():
            tags = {"sage.kind": "train", "seed": str(seed), "method": method, "base_model": "tiny"}
            run_id = client.create_run(exp, tags=tags).info.run_id
            for key, value in {**params, "seed": str(seed)}.items():
                client.log_param(run_id, key, value)
            for label, c in (("base", BASE), ("trained", counts)):
                correct = matrix(c)
                for k, v in pass_at_k_curve(correct, [1, 4]).items():
                    client.log_metric(run_id, metric_name(label, ds, f"pass@{k}"), v)
                npz = root / run_id / f"{label}_{ds}_correct.npz"
                npz.parent.mkdir(parents=True, exist_ok=True)
                np.savez_compressed(npz, correct)
                client.log_artifact(run_id, str(npz), artifact_path=f"eval/{label}")
                if ids is not None:  # as Tracker.log_eval logs them beside the matrices
                    listed = root / run_id / f"{label}_{ds}_problems.json"
                    listed.write_text(json.dumps(ids))
                    client.log_artifact(run_id, str(listed), artifact_path=f"eval/{label}")
            client.set_terminated(run_id)
    return uri


def test_sage_report_writes_which_problems_moved_from_a_constructed_store(tmp_path, capsys):
    from sage.grid import answer

    uri = constructed_store(tmp_path)
    out = tmp_path / "report" / "r.md"
    argv = ["--tracking-uri", uri, "--experiment", "moved", "--out", str(out), "--perplexity-max", "0"]
    assert report.main(argv) == 0, capsys.readouterr().err
    md = out.read_text()
    section = md.split("## Which problems moved\n")[1].split("\n## ")[0]
    lost = "1.5 [0.0, 6.0]"  # 1 and 2 over two seed pairs: 1.5 -+ 6.35, within the 6 problems
    want = [
        f"| GRPO + Branch vs GRPO | {DS} | 4 | 6 | {lost} | 1.0 [1.0, 1.0] | "
        "1.0 [1.0, 1.0] (per seed pair: 1, 1) |",
        f"| GRPO vs base | {DS} | 4 | 6 | 1.0 [1.0, 1.0] | {lost} | "
        "per seed pair: 4, — (—: no crossing up to k = 4) |",
        f"| GRPO + Branch vs base | {DS} | 4 | 6 | {lost} | {lost} | 3.5 [1.0, 4.0] (per seed pair: 4, 3) |",
    ]
    for line in want:
        assert line in section.splitlines(), section
    assert "below 0.5 x the other row's" in section
    ids = [r["id"] for r in heldout_rows(6)]
    every = f"GRPO + Branch vs GRPO on {DS}, in every seed pair: lost 1 (`{ids[1]}`), gained 1 (`{ids[3]}`)"
    assert f"- {every}" in section.splitlines()

    tables = out.parent / "tables"
    numbers = pd.read_csv(tables / "moved.csv")
    assert list(numbers.columns) == moved.SUMMARY
    first = numbers.iloc[0]
    assert first[["row", "reference", "lost", "lost_lo"]].tolist() == ["GRPO + Branch", "GRPO", 1.5, 0]
    assert numbers["crossings"].tolist() == ["1;1", "4;none", "4;3"]
    problems = pd.read_csv(tables / f"problems_{DS}.csv", keep_default_na=False)
    assert problems["id"].tolist() == ids
    assert set(problems["tier"]) <= {"easy", "hard", "tail"}
    assert problems["base pass@4"].astype(float).tolist() == [1, 1, 1, 1, 0, 0]
    assert problems["GRPO + Branch vs base lost"].astype(float).tolist() == [0.5, 1, 0, 0, 0, 0]

    # the grid's closing answer carries the section's lines
    printed = answer(md, [], None, None, "u", "g").splitlines()
    assert any(line.startswith("Which problems moved (problems lost / gained") for line in printed)
    assert want[0] in printed

    assert report.main([*argv, "--lost-threshold", "0"]) == 2
    assert "--lost-threshold must be in (0, 1], not 0.0" in capsys.readouterr().err


def test_a_benchmarks_per_problem_csv_names_its_problems_by_the_ids_the_evaluations_logged(tmp_path, capsys):
    """Issue 49: a benchmark's rows (files sage-report does not open) had neither ids nor tiers in
    problems_<dataset>.csv; its evaluations now log the ids of their matrices' problems."""
    ids = [f"test/algebra/{i}.json" for i in (17, 3, 250, 9, 41, 77)]
    uri = constructed_store(tmp_path, "math500", ids)
    out = tmp_path / "report" / "r.md"
    argv = ["--tracking-uri", uri, "--experiment", "moved", "--out", str(out), "--perplexity-max", "0"]
    assert report.main(argv) == 0, capsys.readouterr().err
    problems = pd.read_csv(out.parent / "tables" / "problems_math500.csv", keep_default_na=False)
    assert problems["id"].tolist() == ids and set(problems["tier"]) == {""}
    lost, gained = ids[1], ids[3]  # as on the testbed's problems above: the same matrices
    assert f"lost 1 (`{lost}`), gained 1 (`{gained}`)" in out.read_text()
    assert "problems_math500.csv: no ids nor tiers" not in out.read_text()
