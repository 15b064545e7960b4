"""sage-report: tables from hand-made frames (unit tests), and every table and figure built from a throwaway
MLflow store filled by real tiny testbed runs, checked against the values MLflow recorded (slow)."""

import argparse
import json
import math
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import prefork
import pytest

from analysis import assemble, load, report, snapshot, tables
from analysis.load import ReportError
from analysis.sections import differences
from analysis.tables import Stat, stat
from sage.eval.analyses import TESTBED_PROBLEM
from sage.testbed.task import heldout_rows, tier_of


# ------------------------------------------------------------------ pure functions
def test_metric_names_are_read_in_the_current_and_the_earlier_layout():
    """sage-report reads what sage.metrics.metric_name logs, and stores logged before that naming
    (eval/<label>/<dataset>/<figure>): no recorded run drops out of a report."""
    from sage.metrics import metric_name

    now = {
        metric_name("trained", "math500", "pass@4"): 0.5,
        metric_name("base", "math500", "pass@4_std"): 0.1,
        metric_name("trained", "math500", "strategy/case analysis"): 0.25,
        metric_name("periodic", "math500", "pass@1"): 0.3,  # during training: not a final evaluation
    }
    earlier = {
        "eval/trained/aime24/pass_at_16": 0.75,
        "eval/base/aime24/pattern/proof by contradiction": 0.5,
        "eval/trained/aime24/perplexity_median": 1.5,  # neither a pass@k nor an analysis figure
    }
    runs = pd.DataFrame({"run_id": ["a", "b"], "metrics": [now, earlier]})
    evals = load.eval_frame(runs).to_dict("records")

    def given(x):  # pandas holds a missing value as NaN
        return None if x is None or x != x else x

    by_key = {
        (e["run_id"], e["label"], e["dataset"], e["k"]): (given(e["value"]), given(e["std"])) for e in evals
    }
    assert by_key == {
        ("a", "trained", "math500", 4): (0.5, None),
        ("a", "base", "math500", 4): (None, 0.1),
        ("b", "trained", "aime24", 16): (0.75, None),
    }
    analyses = load.analysis_frame(runs)[["run_id", "label", "dataset", "kind", "name"]]
    assert sorted(map(tuple, analyses.values.tolist())) == [
        ("a", "trained", "math500", "strategy", "case analysis"),
        ("b", "base", "aime24", "pattern", "proof by contradiction"),
    ]
    for key, dataset in (("pass_at_k_curve/base/x", "x"), ("eval/trained/y/pass_at_k_curve", "y")):
        assert load.CURVE_KEY.match(key)["dataset"] == dataset
    for key in (metric_name("periodic", "z", "pass@1"), "eval/periodic/z/pass_at_1"):
        assert load.PERIODIC_KEY.match(key)["dataset"] == "z"


def test_stat_cells_say_how_many_seeds():
    assert stat([0.4, 0.5], asked=2).text() == "0.450 ± 0.071"  # std ddof=1: sqrt(0.005) = 0.0707
    assert stat([0.4], asked=1).text() == "0.400 ± —"  # one seed: no std, not 0
    assert stat([0.4, 0.5], asked=3).text() == "0.450 ± 0.071 (2/3 seeds)"
    assert stat([], asked=3).text() == "— (0/3 seeds)"
    assert stat([0.4, float("nan")], asked=2) == Stat(0.4, None, 1, 2)  # NaN = not measured


def test_seed_table_leaves_out_unasked_seeds_and_marks_missing_ones():
    frame = pd.DataFrame(
        [("A", 0, "x", 1.0), ("A", 1, "x", 3.0), ("A", 7, "x", 100.0), ("B", 0, "x", 2.0)],
        columns=tables.SEED_FRAME,
    )
    t = tables.seed_table(frame, [0, 1], ["x"], name="t", title="t")
    assert t.cell("A", "x") == Stat(2.0, math.sqrt(2.0), 2, 2)  # seed 7 was not asked for
    assert t.cell("B", "x").text() == "2.000 ± — (1/2 seeds)"


