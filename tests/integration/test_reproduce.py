"""``make reproduce-table6``, one table of the testbed study, shrunk by make variables only (one seed, one
grid cell, a short run): the grid runs, sage-report writes the table and the part's wall time is recorded.
Run twice, as a user re-running the command would: the finished job is not redone or logged twice."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

# Slow, not integration: it starts no service (the grid runs on Hydra's local launcher, the store is SQLite),
# so it need not wait for the worker that holds the SLURM cluster.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SHRUNK = (
    "hydra/launcher=local trl.max_steps=2 trl.per_device_train_batch_size=8 trl.num_generations=2 "
    "eval.n_samples=4 eval.limit=8 eval.perplexity_cap=0 "
    # the command line wins over the grid's values: one cell
    "experiment=grpo_branch guide.threshold=0.3 guide.ratio=0.3"
)


def jobs(runs: list) -> list:
    """The training runs among an experiment's runs: all but the grid's parent run (sage.grid)."""
    from sage.grid import PARENT_KIND

    return [r for r in runs if r.data.tags.get("sage.kind") != PARENT_KIND]


def test_reproduce_table6_twice_runs_reports_and_times_once(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    repro, results = tmp_path / "repro", tmp_path / "results"
    make = [
        "make",
        "-C",
        str(REPO),
        "reproduce-table6",
        f"REPRO={repro}",
        f"RESULTS={results}",
        "TABLE6_SEEDS=1",
        f"REPRO_COMMON={SHRUNK}",
        f"SAGE_REPORT=MLFLOW_TRACKING_URI=sqlite:///{repro / 'mlflow.db'} .venv/bin/sage-report --k 4",
    ]
    for _ in range(2):
        r = subprocess.run(make, capture_output=True, text=True, timeout=1500)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        table = (results / "testbed_table6.md").read_text()
        assert "1 finished sage-train runs used" in table, table[:1500]
        assert "| GRPO + Branch | " in table and "## Differences against the start model" in table
        (timing,) = (repro / "time_table6.md").read_text().splitlines()
        assert timing.startswith("| Table 6 (1) | ") and timing.endswith(" min |")
    client = MlflowClient(f"sqlite:///{repro / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "testbed-table6"]
    runs = client.search_runs([experiment.experiment_id])
    assert len(jobs(runs)) == 1 and len(runs) == 2  # one training run, nested under the grid's parent run


def grid_line(table: str) -> str:
    """The one command line (continued lines joined) that `make reproduce-<table>` runs its grid in."""
    r = subprocess.run(["make", "-C", str(REPO), "-n", f"reproduce-{table}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.replace("\\\n", " ").splitlines() if "sage-train -m" in ln]
    return line


@pytest.mark.parametrize("table", ["table1", "table3", "table4", "table6", "fork"])
def test_each_table_target_passes_its_whole_command(table: str) -> None:
    """A literal comma inside the Makefile's `$(call timed,...)` splits the call's arguments and silently
    drops the rest of the command (Table 4 once ran one default job and recorded it as the table): the command
    each target would run must still end with the common overrides, the table's experiment and its report."""
    line = grid_line(table)
    for expected in (
        "regime=anchored",
        "rollout=fast",
        f"tracking.experiment=testbed-{table}",
        "sage-report",
    ):
        assert expected in line, f"{expected} missing from: {line}"
    assert f"--experiment testbed-{table}" in line and f"time_{table}.md" in line


