"""Grids and Optuna studies through the SLURM launcher on a real single-node SLURM cluster, with real
(shrunken) testbed runs: every job completes and is tagged in MLflow, a study resumes without re-running
finished trials and retries the trial a killed driver lost, a killed job is reported failed promptly, and
a preempted job is requeued and, run with the resume=auto the launcher gives every job, resumes from its
checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from slurm_support import REPO, compose, final_states, job_folders, sacct_states, slurm_jobs, sweep

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
SEARCHES = sorted(p.stem for p in (REPO / "conf" / "hparams_search").glob("*.yaml"))
# The testbed's base model (cached in SAGE_CACHE_DIR / ~/.cache/sage, which the jobs inherit), 2 RL steps
# and a tiny evaluation: the jobs are real sage-train runs, only short.
SHRINK = [
    "trl.max_steps=2",
    "trl.per_device_train_batch_size=16",
    "trl.num_generations=4",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=4",
]
OBJECTIVES = "hydra.sweeper.objectives=[pass_at_1/trained/arith_heldout,pass_at_4/trained/arith_heldout]"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    """Each preset sets its method label and the groups its comment promises; a guide always has a
    divergence."""
    cfg = compose([f"experiment={experiment}"])
    assert cfg.method == experiment
    assert (cfg.trl.max_steps == 0) == (experiment == "base")
    if cfg.guide._target_ != "sage.objective.guides.NoGuide":
        assert cfg.divergence.beta > 0, experiment
    assert ("branch" in experiment) == (cfg.guide._target_ == "sage.objective.guides.BranchGuide")


@pytest.mark.parametrize("search", SEARCHES)
def test_every_search_names_existing_experiments(search):
    params = compose([f"hparams_search={search}"]).hydra.sweeper.params
    assert set(str(params.experiment).split(",")) <= set(EXPERIMENTS), params.experiment
    for key in params:
        if key != "experiment":  # every other swept key exists in the config of the search's experiment
            cfg = compose([f"experiment={str(params.experiment).split(',')[0]}"])
            assert OmegaConf.select(cfg, key) is not None, key


def test_the_optuna_search_of_table6_is_table6s_box():
    """branch_threshold_ratio writes no space of its own: Optuna searches the box Table 6's grid spans."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from optuna.distributions import FloatDistribution

    from sweeps.optuna import distribution

    grid, search = (
        compose([f"hparams_search={s}"]).hydra.sweeper for s in ("table6", "branch_threshold_ratio")
    )
    assert search.params == grid.params and search._target_.endswith("SageOptunaSweeper")
    (threshold,) = OverridesParser.create().parse_overrides(
        [f"guide.threshold={grid.params['guide.threshold']}"]
    )
    assert distribution("guide.threshold", threshold, search.choices_as.value) == FloatDistribution(0.8, 2.0)


def test_table6_on_the_testbed_scales_the_papers_thresholds_by_the_models_default():
    """The paper's thresholds are multiples of its default 1.2 nats (Qwen's entropy q90); the testbed grid
    takes the same multiples of the testbed model's default, and the same ratios."""
    paper, testbed = (
        compose([f"hparams_search={s}"]).hydra.sweeper.params for s in ("table6", "table6_testbed")
    )
    default = compose(["experiment=grpo_branch"]).model.branch_threshold
    scaled = [round(float(t) / 1.2 * default, 6) for t in str(paper["guide.threshold"]).split(",")]
    assert [float(t) for t in str(testbed["guide.threshold"]).split(",")] == scaled
    assert testbed.experiment == paper.experiment and testbed["guide.ratio"] == paper["guide.ratio"]


def driver(env: dict[str, str], *args: str) -> subprocess.Popen:
    """`sage-train -m ...` (as `python -m sage.train`, from the repo like a user) in the background, for the
    tests that act on its jobs while it runs."""
    return subprocess.Popen(
        [sys.executable, "-m", "sage.train", "-m", *args],
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def mlflow_runs(uri: str, experiment: str) -> list:
    """The experiment's job runs, each nested under the one parent run the sweep opened (sage.grid)."""
    from mlflow import MlflowClient

    from sage.grid import PARENT_KIND
    from sage.tracking import PARENT_TAG

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} at {uri}"
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sage.kind") == PARENT_KIND]
    jobs = [r for r in runs if r.info.run_id != parent.info.run_id]
    assert {r.data.tags.get(PARENT_TAG) for r in jobs} == {parent.info.run_id}
    return jobs