def test_ablation_average_is_per_seed_over_all_datasets():
    rows = [
        # row, seed, run, dataset, k, value
        ("GRPO", 0, "r0", "a", 1, 0.2), ("GRPO", 0, "r0", "a", 8, 0.6),
        ("GRPO", 0, "r0", "b", 1, 0.4), ("GRPO", 0, "r0", "b", 8, 0.8),
        ("GRPO", 1, "r1", "a", 1, 0.4), ("GRPO", 1, "r1", "a", 8, 0.7),
        # seed 1 has no dataset b: it has no average (never an average over a subset of datasets)
    ]  # fmt: skip
    meas = pd.DataFrame(rows, columns=["row", "seed", "run_id", "dataset", "k", "value"])
    t = tables.ablation_table(meas, [0, 1], {"a": 8, "b": 8})
    assert t.columns == ["a pass@1", "a pass@8", "b pass@1", "b pass@8", "avg pass@1", "avg pass@k"]
    assert t.cell("GRPO", "a pass@1") == Stat(pytest.approx(0.3), pytest.approx(math.sqrt(0.02)), 2, 2)
    assert t.cell("GRPO", "avg pass@1") == Stat(pytest.approx(0.3), None, 1, 2)  # (0.2 + 0.4) / 2
    assert t.cell("GRPO", "avg pass@k").text() == "0.700 ± — (1/2 seeds)"  # (0.6 + 0.8) / 2
    md, tex, csv = tables.to_markdown(t), tables.to_latex(t), tables.to_csv(t)
    assert "| GRPO | 0.300 ± 0.141 | 0.650 ± 0.071 | 0.400 ± — (1/2 seeds) |" in md
    assert r"0.300 $\pm$ 0.141" in tex and r"avg pass@1" in tex
    assert "GRPO,avg pass@k,0.7,,1,2,0.700 ± — (1/2 seeds)" in csv


def test_grid_table_rows_thresholds_columns_ratios():
    rows = [
        (0, "0.8", "0.1", "d", 1, 0.5), (1, "0.8", "0.1", "d", 1, 0.7), (0, "0.8", "0.1", "d", 4, 0.9),
        (0, "1.2", "0.3", "d", 1, 0.4),
    ]  # fmt: skip
    meas = pd.DataFrame(rows, columns=["seed", "threshold", "ratio", "dataset", "k", "value"])
    t = tables.grid_table(meas, [0, 1], "d", 4, name="g", title="g")
    assert [r for r, _ in t.rows] == ["threshold=0.8", "threshold=1.2"]
    assert t.columns == ["ratio=0.1 pass@1", "ratio=0.1 pass@4", "ratio=0.3 pass@1", "ratio=0.3 pass@4"]
    assert t.cell("threshold=0.8", "ratio=0.1 pass@1").mean == pytest.approx(0.6)
    assert t.cell("threshold=1.2", "ratio=0.1 pass@1").text() == "— (0/2 seeds)"


def test_thirds_of_training():
    # array_split of 7 steps: [1, 2, 3], [4, 5], [6, 7] -> means 2, 4.5, 6.5
    assert tables.thirds([1, 2, 3, 4, 5, 6, 7]) == (2.0, 4.5, 6.5)
    assert tables.thirds([1, 2]) is None  # a third would be empty


def test_curve_of_an_extended_run_is_its_latest(tmp_path):
    """An extended run logs its trained pass@k curve again at the same k; the report takes the latest."""
    import time

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    key = "pass_at_k_curve/trained/arith_heldout"
    for values in ([0.2, 0.5], [0.3, 0.6]):  # the run's first model, then the extended one
        now = int(time.time() * 1000)
        for k, v in zip([1, 2], values, strict=True):
            client.log_metric(run_id, key, v, step=k, timestamp=now)
        time.sleep(0.01)
    curves = load.curve_frame(client, pd.DataFrame({"run_id": [run_id], "metrics": [{key: 0.6}]}))
    assert curves[["k", "value"]].values.tolist() == [[1, 0.3], [2, 0.6]]
    assert set(curves["label"]) == {"trained"} and set(curves["dataset"]) == {"arith_heldout"}


