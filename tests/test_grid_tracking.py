"""What a grid looks like in MLflow: run names that say what ran, one parent run per grid or study that its
jobs are nested under (reused when the grid is rerun), and the grid's report logged into that parent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import prefork
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from support import log_grid

from sage.config import register_configs
from sage.grid import close_parent, grid_key, name_keys, open_parent, study_key, with_grid
from sage.run_names import run_name
from sage.tracking import PARENT_TAG, start_run

REPO = Path(__file__).resolve().parents[1]
register_configs()


def cfg_for(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_the_runs_of_a_four_method_grid_have_four_names(tmp_path):
    """sage-train seeds the global RNG before the run starts: MLflow's random name, drawn from it, was the
    same for every run of a seed (overjoyed-slug-911 for seed 0)."""
    from transformers import set_seed

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    names = []
    for method in ("grpo", "grpo_nokl", "grpo_fkl", "grpo_branch"):
        cfg = cfg_for(
            f"experiment={method}", "seed=0", f"tracking.uri={uri}", "tracking.name_keys=[experiment]"
        )
        set_seed(cfg.seed)
        out = tmp_path / method
        out.mkdir()
        with start_run(cfg, out, kind="train") as tracker:
            names.append(MlflowClient(uri).get_run(tracker.run_id).info.run_name)
    assert names == ["grpo-s0", "grpo_nokl-s0", "grpo_fkl-s0", "grpo_branch-s0"]


def test_a_sweeps_distinguishing_values_name_its_runs():
    jobs = [
        ["guide.threshold=0.3", "guide.ratio=0.5", "seed=1", "rollout=fast", "resume=auto"],
        ["guide.threshold=0.3", "guide.ratio=0.7", "seed=2", "rollout=fast", "resume=auto"],
        ["guide.threshold=0.8", "guide.ratio=0.5", "seed=1", "rollout=fast", "resume=auto"],
    ]
    keys = name_keys(jobs)
    assert keys == ["guide.threshold", "guide.ratio", "seed"]  # rollout is the same in every job
    overrides = with_grid(["experiment=grpo_branch", *jobs[1]], keys, "p1")
    assert overrides[-2:] == [
        "tracking.name_keys=[guide.threshold,guide.ratio,seed]",
        "tracking.parent_run_id=p1",
    ]
    cfg = cfg_for(*overrides)
    assert run_name(cfg) == "grpo_branch-threshold0.3-ratio0.7-s2"
    assert run_name(cfg_for(*overrides, "tracking.run_name=mine")) == "mine"  # the user's name wins
    # a study's trial number keeps two trials that drew the same values apart
    trial = cfg_for("experiment=grpo_branch", "++tracking.tags.trial=4", "tracking.name_keys=[guide.ratio]")
    assert run_name(trial) == "grpo_branch-ratio0.3-t4-s0"
    # a job that sets its own name or parent keeps them (Optuna's trials carry the study's)
    assert with_grid(["tracking.parent_run_id=q", "tracking.name_keys=[a]"], ["b"], "p") == [
        "tracking.parent_run_id=q",
        "tracking.name_keys=[a]",
    ]


def test_jobs_are_children_of_one_parent_that_a_rerun_reuses(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = cfg_for(f"tracking.uri={uri}", "tracking.experiment=grid").tracking
    sweep = tmp_path / "sweep"
    parent = open_parent(tracking, grid_key(sweep), name="grid-sweep")
    assert open_parent(tracking, grid_key(tmp_path / "other"), name="grid-other") != parent
    cfg = cfg_for(f"tracking.uri={uri}", "tracking.experiment=grid", f"tracking.parent_run_id={parent}")
    (tmp_path / "job").mkdir()
    with start_run(cfg, tmp_path / "job", kind="train") as tracker:
        child = tracker.run_id
    client = MlflowClient(uri)
    assert client.get_run(child).data.tags[PARENT_TAG] == parent
    # the grid has no evaluated run: the parent says why it holds no report, and ends FAILED as the grid did
    close_parent(tracking, parent, ok=False)
    run = client.get_run(parent)
    assert run.info.status == "FAILED" and "sage.report" in run.data.tags
    # rerun: the same parent, RUNNING again
    assert open_parent(tracking, grid_key(sweep), name="grid-sweep") == parent
    assert client.get_run(parent).info.status == "RUNNING"
    exp = client.get_experiment_by_name("grid").experiment_id
    assert len(client.search_runs([exp], "tags.`sage.kind` = 'grid'")) == 2  # sweep and other, once each


def test_an_extended_grids_parent_is_renamed_to_what_it_now_compares(tmp_path):
    """Issue 47: a grid extended in its sweep dir kept its first name, "experiment=grpo,grpo_branch x
    seed=1,2", over four methods."""
    from sage.grid import JOBS_FILE, compared, grid_jobs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = cfg_for(f"tracking.uri={uri}", "tracking.experiment=grid").tracking
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    first = [[f"experiment={m}", f"seed={s}"] for m in ("grpo", "grpo_branch") for s in (1, 2)]
    parent = open_parent(tracking, grid_key(sweep), name=compared(grid_jobs(sweep, first)))
    more = [[f"experiment={m}", f"seed={s}"] for m in ("grpo_no_kl", "grpo_forward_kl") for s in (1, 2)]
    more.append(["experiment=grpo", "seed=1"])  # asked again: one job
    name = compared(grid_jobs(sweep, more))
    assert name == "experiment=grpo,grpo_branch,grpo_no_kl,grpo_forward_kl x seed=1,2"
    assert open_parent(tracking, grid_key(sweep), name=name) == parent
    assert MlflowClient(uri).get_run(parent).info.run_name == name
    assert len(json.loads((sweep / JOBS_FILE).read_text())) == 8