def squeue(env: dict[str, str], job: str) -> str:
    """'<state> <reason>' of a job slurmctld still knows about, else ''."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True, text=True)
    return out.stdout.strip()


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(
                f"the sweep ended ({proc.returncode}) while waiting for {what}: {proc.stderr.read()[-3000:]}"
            )
        time.sleep(1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def running_job(env: dict[str, str], sweep_dir: Path) -> str | None:
    """The SLURM id (``<array>_<task>``) of the sweep's job once it is RUNNING."""
    if not (sweep_dir / ".submitit").is_dir() or not slurm_jobs(sweep_dir):
        return None
    states = sacct_states(env, slurm_jobs(sweep_dir)[0])
    return next((j for j, s in states.items() if s == "RUNNING"), None)


@pytest.mark.integration
def test_grid_through_slurm_every_job_completes(slurm_cluster, mlflow_server, tmp_path):
    """A 2 x 2 grid (method x seed) as one SLURM array; each job a real run, tagged in MLflow."""
    sweep_dir = tmp_path / "grid"
    t0 = time.monotonic()
    rc, log = sweep(
        slurm_cluster,
        "hydra/launcher=slurm",
        "experiment=grpo,grpo_branch",
        "seed=1,2",
        f"hydra.sweep.dir={sweep_dir}",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=it-grid",
        *SHRINK,
        timeout=420,
    )
    assert rc == 0, log[-4000:]
    (array,) = slurm_jobs(sweep_dir)
    states = final_states(slurm_cluster, array)
    assert sorted(states) == [f"{array}_{i}" for i in range(4)] and set(states.values()) == {"COMPLETED"}, (
        states
    )
    assert len(job_folders(sweep_dir)) == 4
    for folder in job_folders(sweep_dir):
        metrics = json.loads((folder / "metrics.json").read_text())
        assert (
            0 <= metrics["pass_at_1/trained/arith_heldout"] <= metrics["pass_at_4/trained/arith_heldout"] <= 1
        )
    runs = mlflow_runs(mlflow_server, "it-grid")
    tags = sorted((r.data.tags.get("method"), r.data.tags.get("job_num")) for r in runs)
    assert tags == [("grpo", "0"), ("grpo", "1"), ("grpo_branch", "2"), ("grpo_branch", "3")], tags
    assert {r.data.tags.get("grid") for r in runs} == {str(sweep_dir.resolve())}
    print(f"grid of 4 jobs: {time.monotonic() - t0:.0f} s")