def test_method_labels_and_rows():
    p: dict[str, str] = {"trl.max_steps": "100"}
    assert load.method_label({"method": "grpo_nokl"}, p, "r") == "GRPO w/o KL"
    assert load.method_label({"method": "my_variant"}, p, "r") == "my_variant"
    derived = {"algorithm": "grpo", "divergence": "forward_kl", "guide": "none"}
    assert load.method_label(derived, p, "r") == "GRPO + forward KL"
    assert (
        load.method_label({**derived, "divergence": "reverse_kl", "guide": "branch"}, p, "r")
        == "GRPO + Branch"
    )
    assert load.method_label({"algorithm": "dr_grpo", "divergence": "none", "guide": "none"}, p, "r") == (
        "Dr.GRPO w/o KL"
    )
    assert load.method_label({}, {"trl.max_steps": "0"}, "r") == "base"
    with pytest.raises(ReportError, match="run r has no 'method' tag and no divergence/guide tag"):
        load.method_label({"algorithm": "grpo"}, p, "r")
    frame = pd.DataFrame(
        {
            "method": ["GRPO", "GRPO", "GRPO + Branch", "GRPO + Branch", "GRPO + Branch"],
            "params": [
                {"seed": "0", "divergence.beta": "0.05", "output_dir": "/a"},
                {"seed": "1", "divergence.beta": "0.05", "output_dir": "/b"},
                {"seed": "0", "guide.ratio": "0.3", "tracking.run_name": "x"},
                {"seed": "1", "guide.ratio": "0.3", "tracking.run_name": "y"},
                {"seed": "0", "guide.ratio": "0.5", "tracking.run_name": "z"},
            ],
        }
    )
    assert list(load.assign_rows(frame)) == [
        "GRPO", "GRPO", "GRPO + Branch [guide.ratio=0.3]", "GRPO + Branch [guide.ratio=0.3]",
        "GRPO + Branch [guide.ratio=0.5]",
    ]  # fmt: skip
    # a group chosen differently is named by its choice (the run's tag), not by its class path
    schedules = pd.DataFrame(
        {
            "method": ["GRPO + Branch"] * 2,
            "params": [{"seed": "0", "schedule._target_": f"s.{c}"} for c in ("Cosine", "Constant")],
            "tags": [{"schedule": c} for c in ("cosine", "constant")],
        }
    )
    assert list(load.assign_rows(schedules)) == [
        "GRPO + Branch [schedule=cosine]", "GRPO + Branch [schedule=constant]"
    ]  # fmt: skip


