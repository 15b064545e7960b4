"""Issue 47, "one evaluation per label everywhere": a run re-evaluated under other settings reports only its
latest evaluation in every table (the tier and strategy tables too), no row (the base row included) averages
evaluations of different settings, MLflow marks what an earlier evaluation left, and ``--grid latest`` is
the grid whose driver ran last, named in one line. Synthetic MLflow stores written by sage.tracking's own
Tracker, read back through sage-report's command line (``analysis.report.main``)."""

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from analysis import load, report
from sage.metrics import pass_at_k_over_seeds
from sage.parent_runs import PARENT_KIND, STUDY_TAG, SWEEP_TAG
from sage.tracking import PARENT_TAG, eval_tag, start_run

DS = "arith_heldout"


def tracked_cfg(uri: str, seed: int, n_samples: int, ks: list[int]):
    """What start_run reads of a config: the tracking node, a seed, a method, the eval keys a resume
    changes."""
    from sage.config import TrackingConfig

    cfg = OmegaConf.create(
        {"seed": seed, "method": "grpo", "eval": {"n_samples": n_samples, "ks": ks, "seeds": [0]}}
    )
    cfg.tracking = OmegaConf.structured(TrackingConfig(uri=uri, experiment="one"))
    return cfg


def matrix(p: float, problems: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((problems, n)) < p


def evaluate(tracker, label: str, m: np.ndarray, ks: list[int], step: int, pattern: float, ppl=None):
    """log_eval and log_analyses as sage-train calls them: pass@k, then the tier figures of the testbed
    (pass@1 and pass@n of the one tier 'easy'), a pattern frequency (NaN: nothing to measure, not logged) and
    a strategy share."""
    n = m.shape[1]
    result = {"summary": pass_at_k_over_seeds([m], ks), "correct": [m], "completions": [[["x"] * n] * len(m)]}
    tracker.log_eval(label, DS, result, ks, None, step=step)
    tiers = pass_at_k_over_seeds([m], sorted({1, n}))
    values = {f"tier/easy/pass@{k}": tiers[f"pass@{k}"] for k in sorted({1, n})}
    values |= {"pattern/verify": pattern, "strategy/other": float(m.mean())}
    tracker.log_analyses(label, DS, values, ppl)
    return tiers


def record(client, run_id: str, label: str = "trained") -> dict:
    return json.loads(client.get_run(run_id).data.tags[eval_tag(label, DS)])


def table(out, name: str) -> dict[tuple[str, str], dict]:
    text = (out.parent / "tables" / f"{name}.csv").read_text()
    return {(r["row"], r["column"]): r for r in csv.DictReader(io.StringIO(text))}


# ------------------------------------------------------------------ MLflow: what an earlier evaluation left
def test_mlflow_marks_what_an_earlier_evaluation_left_and_shows_the_latest_value(tmp_path):
    """n=2, then n=4 (ks [1, 4]), then n=2 again, at the same step: the eval tag names the latest
    evaluation's settings and lists as stale every metric of that label and dataset only an earlier one
    logged; a value an earlier evaluation logged under the same key and step is logged again, so that the
    run shows the latest evaluation's (it once kept n=4's pass@1 under the n=2 tag)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    out = tmp_path / "run"
    out.mkdir()
    two, four = matrix(0.4, 6, 2, 0), matrix(0.6, 6, 4, 1)
    runs = [(2, [1, 2], two, 0.5), (4, [1, 4], four, float("nan")), (2, [1, 2], two, 0.5)]
    for attempt, (n, ks, m, pattern) in enumerate(runs):
        with start_run(tracked_cfg(uri, 1, n, ks), out, kind="train", resume=attempt > 0) as tracker:
            evaluate(tracker, "trained", m, ks, step=2, pattern=pattern)
            run_id = tracker.run_id
        rec = record(client, run_id)
        metrics = client.get_run(run_id).data.metrics
        assert {k: rec[k] for k in ("step", "ks", "n_samples", "seeds", "problems")} == {
            "step": 2, "ks": ks, "n_samples": n, "seeds": 1, "problems": 6,
        }  # fmt: skip
        assert metrics[f"pass_at_1/trained/{DS}"] == pytest.approx(m.mean())  # the latest evaluation's
        if attempt == 1:
            assert rec["stale"] == [
                f"pass_at_2/trained/{DS}",
                f"pattern/verify/trained/{DS}",  # NaN in the n=4 evaluation: 0.5 is the n=2 one's
                f"tier/easy/pass_at_2/trained/{DS}",
            ]
        else:
            expected = (
                [] if attempt == 0 else [f"pass_at_4/trained/{DS}", f"tier/easy/pass_at_4/trained/{DS}"]
            )
            assert rec["stale"] == expected
    # the report reads the latest evaluation alone, pass@k and analyses alike
    frame = load.runs_frame(load.fetch_runs(client, "one"))
    assert sorted(load.eval_frame(frame)["k"]) == [1, 2]
    names = set(load.analysis_frame(frame)["name"])
    assert names == {"easy/pass_at_1", "easy/pass_at_2", "verify", "other"}


def test_perplexities_of_an_earlier_evaluation_are_marked_only_when_the_samples_changed(tmp_path):
    """A resume evaluating the same model under the same settings samples the same completions: the
    perplexities it does not score again are still its own. Extended (the trained model at another step),
    they are the earlier model's: stale."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    out = tmp_path / "run"
    out.mkdir()
    m = matrix(0.5, 4, 2, 0)
    steps = [(2, [1.5, 2.5]), (2, None), (4, None)]  # perplexities scored once, as log_analyses does
    for attempt, (step, ppl) in enumerate(steps):
        with start_run(tracked_cfg(uri, 1, 2, [1, 2]), out, kind="train", resume=attempt > 0) as tracker:
            evaluate(tracker, "trained", m, [1, 2], step=step, pattern=0.5, ppl=ppl)
            run_id = tracker.run_id
        stale = record(client, run_id)["stale"]
        assert stale == ([] if step == 2 else [f"perplexity_median/trained/{DS}"])


# ------------------------------------------------------------------ the report: one evaluation per row
@pytest.fixture(scope="module")
def reevaluated(tmp_path_factory):
    """GRPO at seeds 1, 2, 3, each evaluating the start model and its trained model at n=2 (ks [1, 2]);
    seed 3 resumed and re-evaluated at n=4 (ks [1, 4]), the issue's probe."""
    root = tmp_path_factory.mktemp("reevaluated")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    ids, values = {}, {}
    attempts = [(s, 2, [1, 2]) for s in (1, 2, 3)] + [(3, 4, [1, 4])]
    for seed, n, ks in attempts:
        out = root / f"s{seed}"
        out.mkdir(exist_ok=True)
        with start_run(tracked_cfg(uri, seed, n, ks), out, kind="train", resume=seed in ids) as tracker:
            tracker.set_tag("base_model", "/start")
            for label, p in (("base", 0.3), ("trained", 0.6)):
                m = matrix(p, 8, n, 0 if label == "base" else 10 * seed + n)
                values[(label, seed, n)] = evaluate(tracker, label, m, ks, step=0 if label == "base" else 2,
                                                    pattern=0.5 if n == 2 else float("nan"))  # fmt: skip
            ids[seed] = tracker.run_id
    return {"uri": uri, "client": client, "root": root, "ids": ids, "values": values}


def test_the_report_reads_each_runs_latest_evaluation_and_splits_the_base_row(reevaluated, capsys):
    """The issue's tier table showed "easy pass@1 0.250, pass@2 0.000" for the re-evaluated run (a stale
    pass@2 beside a new pass@1), and its Methods table averaged the start model's n=2 and n=4 evaluations in
    one base row. Now the re-evaluated run's rows show its n=4 evaluation alone, and the base row is split
    by the settings the start model was evaluated under, with a note naming the runs."""
    s = reevaluated
    out = s["root"] / "report" / "r.md"
    argv = ["--tracking-uri", s["uri"], "--experiment", "one", "--out", str(out), "--bootstrap", "0"]
    assert report.main([*argv, "--perplexity-max", "0", "--min-seeds", "1"]) == 0
    err = capsys.readouterr().err
    v = s["values"]

    methods = table(out, "ablation")
    rows = {r for r, _ in methods}
    base2, base4 = "base [eval.n_samples=2]", "base [eval.n_samples=4]"
    assert base2 in rows and base4 in rows and "base" not in rows
    (grpo4,) = [r for r in rows if r.startswith("GRPO") and "eval.n_samples=4" in r]
    (grpo2,) = [r for r in rows if r.startswith("GRPO") and "eval.n_samples=2" in r]
    pass1 = f"{DS} pass@1"
    assert float(methods[(base2, pass1)]["mean"]) == pytest.approx(v[("base", 1, 2)]["pass@1"])
    assert methods[(base2, pass1)]["seeds"] == "2"  # seeds 1 and 2, both n=2
    assert float(methods[(base4, pass1)]["mean"]) == pytest.approx(v[("base", 3, 4)]["pass@1"])
    assert methods[(base4, pass1)]["seeds"] == "1"
    assert float(methods[(grpo4, pass1)]["mean"]) == pytest.approx(v[("trained", 3, 4)]["pass@1"])
    notes = [ln.removeprefix("note: ") for ln in err.splitlines() if ln.startswith("note: ")]
    (split,) = [n for n in notes if n.startswith("the start model /start is split into 2 base rows")]
    assert "evaluated it under different settings, never averaged: " in split
    two = split.split(f"{base2} (runs ")[1].split(")")[0]
    assert sorted(two.split(", ")) == sorted([s["ids"][1], s["ids"][2]])
    assert f"{base4} (runs {s['ids'][3]})" in split

    # the tier table: the re-evaluated run's pass@1 and pass@4, and no pass@2 of its earlier evaluation
    tiers = table(out, "tier_pass")
    for row, label in ((grpo4, "trained"), (base4, "base")):
        assert float(tiers[(row, "easy/pass_at_1")]["mean"]) == pytest.approx(v[(label, 3, 4)]["pass@1"])
        assert float(tiers[(row, "easy/pass_at_4")]["mean"]) == pytest.approx(v[(label, 3, 4)]["pass@4"])
        assert tiers[(row, "easy/pass_at_2")]["seeds"] == "0"  # nothing: "—"
        # the pattern the n=4 evaluation could not measure is not the n=2 one's 0.5
        assert table(out, "reasoning_patterns")[(row, "verify")]["seeds"] == "0"
        assert float(table(out, "strategy_mix")[(row, "other")]["mean"]) < 1
    assert tiers[(grpo2, "easy/pass_at_4")]["seeds"] == "0"
    assert tiers[(grpo2, "easy/pass_at_2")]["seeds"] == "2"


def test_runs_of_one_row_whose_evaluations_differ_in_problems_are_split(tmp_path, capsys):
    """Same params, but one seed's evaluation saw other problems (its data file changed): the row splits by
    what the evaluations' tags record, and the note names the runs and the setting; a store without the tag
    splits nothing."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    for seed, problems in ((1, 8), (2, 8), (3, 6)):
        out = tmp_path / f"s{seed}"
        out.mkdir()
        with start_run(tracked_cfg(uri, seed, 2, [1, 2]), out, kind="train") as tracker:
            tracker.set_tag("base_model", "/start")
            evaluate(tracker, "base", matrix(0.3, problems, 2, 0), [1, 2], step=0, pattern=0.5)
            evaluate(tracker, "trained", matrix(0.6, problems, 2, seed), [1, 2], step=2, pattern=0.5)
    out = tmp_path / "r" / "r.md"
    argv = ["--tracking-uri", uri, "--experiment", "one", "--out", str(out), "--bootstrap", "0"]
    assert report.main([*argv, "--perplexity-max", "0", "--min-seeds", "1"]) == 0
    notes = [
        ln.removeprefix("note: ") for ln in capsys.readouterr().err.splitlines() if ln.startswith("note")
    ]
    rows = {r for r, _ in table(out, "ablation")}
    assert rows == {f"{r} [{DS} problems={p}]" for r in ("base", "GRPO") for p in (6, 8)}
    (split,) = [n for n in notes if n.startswith("GRPO is split into 2 rows")]
    assert f"differ in {DS} problems:" in split
    assert any(n.startswith("the start model /start is split into 2 base rows") for n in notes)
    # runs logged before the tag recorded problems: nothing to split by
    frame = load.runs_frame(load.fetch_runs(client, "one"))
    frame["row"] = "GRPO"
    frame["tags"] = [{k: v for k, v in t.items() if not k.startswith("sage.eval.")} for t in frame["tags"]]
    assert set(load.split_by_evaluation(frame)[0]) == {"GRPO"}


# ------------------------------------------------------------------ --grid latest
def grid_store(tmp_path, extended_parent_end: bool):
    """Grid A (a sweep dir) ran first, an Optuna study after it, then A was extended: its parent run, made
    by A's first launch, is continued, so its start time is the oldest."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("g")

    def parent(name, tag, value, start, end):
        tags = {tag: value, "sage.kind": PARENT_KIND}
        run_id = client.create_run(exp, start_time=start, tags=tags, run_name=name).info.run_id
        client.set_terminated(run_id, end_time=end)
        return run_id

    def child(parent_id, seed, start, end):
        tags = {"sage.kind": "train", "seed": str(seed), "method": "grpo", PARENT_TAG: parent_id}
        run_id = client.create_run(exp, start_time=start, tags=tags).info.run_id
        for label in ("base", "trained"):
            client.log_metric(run_id, f"pass_at_1/{label}/{DS}", 0.5)
        client.set_terminated(run_id, end_time=end)

    a = parent("grid-a", SWEEP_TAG, "/sweeps/a", 1_000_000, 2_000_000)
    child(a, 1, 1_100_000, 1_900_000)
    b = parent("grid-b", SWEEP_TAG, "/sweeps/b", 2_500_000, 2_600_000)
    child(b, 1, 2_510_000, 2_590_000)
    study = parent("study-s", STUDY_TAG, "s in sqlite:///o.db", 3_000_000, 4_000_000)
    child(study, 1, 3_100_000, 3_900_000)
    # A extended: a new job, and (when its driver closed) the parent's end
    child(a, 2, 5_000_000, 5_500_000)
    if extended_parent_end:
        client.update_run(a, status="RUNNING")
        client.set_terminated(a, end_time=6_000_000)
    return uri, {"a": a, "b": b, "study": study}


@pytest.mark.parametrize("extended_parent_end", [True, False])
def test_grid_latest_is_the_grid_whose_driver_ran_last_and_says_which(tmp_path, capsys, extended_parent_end):
    """The issue's probe: --grid latest reported an Optuna study, not the grid just extended. Now it is the
    grid (sweep dir) whose parent or runs started or ended last, named in one line with its sweep dir;
    without the parent's end (a driver still running) its newest job decides."""
    uri, ids = grid_store(tmp_path, extended_parent_end)
    out = tmp_path / "r" / "r.md"
    argv = ["--tracking-uri", uri, "--experiment", "g", "--out", str(out), "--bootstrap", "0"]
    assert report.main([*argv, "--grid", "latest", "--perplexity-max", "0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    (line,) = [ln for ln in printed if ln.startswith("grid:")]
    when = "01:40:00" if extended_parent_end else "01:31:40"  # 6,000 s or 5,500 s after the epoch
    assert line == (
        f"grid: the grid whose driver ran last (at 1970-01-01 {when} UTC), 'grid-a' in sweep dir /sweeps/a "
        f"(parent run {ids['a']}): its runs only"
    )
    assert "2 finished sage-train runs used" in out.read_text()
    # a grid named explicitly: the same line without the why; a study can still be named
    assert report.main([*argv, "--grid", "grid-b", "--perplexity-max", "0"]) == 0
    assert (
        f"grid: 'grid-b' in sweep dir /sweeps/b (parent run {ids['b']}): its runs only"
        in capsys.readouterr().out
    )
    assert report.main([*argv, "--grid", "study-s", "--perplexity-max", "0"]) == 0
    assert ", Optuna study s in sqlite:///o.db (parent run" in capsys.readouterr().out


def test_grid_latest_is_an_extension_whose_driver_started_before_any_of_its_jobs(tmp_path, capsys):
    """Issue 47: while an extension's driver runs and none of its jobs has started, the grid it extends is
    the one whose driver ran last: opening the parent run marks when."""
    from sage.grid import grid_key, open_parent

    uri, ids = grid_store(tmp_path, extended_parent_end=True)
    tracking = OmegaConf.create({"enabled": True, "uri": uri, "experiment": "g"})
    assert open_parent(tracking, grid_key(Path("/sweeps/b")), name="grid-b") == ids["b"]  # b extended
    out = tmp_path / "r" / "r.md"
    argv = ["--tracking-uri", uri, "--experiment", "g", "--out", str(out), "--bootstrap", "0"]
    assert report.main([*argv, "--grid", "latest", "--perplexity-max", "0"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("grid:")]
    assert line.endswith(f"'grid-b' in sweep dir /sweeps/b (parent run {ids['b']}): its runs only"), line


def test_grid_latest_over_studies_only_is_one_line(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("g")
    client.create_run(exp, tags={STUDY_TAG: "s in x", "sage.kind": PARENT_KIND}, run_name="study-s")
    argv = ["--tracking-uri", uri, "--experiment", "g", "--out", str(tmp_path / "r.md"), "--grid", "latest"]
    assert report.main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("sage-report")]
    assert err == [
        "sage-report: --grid latest: experiment(s) 'g' hold no grid launched into a sweep dir "
        "(sage-train -m), only Optuna studies: 'study-s'; name one with --grid <its name>"
    ]


def test_a_store_without_the_stale_list_keeps_a_tiers_pass_at_1_and_n_of_the_latest_evaluation():
    """Runs logged before the tag listed stale metrics: a tier's pass@k of the latest evaluation is at k = 1
    and k = n (sage.eval.analyses.tier_figures), so an earlier evaluation's pass@n at another n is left out;
    a run without the tag at all keeps everything."""
    import pandas as pd

    tag = {eval_tag("trained", DS): json.dumps({"step": 2, "ks": [1, 4], "n_samples": 4, "seeds": 1})}
    metrics = {f"tier/easy/pass_at_{k}/trained/{DS}": 0.5 for k in (1, 2, 4)}
    runs = pd.DataFrame({"run_id": ["a", "b"], "metrics": [metrics, metrics], "tags": [tag, {}]})
    frame = load.analysis_frame(runs)
    assert sorted(frame.loc[frame["run_id"] == "a", "name"]) == ["easy/pass_at_1", "easy/pass_at_4"]
    assert len(frame[frame["run_id"] == "b"]) == 3