@pytest.mark.parametrize("table", ["table1", "table3", "table4", "table6", "fork"])
def test_each_table_grid_composes_every_job(table: str) -> None:
    """Hydra composes a grid's command line before its sweeper's params apply: an override of a key that only
    a swept group brings (the fork study's eval.datasets.arith_tail, from model=tiny_fork) fails the whole
    grid at its start, after the base model is built. Each target's command line, with each swept value,
    must compose: the grid itself, then every experiment it runs."""
    import shlex

    from slurm_support import compose

    def first(override: str) -> str:  # a swept value (a,b,c) as its first value; lists ([a,b]) stay
        key, _, value = override.partition("=")
        return f"{key}={value.split(',')[0]}" if "," in value and not value.startswith("[") else override

    for part in grid_line(table).split(" && "):
        if "sage-train -m " not in part:
            continue
        swept = shlex.split(part.split("sage-train -m ", 1)[1])
        overrides = [first(o) for o in swept]
        params = compose(overrides).hydra.sweeper.params or {}  # a grid of command-line values alone: none
        experiments = {o.partition("=")[2] for o in swept if o.startswith("experiment=")}
        experiments = str(params.get("experiment") or experiments.pop()).split(",")
        rest = [f"{k}={str(v).split(',')[0]}" for k, v in params.items() if k != "experiment"]
        for experiment in experiments:
            assert compose([*overrides, *rest, f"experiment={experiment}"]).method == experiment


def test_the_report_quotes_the_commands_the_tables_ran(tmp_path: Path) -> None:
    """testbed.md's provenance lists each table's sage-train arguments as its target runs them, and the
    commit."""
    repro, results = tmp_path / "repro", tmp_path / "results"
    repro.mkdir()
    (repro / "time_table1.md").write_text("| Table 1 (1) | 3 min |\n")
    where = [f"REPRO={repro}", f"RESULTS={results}"]
    # sage-report is replaced by `true`: only the provenance and timings section is checked here
    r = subprocess.run(
        ["make", "-s", "-C", str(REPO), "reproduce-report", *where, "SAGE_REPORT=true"], text=True
    )
    assert r.returncode == 0
    provenance = (results / "testbed_timings.md").read_text()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    )
    assert f"at commit {head.stdout.strip()}" in provenance
    assert "| Table 1 (1) | 3 min |" in provenance
    for table in ("table1", "table3", "table4", "table6"):
        dry = subprocess.run(
            ["make", "-C", str(REPO), "-n", f"reproduce-{table}", *where], capture_output=True, text=True
        )
        (line,) = [ln for ln in dry.stdout.splitlines() if "sage-train -m" in ln]
        ran = line.split("sage-train ", 1)[1].split(" && ")[0]
        assert f"`sage-train {ran}`" in provenance, (table, ran)