def test_a_study_has_one_parent_whatever_sweep_dir_its_launches_write_to(tmp_path):
    """An Optuna study resumed by a second launch (another hydra.sweep.dir, the same name and storage) is one
    study: its trials nest under one parent run; another storage or name is another study. The storage's
    password never reaches the tag."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = cfg_for(f"tracking.uri={uri}", "tracking.experiment=study").tracking
    storage = "postgresql+psycopg://optuna:secret@db:5432/optuna"
    first = open_parent(tracking, study_key("s", storage), name="study-s")
    assert open_parent(tracking, study_key("s", storage), name="study-s") == first
    assert open_parent(tracking, study_key("s", "sqlite:///other.db"), name="study-s") != first
    assert open_parent(tracking, study_key("t", storage), name="study-t") != first
    tags = MlflowClient(uri).get_run(first).data.tags
    assert "secret" not in str(tags) and tags["sage.kind"] == "grid"


def test_an_evaluation_leaves_a_figure_tables_and_no_std_of_one_seed(tmp_path):
    import json

    import numpy as np
    import pandas as pd

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = cfg_for(f"tracking.uri={uri}", "tracking.experiment=artifacts")
    rows = [{"id": "a/1", "problem": "1+1?", "answer": "2"}, {"id": "a/7", "problem": "2+2?", "answer": "4"}]
    completions = [["<SOLUTION>2</SOLUTION>", "3"], ["<SOLUTION>5</SOLUTION>", "<SOLUTION>4</SOLUTION>"]]
    correct = np.array([[True, False], [False, True]])
    one_seed = {
        "summary": {"pass@1": 0.5, "pass@1_std": 0.0},
        "correct": [correct],
        "completions": [completions],
    }
    two_seeds = {
        "summary": {"pass@1": 0.5, "pass@1_std": 0.1},
        "correct": [correct, np.ones_like(correct)],
        "completions": [completions, completions],
    }
    (tmp_path / "run").mkdir()
    with start_run(cfg, tmp_path / "run", kind="train") as tracker:
        tracker.log_eval("base", "ds", one_seed, [1], None, step=0, rows=rows)
        tracker.log_eval("trained", "ds", two_seeds, [1], 1, step=3, rows=rows)
        run_id = tracker.run_id
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    metrics = run.data.metrics
    assert "pass_at_1/base/ds" in metrics and "pass_at_1_std/base/ds" not in metrics
    assert metrics["pass_at_1_std/trained/ds"] == 0.1
    assert "step is k" in run.data.tags["mlflow.note.content"]
    files = {f.path for f in client.list_artifacts(run_id, "eval")}
    assert {"eval/passk_ds.png", "eval/passk_ds.csv"} <= files
    folder = Path(client.download_artifacts(run_id, "eval", str(tmp_path / "dl")))
    table = pd.read_csv(folder / "passk_ds.csv")
    # base: one seed, pass@1 = 0.5, pass@2 = 1.0 (each problem has one right sample of two)
    base = table[table.label == "base"].set_index("k")
    assert base.loc[1, "mean"] == 0.5 and base.loc[2, "mean"] == 1.0 and np.isnan(base.loc[1, "std"])
    trained = table[table.label == "trained"].set_index("k")  # seeds: 0.5 and 1.0
    assert trained.loc[1, "mean"] == 0.75 and (trained.loc[1, "min"], trained.loc[1, "max"]) == (0.5, 1.0)
    # the matrices' problems by id, in their order: a report's per-problem CSV names them
    assert json.loads((folder / "trained" / "trained_ds_problems.json").read_text()) == ["a/1", "a/7"]
    logged = json.loads((folder / "base" / "base_ds_completions_step0.json").read_text())
    frame = pd.DataFrame(logged["data"], columns=logged["columns"])
    assert list(frame.columns) == [
        "problem",
        "sample",
        "prompt",
        "gold",
        "completion",
        "extracted_answer",
        "correct",
    ]
    assert frame.iloc[0][["prompt", "gold", "extracted_answer", "correct"]].tolist() == [
        "1+1?",
        "2",
        "2",
        True,
    ]
    assert len(frame) == 4
    shown = json.loads((folder / "trained" / "trained_ds_completions_step3.json").read_text())
    assert len(shown["data"]) == 2  # n_problems=1: the first problem's two samples


def test_a_grid_is_named_nested_and_reported_in_mlflow(tmp_path):
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent_id = log_grid(uri, tmp_path, "grid")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("grid").experiment_id
    (parent,) = client.search_runs([exp], "tags.`sage.kind` = 'grid'")
    assert parent.info.run_id == parent_id
    assert parent.info.status == "FINISHED" and parent.data.tags["sage.report"] == "report/report.md"
    children = client.search_runs([exp], f"tags.`{PARENT_TAG}` = '{parent_id}'")
    names = sorted(c.info.run_name for c in children)
    assert names == ["grpo-s0", "grpo-s1", "grpo_branch-s0", "grpo_branch-s1"]
    report = {f.path for f in client.list_artifacts(parent_id, "report")}
    assert {"report/report.md", "report/figures", "report/tables"} <= report
    figures = [f.path for f in client.list_artifacts(parent_id, "report/figures")]
    tables = [f.path for f in client.list_artifacts(parent_id, "report/tables")]
    assert any(p.endswith(".png") for p in figures) and any(p.endswith(".csv") for p in tables)
    for child in children:
        files = {f.path for f in client.list_artifacts(child.info.run_id, "eval")}
        assert {"eval/passk_arith_heldout.png", "eval/passk_arith_heldout.csv"} <= files
    # sage-report --log-to-mlflow afterwards: one parent for the experiment, reused by a second call
    script = Path(sys.executable).parent / "sage-report"
    for _ in range(2):
        argv = [str(script), "--tracking-uri", uri, "--experiment", "grid", "--log-to-mlflow"]
        done = prefork.run(
            [*argv, "--out", str(tmp_path / "r" / "report.md")], env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        assert done.returncode == 0, done.stderr[-2000:]
    (logged,) = client.search_runs([exp], "tags.`sage.report_of` LIKE '%'")
    assert "report/report.md" in {f.path for f in client.list_artifacts(logged.info.run_id, "report")}


def test_an_optuna_trial_is_named_by_its_values_and_nested_under_the_study():
    import optuna

    from sweeps.optuna import SageOptunaSweeper

    s = SageOptunaSweeper(
        study_name="s",
        storage="sqlite:///x.db",
        n_trials=2,
        n_jobs=1,
        objectives=["a"],
        weights=None,
        directions=["maximize"],
        params={},
        choices_as="points",
        max_retries=0,
        max_failures=1,
        sampler=optuna.samplers.RandomSampler(),
        pruner=optuna.pruners.NopPruner(),
        prune_on=None,
    )
    s.space_keys, s.parent_id = ["guide.ratio"], "study-parent"  # what sweep() sets before any trial
    overrides = s.trial_overrides(["experiment=grpo_branch"], {"guide.ratio": 0.3}, 1)
    assert "tracking.parent_run_id=study-parent" in overrides
    # the launcher adds neither name keys nor a parent of its own to a trial that has them
    assert with_grid(overrides, ["experiment"], "grid-parent") == overrides
    kept = [o for o in overrides if not o.startswith("hydra.")]  # hydra.sweep.subdir: not a job config key
    assert run_name(cfg_for(*kept)) == "grpo_branch-ratio0.3-t1-s0"


def test_a_grids_parent_is_named_by_what_it_compares_and_its_answer_names_a_missing_table():
    from sage.grid import answer, compared

    jobs = [[f"experiment={m}", f"seed={s}", "rollout=fast"] for m in ("grpo", "grpo_branch") for s in (1, 2)]
    assert compared(jobs) == "experiment=grpo,grpo_branch x seed=1,2"
    assert compared([["seed=1", "rollout=fast"]]) is None  # one job compares nothing: the launcher's fallback
    assert len(compared([[f"guide.ratio={i / 1000:.3f}"] for i in range(500)])) == 200
    # a report without the differences table says why, in the grid's last lines
    note = "no differences against 'GRPO': no trained row of that name (--reference)"
    text = answer("# Results\n", [note], None, None, "http://h/#/experiments/1/runs/r", "g")
    assert f"no differences table: {note}" in text.splitlines()
    assert answer("", [], "no finished run", None, "u", "g").splitlines()[1] == "no report: no finished run"


def test_sage_report_reports_one_grid_of_a_mixed_store_and_says_what_it_joined(tmp_path):
    """Two grids in one experiment, the second at another learning rate. --grid latest (or a grid's sweep
    dir) reports that grid's four runs alone; the whole experiment joins both, says so, says why each
    method has two rows, and names why the differences against GRPO are missing instead of dropping them."""
    import sys

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = log_grid(uri, tmp_path / "a", "mixed")
    second = log_grid(uri, tmp_path / "b", "mixed", extra=("trl.learning_rate=2e-4",))
    report = [
        str(Path(sys.executable).parent / "sage-report"),
        "--tracking-uri",
        uri,
        "--experiment",
        "mixed",
    ]

    def run(*args: str, out: str):
        done = prefork.run(
            [*report, *args, "--out", str(tmp_path / out / "report.md")],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        text = (tmp_path / out / "report.md").read_text() if done.returncode == 0 else ""
        return done, text

    for grid, parent, out in (("latest", second, "latest"), (str(tmp_path / "a" / "sweep"), first, "a")):
        done, text = run("--grid", grid, out=out)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"(parent run {parent}): its runs only" in done.stdout
        assert "4 finished sage-train runs used" in text and "## Differences against GRPO" in text
        assert "joined" not in done.stderr and "split into" not in done.stderr
    done, text = run(out="all")
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [ln.removeprefix("note: ") for ln in done.stderr.splitlines() if ln.startswith("note: ")]
    joined = [n for n in notes if n.startswith("joined 8 runs from 2 sources")]
    assert len(joined) == 1 and first in joined[0] and second in joined[0]
    split = [n for n in notes if n.startswith("GRPO is split into 2 rows because its runs differ in")]
    assert len(split) == 1 and "trl.learning_rate" in split[0]
    assert "## Differences against GRPO" not in text
    assert any(n.startswith("no differences against 'GRPO': its runs are split into rows") for n in notes)
    done, _ = run("--grid", "nope", out="nope")
    assert done.returncode == 2 and "--grid 'nope': no grid of that name" in done.stderr
    assert "'grid-sweep'" in done.stderr