# ------------------------------------------------------------------ real runs
SHRINK = [
    "trl.max_steps=3",
    "trl.per_device_train_batch_size=16",
    "trl.num_generations=4",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=6",
    "tracking.experiment=report",
]
PERIODIC = ["eval.every_steps=1", "eval.every_n_samples=2"]  # Figure 2's held-out curve, GRPO runs only
RUNS = {
    "g0": ["seed=0", "divergence=reverse_kl", "guide=none", *PERIODIC],
    "g1": ["seed=1", "divergence=reverse_kl", "guide=none", *PERIODIC],
    "b0": ["seed=0", "guide=branch", "guide.threshold=0.5"],
    "b1": ["seed=1", "guide=branch", "guide.threshold=0.5"],
    "r0": ["seed=0", "guide=branch", "guide.threshold=0.5", "guide.ratio=0.5"],  # the grid's second cell
    # another grid's experiment, which a report may join to this one (Table 4 reuses Table 1's runs)
    "c0": ["seed=0", "guide=branch", "guide.threshold=0.5", "schedule=constant", "tracking.experiment=other"],
}
GRPO, BRANCH, BRANCH5 = "GRPO", "GRPO + Branch [guide.ratio=0.3]", "GRPO + Branch [guide.ratio=0.5]"
DS = "arith_heldout"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Five real tiny runs (two at a time on two cores) in a private SQLite store."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("report_store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def run(name):
        cmd = [sys.executable, "-m", "sage.train", *SHRINK, f"output_dir={root / name}", *RUNS[name]]
        r = prefork.run(cmd, timeout=900, env=env)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        return name, (root / name / "mlflow_run_id").read_text()

    with ThreadPoolExecutor(2) as pool:
        ids = dict(pool.map(run, RUNS))
    # sage-eval logs to the same experiment (seed "none"): the report lists it and leaves it out
    evaluated = prefork.run(
        [sys.executable, "-m", "sage.eval", f"checkpoint={root / 'g0' / 'final'}",
         "tracking.experiment=report", "eval.n_samples=4", "eval.ks=[1,4]", "eval.limit=6", "eval.seeds=[0]"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    return {"uri": uri, "client": client, "root": root, "ids": ids}


def logged(store, name, key):
    return store["client"].get_run(store["ids"][name]).data.metrics[key]


def history(store, name, key):
    return [
        m.value
        for m in sorted(store["client"].get_metric_history(store["ids"][name], key), key=lambda m: m.step)
    ]


def sage_report(store, *args, out=None):
    """The installed console script, as users run it."""
    out = out or store["root"] / "report" / "testbed.md"
    argv = ["--tracking-uri", store["uri"], "--out", str(out), *args]
    script = Path(sys.executable).parent / "sage-report"
    r = prefork.run([str(script), *argv], timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return r, out


def report_main(store, capsys, *args, out=None):
    """In-process (faster) run of the same entry point: (exit code, stderr, report path)."""
    out = out or store["root"] / "report_main" / "r.md"
    code = report.main(["--tracking-uri", store["uri"], "--out", str(out), *args])
    return code, capsys.readouterr().err, out


@pytest.fixture(scope="module")
def built(store):
    out = store["root"] / "report" / "testbed.md"
    return assemble.make_report(
        store["client"],
        store["uri"],
        experiment="report",
        out=out,
        figures_dir=out.parent / "figures",
        tables_dir=out.parent / "tables",
        primary=(BRANCH, DS, 4),
    )


@pytest.mark.slow
def test_the_primary_comparison_comes_first_with_the_tables_interval_outside_its_family(built):
    """--primary: the declared comparison opens the report, with the interval the table against the
    reference gives it (the pair's own seed noise), its p-value and power, and without the table's Holm
    mark (it is a family of one)."""
    cell = built.tables["diff_vs_reference"].cell(BRANCH, f"{DS} pass@4")
    first = built.markdown.split("\n## ")[1]
    assert first.startswith("Primary comparison (declared before the run)"), built.markdown[:500]
    assert f"{BRANCH} minus {GRPO} on {DS} at pass@4: **{replace(cell, holm=False).text()}**" in first
    assert f"p = {cell.interval.p:.3f}" in first and f"80% power: {cell.interval.mde:.3f}" in first
    with pytest.raises(report.ReportError, match=r"no trained row 'GRPO \+ Nope'"):
        differences.primary_section(None, ("GRPO + Nope", DS, 4), GRPO, [GRPO, BRANCH], [0, 1])
    assert report.primary_comparison("grpo_branch|arith_tail|256") == ("grpo_branch", "arith_tail", 256)
    for bad in ("grpo_branch|arith_tail", "grpo_branch|arith_tail|0", "a|b|c"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected METHOD\\|DATASET\\|K"):
            report.primary_comparison(bad)


@pytest.mark.slow
def test_seeds_differ_and_all_methods_share_the_base_model(store):
    """Issue 6's checks: training seeds give different samples; every method starts from one base model."""
    client = store["client"]
    runs = {name: client.get_run(run_id) for name, run_id in store["ids"].items()}
    assert len({r.data.tags["base_model"] for r in runs.values()}) == 1
    completions = {}
    for name in ("g0", "g1"):
        run_id = store["ids"][name]
        (artifact,) = [  # the trained model's completions, named by the step it was evaluated at
            f.path
            for f in client.list_artifacts(run_id, "eval/trained")
            if f.path.startswith(f"eval/trained/trained_{DS}_completions_step")
        ]
        path = client.download_artifacts(run_id, artifact, str(store["root"] / f"dl_{name}"))
        completions[name] = Path(path).read_text()
    assert completions["g0"] != completions["g1"]
    assert history(store, "g0", "train/reward") != history(store, "g1", "train/reward")


@pytest.mark.slow
def test_ablation_table_equals_the_logged_metrics(store, built):
    t = built.tables["ablation"]
    assert [r for r, _ in t.rows] == ["base", GRPO, BRANCH, BRANCH5]
    assert t.columns == [f"{DS} pass@1", f"{DS} pass@4"]  # default k: the largest logged
    for row, runs in ((GRPO, ["g0", "g1"]), (BRANCH, ["b0", "b1"])):
        for k in (1, 4):
            values = [logged(store, r, f"pass_at_{k}/trained/{DS}") for r in runs]
            cell = t.cell(row, f"{DS} pass@{k}")
            assert (cell.mean, cell.std, cell.n, cell.asked) == pytest.approx(
                (np.mean(values), np.std(values, ddof=1), 2, 2)
            )
    cell = t.cell(BRANCH5, f"{DS} pass@1")
    assert cell.mean == pytest.approx(logged(store, "r0", f"pass_at_1/trained/{DS}"))
    assert cell.text().endswith("± — (1/2 seeds)")
    base = [logged(store, r, f"pass_at_1/base/{DS}") for r in RUNS]
    assert len(set(base)) == 1 and t.cell("base", f"{DS} pass@1").mean == pytest.approx(base[0])
    csv = (store["root"] / "report" / "tables" / "ablation.csv").read_text()
    assert f"{GRPO},{DS} pass@1,{t.cell(GRPO, f'{DS} pass@1').mean!r}," in csv
    assert (store["root"] / "report" / "tables" / "ablation.tex").read_text().startswith(r"\begin{tabular}")


@pytest.mark.slow
def test_grid_grad_norm_patterns_strategies(store, built):
    grid = built.tables[f"grid_grpo___branch_{DS}"]
    assert [r for r, _ in grid.rows] == ["threshold=0.5"]
    assert grid.cell("threshold=0.5", "ratio=0.5 pass@4").mean == pytest.approx(
        logged(store, "r0", f"pass_at_4/trained/{DS}")
    )
    pair = [logged(store, r, f"pass_at_1/trained/{DS}") for r in ("b0", "b1")]
    assert grid.cell("threshold=0.5", "ratio=0.3 pass@1").mean == pytest.approx(np.mean(pair))

    grad = built.tables["grad_norm_thirds"]
    thirds = {r: tables.thirds(history(store, r, "train/grad_norm")) for r in ("g0", "g1")}
    assert all(len(history(store, r, "train/grad_norm")) == 3 for r in ("g0", "g1"))
    for i, col in enumerate(tables.THIRDS):
        assert grad.cell(GRPO, col).mean == pytest.approx(np.mean([thirds["g0"][i], thirds["g1"][i]]))

    mix = built.tables["strategy_mix"]
    for row, cells in mix.rows:
        assert sum(c.mean for c in cells) == pytest.approx(1.0), row
    pat = built.tables["reasoning_patterns"]
    assert pat.columns == ["constraint setup", "structural reasoning", "proof by contradiction"]
    assert all(c.mean == 0.0 for _, cells in pat.rows for c in cells if c.n)  # bare arithmetic: no patterns

    # by tier (the graded world's: by multiplier); the tiers' pass@1 weighted by their problems is the whole's
    counts = Counter(tier_of(int(TESTBED_PROBLEM.fullmatch(r["problem"])[2])) for r in heldout_rows()[:6])
    for r in ("g0", "b0"):
        whole = logged(store, r, f"pass_at_1/trained/{DS}")
        parts = [n / 6 * logged(store, r, f"tier/{t}/pass_at_1/trained/{DS}") for t, n in counts.items()]
        assert sum(parts) == pytest.approx(whole), r
    by_tier = built.tables["tier_pass"]
    assert set(by_tier.columns) == {f"{t}/pass_at_{k}" for t in counts for k in (1, 4)}
    assert by_tier.cell(GRPO, f"{next(iter(counts))}/pass_at_1").n == 2  # two seeds
    assert "rare_share" not in built.tables  # no fork-world model here


@pytest.mark.slow
def test_figures_perplexity_and_report_file(store, built):
    for name in ("passk_arith_heldout", "reward_vs_heldout", "perplexity"):
        assert built.figures[name].stat().st_size > 1000, name
    md = built.markdown
    assert "Provenance: experiment `report` in `sqlite:///" in md and "5 finished sage-train runs used" in md
    assert "kind 'eval'" in md  # the sage-eval run of the same experiment is named and left out
    assert "](figures/passk_arith_heldout.png)" in md and "## Branch threshold x ratio (Table 6)" in md
    ppl = built.tables["perplexity"]
    for _, cells in ppl.rows:
        assert int(cells[0]) > 0 and 1.0 <= float(cells[1])  # a perplexity is at least 1

    # what the report shows is what the evaluation logged, under the run's base model
    logged_ppl = json.loads(
        Path(
            store["client"].download_artifacts(
                store["ids"]["g0"], f"eval/trained/trained_{DS}_perplexity.json", str(store["root"] / "dl")
            )
        ).read_text()
    )
    assert len(logged_ppl) == 6 * 4 and min(logged_ppl) >= 1.0  # eval.limit x eval.n_samples, none empty
    assert logged(store, "g0", f"perplexity_median/trained/{DS}") == pytest.approx(np.median(logged_ppl))


@pytest.mark.slow
def test_where_the_anchor_acted_by_entropy_bucket_from_the_training_logs(store, built):
    """Issue 49: the report shows each row's anchor metrics by token-entropy bucket, from what the runs
    logged at each step (train/anchor_buckets/...), and one step x bucket figure per row."""
    from sage.train.figures import BUCKETS

    share = built.tables["anchor_buckets_anchor_grad_share"]
    # the quintiles always hold tokens; above 1.2 nats only if some step had one
    assert share.columns[:5] == list(BUCKETS[:5]) and set(share.columns) <= set(BUCKETS)
    assert [r for r, _ in share.rows] == [GRPO, BRANCH, BRANCH5]
    # the GRPO row's q1 cell: over its seeds, the mean of what each run logged at each step
    key = "train/anchor_buckets/q1/anchor_grad_share"
    logged = [store["client"].get_metric_history(store["ids"][run], key) for run in ("g0", "g1")]
    per_seed = [np.nanmean([m.value for m in h]) for h in logged]
    assert share.cell(GRPO, "q1").mean == pytest.approx(np.mean(per_seed))
    q = built.tables["anchor_buckets_q"]
    assert q.cell(GRPO, "q5").mean == pytest.approx(1.0)  # no guide: q = 1 everywhere
    # Branch's q rises with entropy only: its highest quintile's mean q is at least its lowest's
    assert q.cell(BRANCH, "q5").mean >= q.cell(BRANCH, "q1").mean
    for row in (GRPO, BRANCH, BRANCH5):
        figure = built.figures[f"anchor_buckets_{''.join(c if c.isalnum() else '_' for c in row).strip('_')}"]
        assert figure.stat().st_size > 1000 and f"](figures/{figure.name})" in built.markdown


@pytest.mark.slow
def test_the_perplexity_cap_is_per_row_of_a_run_not_per_run(store):
    """Issue 47: the cap took a run's first samples whatever their row, so a run that also supplied the base
    row kept its base samples and one trained sample; every row now keeps up to the cap of each run."""
    import csv

    out = store["root"] / "report_cap" / "r.md"
    # each run's evaluation logged eval.limit x eval.n_samples = 24 perplexities per model
    r, _ = sage_report(store, "--experiment", "report", "--perplexity-max", "24", out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = list(csv.DictReader((out.parent / "tables" / "perplexity.csv").open()))
    samples = {c["row"]: int(c["text"]) for c in cells if c["column"] == "samples"}
    assert samples[GRPO] == 48 and samples[BRANCH] == 48 and samples[BRANCH5] == 24, samples
    assert samples["base"] % 24 == 0 and samples["base"] > 0, samples


@pytest.mark.slow
def test_cli_marks_missing_seeds_and_explains_missing_data(store, capsys):
    r, out = sage_report(store, "--experiment", "report", "--seeds", "0,1,2", "--perplexity-max", "0")
    assert r.returncode == 0, r.stderr
    md = out.read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {GRPO} |"))
    assert row.count("(2/3 seeds)") == 2

    client = store["client"]
    client.create_experiment("empty")
    code, err, _ = report_main(store, capsys, "--experiment", "empty")
    assert code == 2 and err.strip() == "sage-report: experiment 'empty' has no runs"
    code, err, _ = report_main(store, capsys, "--experiment", "nope")
    assert code == 2 and "no experiment 'nope' in this store (experiments there:" in err
    code, err, _ = report_main(store, capsys, "--tracking-uri", f"sqlite:///{store['root'] / 'absent.db'}")
    assert code == 2 and "no MLflow store at" in err

    # a run that logged no evaluation (e.g. eval.at_end=false): alone, a one-line error; among others,
    # its row is marked as missing a seed and the notes name the metrics it lacks
    exp = client.create_experiment("no_eval")
    run = client.create_run(exp, tags={"sage.kind": "train", "seed": "2", "method": "grpo"})
    client.log_metric(run.info.run_id, "train/grad_norm", 0.1, step=1)
    client.set_terminated(run.info.run_id)
    code, err, _ = report_main(store, capsys, "--experiment", "no_eval")
    assert code == 2
    assert err.strip() == (
        "sage-report: none of the 1 runs logged pass_at_<k>/<base|trained>/<dataset> metrics "
        "(trained with eval.at_end=false?): nothing to tabulate"
    )
    ids = ",".join([store["ids"]["g0"], store["ids"]["g1"], run.info.run_id])
    code, err, out = report_main(store, capsys, "--run-ids", ids, "--perplexity-max", "0")
    assert code == 0, err
    md = out.read_text()
    assert f"{GRPO} seed 2 (run {run.info.run_id}) lacks pass_at_1/trained/{DS}, pass_at_4/trained/{DS}" in md
    assert next(line for line in md.splitlines() if line.startswith(f"| {GRPO} |")).count("(2/3 seeds)") == 2


@pytest.mark.slow
def test_one_report_over_two_experiments(store, capsys):
    """``--experiment a,b``: the runs of both, the filter applied to each; the other grid's run keeps its own
    row (it differs by its schedule), and the provenance names both experiments."""
    args = ("--experiment", "report,other", "--filter", "tags.guide = 'branch'", "--perplexity-max", "0")
    code, err, out = report_main(store, capsys, *args, "--reference", "grpo_branch", "--bootstrap", "0")
    assert code == 0, err
    md = out.read_text()
    assert "experiments `report`, `other`" in md and "4 finished sage-train runs used" in md
    rows = [line.split(" |")[0][2:] for line in md.splitlines() if line.startswith("| GRPO + Branch")]
    assert "GRPO + Branch [guide.ratio=0.3, schedule=constant]" in rows
    assert "GRPO + Branch [guide.ratio=0.3, schedule=cosine]" in rows
    assert not any(line.startswith(f"| {GRPO} |") for line in md.splitlines())  # the filter holds
    code, err, _ = report_main(store, capsys, "--experiment", "report,nope")
    assert code == 2 and "no experiment 'nope' in this store" in err
    # the check a grid makes before training for a report that reuses another grid's runs
    code, err, _ = report_main(store, capsys, "--experiment", "other", "--check")
    assert code == 0, err
    none = ("--filter", "tags.guide = 'none'")
    code, err, _ = report_main(store, capsys, "--experiment", "other", *none, "--check")
    assert code == 2 and err.strip() == (
        "sage-report: experiment(s) 'other' hold no runs matching \"tags.guide = 'none'\""
    )


@pytest.mark.slow
def test_intervals_from_the_real_runs_correctness_matrices(store, built):
    """The differences are computed from the logged correctness matrices, and reproduce the logged pass@k
    metrics; the intervals contain them; two seeds are below the five Table 1 asks for."""
    vs_grpo, vs_base = built.tables["diff_vs_reference"], built.tables["diff_vs_base"]
    assert [r for r, _ in vs_grpo.rows] == [BRANCH, BRANCH5]
    assert [r for r, _ in vs_base.rows] == [GRPO, BRANCH, BRANCH5]
    assert vs_grpo.columns == vs_base.columns == [f"{DS} pass@1", f"{DS} pass@4"]

    def mean(names, label, k):
        return np.mean([logged(store, r, f"pass_at_{k}/{label}/{DS}") for r in names])

    for k in (1, 4):
        cell = vs_grpo.cell(BRANCH, f"{DS} pass@{k}")
        want = mean(["b0", "b1"], "trained", k) - mean(["g0", "g1"], "trained", k)
        assert cell.interval.diff == pytest.approx(want, abs=1e-12)
        assert cell.interval.lo <= cell.interval.diff <= cell.interval.hi
        assert (cell.n, cell.ref_n) == (2, 2)
        base = vs_base.cell(GRPO, f"{DS} pass@{k}")
        assert base.interval.diff == pytest.approx(mean(["g0", "g1"], "trained", k) - mean(["g0"], "base", k))
        one = vs_grpo.cell(BRANCH5, f"{DS} pass@{k}")  # one seed: no interval, never marked
        assert not one.interval.marked and one.text().endswith("(1 seed: no interval)")
    assert built.warnings and built.warnings[0].startswith("fewer than 5 training seeds for Table 1 methods:")
    assert (
        f"**Warning:** {built.warnings[0]}" in built.markdown and differences.NOISE_SENTENCE in built.markdown
    )
    csv = (store["root"] / "report" / "tables" / "diff_vs_base.csv").read_text()
    assert csv.startswith("row,column,diff,lo,hi,excludes_zero,marked,")
    assert "bands: 95% bootstrap interval over problems and training seeds" in built.markdown


@pytest.mark.slow
def test_figure_2_uses_the_periodic_held_out_accuracy(store, built):
    assert len(history(store, "g0", f"pass_at_1/periodic/{DS}")) == 3  # eval.every_steps=1, 3 steps
    assert not any("/periodic/" in n for n in built.notes)


def test_params_that_follow_the_training_seed_do_not_split_rows():
    from analysis.load import varying_params

    runs = [
        {"seed": str(s), "guide.seed": str(s), "guide.ratio": r}
        for s, r in [(1, "0.3"), (2, "0.3"), (3, "0.5")]
    ]
    assert varying_params(runs) == ["guide.ratio"]


def test_provenance_records_a_relative_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "outputs" / "mlflow.db"
    assert assemble.portable_uri(f"sqlite:///{db}") == "sqlite:///outputs/mlflow.db"
    assert assemble.portable_uri("postgresql://user:pw@host/db") == "postgresql://***@host/db"


def test_a_k_above_every_evaluations_n_is_one_line(tmp_path):
    """Issue 47: --k above the samples per problem gave a report of empty pass@k columns and a note per
    run; no evaluation can have that pass@k, so it is one line."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("n4")
    for seed in (0, 1):
        tags = {"sage.kind": "train", "seed": str(seed), "method": "grpo", "base_model": "/start"}
        run_id = client.create_run(exp, tags=tags).info.run_id
        for label in ("base", "trained"):
            for k in (1, 4):  # eval.n_samples=4, eval.ks=[1,4]
                client.log_metric(run_id, f"pass_at_{k}/{label}/{DS}", 0.5)
        client.set_terminated(run_id)
    args = ["--tracking-uri", store, "--experiment", "n4", "--out", str(tmp_path / "r.md")]
    r = prefork.run(
        [sys.executable, "-m", "analysis.report", *args, "--k", "64"],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, "\n".join(lines[-40:])
    assert lines[-1] == (
        "sage-report: --k 64 is above n, the samples per problem, of every evaluation here (at most 4): "
        "pass@k needs k <= n; choose --k 4 or less"
    )
    assert not (tmp_path / "r.md").exists()
    r = prefork.run(
        [sys.executable, "-m", "analysis.report", *args, "--k", "4"],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_a_snapshot_rebuilds_the_same_tables_and_figures_without_the_store(store, tmp_path, capsys):
    """``sage-report --export`` writes what the report reads of an experiment's runs to one compact file;
    ``--snapshot`` on that file, with no store, writes the same tables (md, tex, csv), the same figures and
    the same report apart from its provenance line; exporting twice gives the same bytes."""
    snap = tmp_path / "report.json.gz"
    code, err, _ = report_main(store, capsys, "--experiment", "report", "--export", str(snap))
    assert code == 0 and snap.is_file(), err
    again = tmp_path / "again.json.gz"
    assert report_main(store, capsys, "--experiment", "report", "--export", str(again))[0] == 0
    assert again.read_bytes() == snap.read_bytes()
    assert snap.stat().st_size < 100_000  # 6 runs, their curves and packed correctness matrices

    args = ["--experiment", "report", "--bootstrap", "200"]
    code, err, from_store = report_main(store, capsys, *args, out=tmp_path / "store" / "r.md")
    assert code == 0, err
    from_snap = tmp_path / "snap" / "r.md"
    code = report.main(["--snapshot", str(snap), "--out", str(from_snap), *args])
    assert code == 0, capsys.readouterr().err
    for kind in ("tables", "figures"):
        a, b = from_store.parent / kind, from_snap.parent / kind
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir()) and len(names) >= 6, names
        for name in names:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{kind}/{name}"
    store_md, snap_md = from_store.read_text().splitlines(), from_snap.read_text().splitlines()
    differ = [(x, y) for x, y in zip(store_md, snap_md, strict=True) if x != y]
    assert len(differ) == 1 and differ[0][1].startswith(
        f"Provenance: experiment `report` in `{os.path.relpath(snap)} (snapshot of sqlite:///"
    ), differ

    # what the file does not hold is an error naming it, never an empty answer; a snapshot is not a store
    client = snapshot.SnapshotClient(snap)
    run_id = store["ids"]["g0"]
    assert len(client.get_metric_history(run_id, "train/reward")) > 1
    unkept = next(k for k in client.get_run(run_id).data.metrics if k.startswith("train/") and not
                  snapshot.kept_history(k))  # fmt: skip
    with pytest.raises(ReportError, match=f"keeps only the latest value of '{unkept}'"):
        client.get_metric_history(run_id, unkept)
    with pytest.raises(ReportError, match="holds no artifact 'config.yaml'"):
        client.download_artifacts(run_id, "config.yaml", str(tmp_path))
    out = ["--out", str(tmp_path / "x.md")]
    capsys.readouterr()
    assert report.main(["--snapshot", str(snap), "--tracking-uri", store["uri"], *out]) == 2
    assert capsys.readouterr().err.strip() == (
        "sage-report: --snapshot reads a file, not a store: drop --tracking-uri"
    )
    absent = tmp_path / "absent.json.gz"
    assert report.main(["--snapshot", str(absent), *out]) == 2
    assert capsys.readouterr().err.strip() == f"sage-report: --snapshot {absent}: no such file"
    assert not (tmp_path / "x.md").exists()


@pytest.mark.slow
def test_training_means_read_the_same_from_a_snapshot_as_from_the_store(store, tmp_path, capsys):
    """scripts/training_means.py: a guide's activity during training, per row (each run's mean over its
    logged steps, then over seeds), the same figures from the committed snapshot as from the store."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import training_means

    snap = tmp_path / "report.json.gz"
    assert report_main(store, capsys, "--experiment", "report", "--export", str(snap))[0] == 0
    capsys.readouterr()
    keys = ["--experiment", "report", "--key", "train/guide/active_frac", "--key", "train/reward"]
    assert training_means.main([store["uri"], *keys]) == 0
    from_store = capsys.readouterr().out
    assert training_means.main([str(snap), *keys]) == 0
    assert capsys.readouterr().out == from_store
    branch = [line for line in from_store.splitlines() if line.startswith(f"  {BRANCH}:")]
    run_means = [np.mean(history(store, n, "train/guide/active_frac")) for n in ("b0", "b1")]
    assert branch[0].startswith(
        f"  {BRANCH}: {np.mean(run_means):.4f} (SD {np.std(run_means, ddof=1):.4f}), 2 runs"
    )
    assert training_means.main([str(snap), *keys, "--by-seed"]) == 0
    by_seed = capsys.readouterr().out.splitlines()
    assert by_seed[by_seed.index(next(x for x in by_seed if x.startswith(f"  {BRANCH}:"))) + 1] == (
        f"    by seed: 0: {run_means[0]:.4f}, 1: {run_means[1]:.4f}"
    )
    assert training_means.main([str(snap), "--experiment", "report", "--key", "train/nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "training_means: --key train/nope: no finished sage-train run of 'report' logged it"
    )