def test_table4_trains_the_constant_rows_and_takes_the_cosine_rows_from_table1(tmp_path: Path) -> None:
    """Table 4's cosine rows are Table 1's guided runs (same config; cosine is the default schedule): its
    target trains only the constant rows, and says so, before training anything, when Table 1 has not run."""
    from mlflow import MlflowClient

    repro, results = tmp_path / "repro", tmp_path / "results"
    where = [f"REPRO={repro}", f"RESULTS={results}", "TABLE1_SEEDS=1", "TABLE_SEEDS=1"]
    report = f"SAGE_REPORT=MLFLOW_TRACKING_URI=sqlite:///{repro / 'mlflow.db'} .venv/bin/sage-report --k 4"
    one_cell = SHRUNK.replace("guide.threshold=0.3 guide.ratio=0.3", "")

    def make(target: str) -> subprocess.CompletedProcess:
        cmd = ["make", "-C", str(REPO), target, *where, f"REPRO_COMMON={one_cell}", report]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=1500)

    first = make("reproduce-table4")
    assert first.returncode != 0
    assert "its cosine rows are Table 1's guided runs; run make reproduce-table1 first" in first.stderr
    assert not (repro / "table4").exists()  # nothing trained

    for target in ("reproduce-table1", "reproduce-table4"):
        r = make(target)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = (results / "testbed_table4.md").read_text()
    assert "experiments `testbed-table4`, `testbed-table1`" in table
    assert "2 finished sage-train runs used" in table, table[:1500]
    for schedule in ("constant", "cosine"):
        assert f"| GRPO + Branch [schedule={schedule}] |" in table
    assert "minus GRPO + Branch [schedule=cosine]" in table  # the reference row exists
    client = MlflowClient(f"sqlite:///{repro / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "testbed-table4"]
    (run,) = jobs(client.search_runs([experiment.experiment_id]))
    assert run.data.tags["schedule"] == "constant"


def test_reproduce_testbed_runs_the_fork_study_then_assembles_testbed_md(tmp_path: Path) -> None:
    """`make reproduce-testbed` is issue 22's study: the fork world's base figures, its one grid (every row of
    hparams_search=fork at 8 seeds, evaluated on the held-out set and its tail), the report (whose
    declared primary, a rare share and not a pass@k, scripts/positive_control.py computes), and testbed.md
    assembled from that report, the base model's figures and the provenance, which quotes the command the
    grid ran."""
    repro, results = tmp_path / "repro", tmp_path / "results"
    where = [f"REPRO={repro}", f"RESULTS={results}"]
    dry = subprocess.run(
        ["make", "-C", str(REPO), "-n", "reproduce-testbed", *where], capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()  # a recipe's continued lines as one command
    (study,) = [ln for ln in lines if "sage-train -m" in ln and "start=$(date +%s)" in ln]  # the timed part
    grids = [part.split("sage-train ", 1)[1] for part in study.split(" && ") if "sage-train -m" in part]
    (grid,) = grids
    for expected in ("hparams_search=fork", "seed=1,2,3,4,5,6,7,8", "tracking.experiment=testbed-fork"):
        assert expected in grid, f"{expected} missing from: {grid}"
    assert "~eval.datasets" not in grid  # both datasets of eval=arith_fork: the held-out set and its tail
    assert "sage.eval.testbed_measure --model tiny_fork" in study and "--primary" not in study
    assert (
        "experiment: base,grpo,grpo_nokl,grpo_random,grpo_branch,grpo_fork,grpo_strong_kl,grpo_fork_rare"
        in (REPO / "conf" / "hparams_search" / "fork.yaml").read_text()
    )  # the positive control is a row of the study
    # the study's data files, written from its store and sweep folder, from which testbed.md is assembled
    data = results / "data"
    (export,) = [ln for ln in lines if f"--export {data}" in ln]
    assert f"--experiment testbed-fork --export {data}/fork_study.json.gz" in export
    assert "MLFLOW_TRACKING_URI=sqlite:///" in export
    arms = {
        "primary": "--method grpo_branch --reference grpo",
        "control": "--method grpo_fork_rare --reference grpo",
    }
    for name, arm in arms.items():
        (save,) = [ln for ln in lines if f"--save-data {data}/fork_{name}.json" in ln]
        assert f"scripts/positive_control.py {repro}/fork {arm} --seeds 0" in save, save
    (assemble,) = [ln for ln in lines if f"--out {results}/testbed.md" in ln]
    assert f"--snapshot {data}/fork_study.json.gz" in assemble and "--experiment testbed-fork" in assemble
    assert "MLFLOW_TRACKING_URI" not in assemble and "--tracking-uri" not in assemble
    assert f"--include {results}/testbed_fork_base.md" in assemble
    assert f"--include {results}/testbed_fork_primary.md" in assemble
    (primary,) = [ln for ln in lines if f"> {results}/testbed_fork_primary.md" in ln]
    for name in arms:
        assert f"scripts/positive_control.py --data {data}/fork_{name}.json --seeds 0" in primary, primary

    # the provenance alone (sage-report replaced by `true`): the commit and each grid's command as it ran
    data.mkdir(parents=True)
    (data / "fork_time.md").write_text("| Fork world | 3 min |\n")
    r = subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(REPO),
            "reproduce-fork-report",
            *where,
            "SAGE_REPORT_DATA=true",
            "POSITIVE_CONTROL=true",
        ]
    )
    assert r.returncode == 0
    provenance = (results / "testbed_fork_timings.md").read_text()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    )
    assert f"at commit {head.stdout.strip()}" in provenance and "| Fork world | 3 min |" in provenance
    assert f"`sage-train {grid}`" in provenance, grid