@pytest.mark.integration
def test_optuna_study_on_slurm_resumes(slurm_cluster, mlflow_server, tmp_path):
    """3 trials, then a 'killed driver' leaves a 4th RUNNING; re-running the command with n_trials=4 marks it
    failed, runs its params again and nothing else."""
    import optuna

    db = tmp_path / "study.db"
    common = [
        "hparams_search=branch_threshold_ratio",
        "hydra/launcher=slurm",
        "hydra.sweeper.study_name=it-study",
        f"hydra.sweeper.storage=sqlite:///{db}",
        "hydra.sweeper.n_jobs=2",
        OBJECTIVES,
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=it-study",
        *SHRINK,
    ]
    t0 = time.monotonic()
    trials = ["hydra.sweeper.n_trials=3", f"hydra.sweep.dir={tmp_path / 'run1'}"]
    rc, log = sweep(slurm_cluster, *common, *trials, timeout=420)
    assert rc == 0, log[-4000:]
    study = optuna.load_study(study_name="it-study", storage=f"sqlite:///{db}")
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(done) == 3 and all(len(t.values) == 2 and 0 <= t.values[0] <= 1 for t in done)
    assert len(study.best_trials) >= 1  # the Pareto front
    assert (tmp_path / "run1" / "optimization_results.yaml").exists()
    t1 = time.monotonic()

    # A driver killed mid-batch leaves its trial RUNNING in the storage.
    lost = study.ask({k: v for k, v in done[0].distributions.items()})
    lost_params = dict(lost.params)

    trials = ["hydra.sweeper.n_trials=4", f"hydra.sweep.dir={tmp_path / 'run2'}"]
    rc, log = sweep(slurm_cluster, *common, *trials, timeout=300)
    assert rc == 0, log[-4000:]
    study = optuna.load_study(study_name="it-study", storage=f"sqlite:///{db}")
    by_state = {s: study.get_trials(states=(s,)) for s in optuna.trial.TrialState}
    assert [t.number for t in by_state[optuna.trial.TrialState.FAIL]] == [lost.number]
    complete = by_state[optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 4
    (retry,) = [t for t in complete if t.number not in {d.number for d in done}]
    assert retry.params == pytest.approx(lost_params) and retry.user_attrs["retry_of"] == lost.number
    # only the lost trial ran again: one job in the second sweep, in its trial's folder
    assert [p.name for p in (tmp_path / "run2" / "it-study").iterdir()] == [str(retry.number)]
    for array in slurm_jobs(tmp_path / "run1") + slurm_jobs(tmp_path / "run2"):
        assert set(final_states(slurm_cluster, array).values()) == {"COMPLETED"}

    runs = mlflow_runs(mlflow_server, "it-study")
    assert sorted(int(r.data.tags["trial"]) for r in runs) == sorted(t.number for t in complete)
    assert {r.data.tags["study"] for r in runs} == {"it-study"}
    print(f"study: 3 trials {t1 - t0:.0f} s, resume with one retried trial {time.monotonic() - t1:.0f} s")


@pytest.mark.integration
def test_typo_fails_before_submission(slurm_cluster, tmp_path):
    """A misspelt sweep param or search fails at once with one line naming it; nothing reaches SLURM."""
    base = [f"hydra.sweep.dir={tmp_path / 'never'}", "hydra/launcher=slurm"]
    rc, log = sweep(
        slurm_cluster,
        *base,
        "hparams_search=branch_threshold_ratio",
        f"hydra.sweeper.storage=sqlite:///{tmp_path / 's.db'}",
        "guide.treshold=interval(0.8,2.0)",
        timeout=120,
    )
    assert rc != 0 and "guide.treshold" in log, log[-2000:]
    rc, log = sweep(
        slurm_cluster,
        *base,
        "hparams_search=branch_threshold_ratio",
        f"hydra.sweeper.storage=sqlite:///{tmp_path / 's.db'}",
        "guide.ratio=interval(0.5,0.1)",
        timeout=120,
    )
    assert rc != 0 and "sweep param guide.ratio: interval(0.5, 0.1) needs low < high" in log, log[-2000:]
    rc, log = sweep(slurm_cluster, *base, "hparams_search=tabel1", timeout=120)
    assert rc != 0 and "hparams_search=tabel1: no such hparams_search option" in log, log[-2000:]
    assert "did you mean hparams_search=table1?" in log, log[-2000:]
    assert not (tmp_path / "never" / ".submitit").exists()


@pytest.mark.integration
def test_killed_job_is_reported_failed(slurm_cluster, tmp_path):
    """SIGKILL to a running job's process (an OOM kill, say): the sweep ends with an error naming the job."""
    sweep_dir = tmp_path / "kill"
    proc = driver(
        slurm_cluster,
        "hydra/launcher=slurm",
        "experiment=grpo",
        f"hydra.sweep.dir={sweep_dir}",
        "tracking.enabled=false",
        *SHRINK,
        "trl.max_steps=500",
    )
    try:
        job = wait_for(lambda: running_job(slurm_cluster, sweep_dir), 120, "the job to run", proc)
        listing = subprocess.run(
            ["scontrol", "listpids", job], env=slurm_cluster, capture_output=True, text=True
        )
        pids = [line.split()[0] for line in listing.stdout.splitlines()[1:] if line.strip()]
        python = [
            int(p)
            for p in pids
            if p.isdigit() and b"submitit.core._submit" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert python, f"no submitit process among {pids} of job {job}"
        killed = time.monotonic()
        for p in python:
            os.kill(p, signal.SIGKILL)
        rc, log = finish(proc, timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0 and "failed" in log and job.split("_")[0] in log, log[-3000:]
    assert elapsed < 90, f"the failure took {elapsed:.0f} s to be reported"
    assert final_states(slurm_cluster, job.split("_")[0])[job] in {"FAILED", "CANCELLED", "NODE_FAIL"}
    print(f"killed job reported failed after {elapsed:.0f} s")


@pytest.mark.integration
def test_preempted_job_requeues_and_resumes(slurm_cluster, mlflow_server, tmp_path):
    """USR2 (SLURM's preemption/timeout warning) after the first checkpoint: submitit requeues the job and,
    run with resume=auto by the launcher, it continues from that checkpoint in the same MLflow run instead of
    starting over."""
    sweep_dir = tmp_path / "preempt"
    proc = driver(
        slurm_cluster,
        "hydra/launcher=slurm",
        "experiment=grpo",
        f"hydra.sweep.dir={sweep_dir}",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=it-preempt",
        *SHRINK,
        "trl.max_steps=12",
        "trl.save_steps=2",
    )
    try:
        job = wait_for(lambda: running_job(slurm_cluster, sweep_dir), 120, "the job to run", proc)
        wait_for(lambda: list(sweep_dir.glob("*/rl/checkpoint-2")), 180, "checkpoint-2", proc)
        subprocess.run(["scancel", "--signal=USR2", job], env=slurm_cluster, check=True)
        # SLURM holds a requeued job until its begin time (about two minutes); let it start now instead.
        wait_for(lambda: squeue(slurm_cluster, job) == "PENDING BeginTime", 60, "the requeued job", proc)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm_cluster, check=True)
        rc, log = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log[-4000:]
    (out,) = job_folders(sweep_dir)
    assert "resume=auto" in (out / ".hydra" / "overrides.yaml").read_text()
    steps = [e["step"] for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]
    assert steps == list(range(1, 13)), steps
    submitit_log = "".join(p.read_text() for p in (sweep_dir / ".submitit").rglob("*_log.*"))
    assert "Caught signal SIGUSR2" in submitit_log and "resume=auto: continuing from" in submitit_log
    (run,) = mlflow_runs(mlflow_server, "it-preempt")  # one run across both attempts
    assert run.info.status == "FINISHED" and run.data.tags["method"] == "grpo"


@pytest.mark.integration
def test_a_job_of_two_tasks_is_one_two_process_run(slurm_cluster, mlflow_server, tmp_path):
    """hydra.launcher.tasks_per_node=2: the job's two SLURM tasks are the two processes of one run (torch's
    distributed environment exported from SLURM's), which records once: one MLflow run, one final/."""
    sweep_dir = tmp_path / "two-tasks"
    shrink = [o for o in SHRINK if not o.startswith("trl.per_device_train_batch_size=")]
    rc, log = sweep(
        slurm_cluster,
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1",
        "seed=1",
        f"hydra.sweep.dir={sweep_dir}",
        f"tracking.uri={mlflow_server}",
        "tracking.experiment=it-two-tasks",
        "trl.per_device_train_batch_size=8",  # x 2 processes: the 16 completions of SHRINK's one process
        *shrink,
        timeout=900,
    )
    assert rc == 0, log[-4000:]
    (array,) = slurm_jobs(sweep_dir)
    assert set(final_states(slurm_cluster, array).values()) == {"COMPLETED"}
    task_logs = "".join(p.read_text() for p in (sweep_dir / ".submitit").rglob("*_log.out"))
    assert "8 completions per forward pass x 1 accumulation steps x 2 processes = 16 completions" in task_logs
    (run,) = mlflow_runs(mlflow_server, "it-two-tasks")
    assert run.info.status == "FINISHED"
    (out,) = job_folders(sweep_dir)
    assert json.loads((out / "final" / "sage_final.json").read_text())["global_step"] == 2
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["pass_at_1/trained/arith_heldout"] <= 1


@pytest.mark.slow  # four sage-train runs: real training, not the unit loop
def test_a_grid_ends_with_its_differences_and_where_its_report_is(tmp_path):
    """A 2-method x 2-seed grid on the local launcher prints, when it ends, the differences against the
    reference row with their intervals, the report's folder and the parent run's MLflow URL; the parent
    run is named by what the grid compared (it was `grid-<time>`)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep_dir = tmp_path / "sweep"
    code, out = sweep(
        dict(os.environ),
        "experiment=grpo,grpo_branch",
        "seed=0,1",
        "hydra/launcher=local",
        *SHRINK,
        "trl.max_steps=1",
        f"tracking.uri={uri}",
        "tracking.experiment=answer",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=1800,
    )
    assert code == 0, out[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("answer").experiment_id
    (parent,) = client.search_runs([exp], "tags.`sage.kind` = 'grid'")
    assert parent.info.run_name == "experiment=grpo,grpo_branch x seed=0,1"
    tail = out[out.index("grid 'experiment=grpo,grpo_branch x seed=0,1' finished") :].splitlines()
    assert tail[1].startswith("Differences against GRPO (95% t intervals")
    assert tail[2].startswith("| method | arith_heldout pass@1 | arith_heldout pass@4 |")
    assert tail[4].startswith("| GRPO + Branch | ") and tail[4].count("[") == 2
    # then which problems each pair lost and gained (one line per pair and dataset), then where the report is
    assert tail[5].startswith("Which problems moved")
    assert any(line.startswith("| GRPO + Branch vs GRPO | arith_heldout |") for line in tail[5:])
    full = next(i for i, line in enumerate(tail) if line.startswith("full report: "))
    assert f"full report: {sweep_dir / 'report' / 'report.md'}" in tail[full]
    assert (sweep_dir / "report" / "report.md").is_file() and any((sweep_dir / "report" / "tables").iterdir())
    url = f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{parent.info.run_id}"
    assert tail[full + 1].startswith(f"MLflow parent run: {url}")
