"""The run does not know its launcher: ``resume=false|true|auto`` decides what sage-train does with the
checkpoints in its output_dir (the command line's true/false included); the launchers give every job
``resume=auto`` so a requeued job continues, and a job that fails comes back as a FAILED result that names
it while the other jobs' results are kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import prefork
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from launchers.submitit import with_resume_auto
from sage.config import ConfigError, Resume, register_configs, resume_mode

REPO = Path(__file__).resolve().parents[1]
# A run that builds nothing it does not need: no evaluation, no MLflow, one prompt group per step.
QUICK = [
    "trl.per_device_train_batch_size=4",
    "trl.num_generations=2",
    "trl.save_steps=1",
    "eval.at_end=false",
    "tracking.enabled=false",
]
register_configs()


def cfg_for(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def sage_train(*args: str) -> subprocess.CompletedProcess:
    return prefork.run(
        [sys.executable, "-m", "sage.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def last_line(text: str) -> str:
    return [ln for ln in text.strip().splitlines() if ln.strip()][-1]


def steps(out: Path) -> list[int]:
    return [e["step"] for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]


def test_resume_true_false_auto_from_the_command_line():
    assert resume_mode(cfg_for().resume) is Resume.false
    for value in Resume:
        assert resume_mode(cfg_for(f"resume={value.value}").resume) is value
    with pytest.raises(ConfigError, match=r"resume=maybe is not one of \['false', 'true', 'auto'\]"):
        resume_mode(cfg_for("resume=maybe").resume)
    with pytest.raises(ConfigCompositionException, match="resume=7"):
        cfg_for("resume=7")


def test_a_bad_resume_value_is_one_line_before_anything_runs(tmp_path):
    r = sage_train("resume=maybe", f"output_dir={tmp_path}")
    assert (
        r.returncode == 2
        and last_line(r.stderr) == "error: resume=maybe is not one of ['false', 'true', 'auto']"
    )
    r = sage_train("resume=true", f"output_dir={tmp_path}")
    assert r.returncode == 2 and last_line(r.stderr).startswith("error: resume=true but ")
    assert not (tmp_path / "config.yaml").exists()  # refused before the run wrote anything


def test_the_launchers_add_resume_auto_unless_the_job_chooses():
    assert with_resume_auto(["seed=1", "experiment=grpo"]) == ["seed=1", "experiment=grpo", "resume=auto"]
    assert with_resume_auto(["resume=false", "seed=1"]) == ["resume=false", "seed=1"]
    assert with_resume_auto(["resume=true"]) == ["resume=true"]


@pytest.mark.slow
def test_resume_auto_starts_without_a_checkpoint_and_continues_from_one(tmp_path):
    out = tmp_path / "run"
    r = sage_train(*QUICK, "trl.max_steps=1", "resume=auto", f"output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps(out) == [1] and (out / "rl" / "checkpoint-1").is_dir()
    r = sage_train(*QUICK, "trl.max_steps=2", "resume=auto", f"output_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resume=auto: continuing from {out / 'rl' / 'checkpoint-1'}" in r.stdout + r.stderr
    assert steps(out) == [1, 2]  # step 1 was not trained again
    r = sage_train(*QUICK, "trl.max_steps=3", f"output_dir={out}")  # resume=false: refused
    assert r.returncode == 2 and "already holds checkpoints; pass resume=true (or auto)" in last_line(
        r.stderr
    )


@pytest.mark.slow
def test_a_failed_job_is_reported_failed_and_the_others_still_run(tmp_path):
    """Two local jobs: #0 is refused (a guide without a divergence), #1 runs. The sweep fails naming job
    #0, job #1 finished with the resume=auto the launcher added, and the refused job left no Hydra record (a
    refusal writes nothing)."""
    sweep = tmp_path / "sweep"
    r = sage_train(
        "-m",
        "hydra/launcher=local",
        f"hydra.sweep.dir={sweep}",
        "guide=branch",
        "divergence=none,reverse_kl",
        "trl.max_steps=0",
        *QUICK,
    )
    assert r.returncode != 0
    assert "job #0 (submitit id" in r.stderr and "failed" in r.stderr, r.stderr[-3000:]
    # each job's folder is named by its overrides (sage.run_folder.job_dir)
    jobs = [next(sweep.glob(f"*divergence={d},*")) for d in ("none", "reverse_kl")]
    assert json.loads((jobs[1] / "metrics.json").read_text()) == {}  # max_steps=0, no evaluation
    assert "resume=auto" in (jobs[1] / ".hydra" / "overrides.yaml").read_text()
    assert not (jobs[0] / ".hydra" / "overrides.yaml").exists()


def test_the_slurm_launcher_warns_at_submission_about_sqlite_and_node_local_folders(
    monkeypatch, tmp_path, caplog
):
    """A SLURM grid logging to the default SQLite store, or with the cache, the store or the sweep dir on a
    node-local filesystem, is warned about, a line each, before anything is submitted (issue 39); with a
    tracking server and shared folders it is submitted without a word."""
    import launchers.submitit as submitit_launchers
    from hydra_plugins.sage_launchers import SageSlurmLauncher

    class Submitted(Exception):
        pass

    def submit(self, job_overrides, initial_job_idx):
        raise Submitted

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda1 / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\nnas:/home /home nfs4 rw 0 0\n")
    monkeypatch.setattr(submitit_launchers, "PROC_MOUNTS", mounts)
    monkeypatch.setattr(SageSlurmLauncher, "_start", submit)

    def launch(sweep_dir: str) -> list[str]:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=["hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}"],
                return_hydra_config=True,
            )
        params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        launcher = SageSlurmLauncher(**{k: v for k, v in params.items() if k != "_target_"})
        launcher.setup(hydra_context=None, task_function=None, config=cfg)
        caplog.clear()
        with caplog.at_level("WARNING", logger="launchers.submitit"), pytest.raises(Submitted):
            launcher.launch([["seed=1"], ["seed=2"]], initial_job_idx=0)
        return [r.getMessage() for r in caplog.records if r.name == "launchers.submitit"]

    store = tmp_path / "outputs" / "mlflow.db"  # under /tmp: node-local here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("SAGE_CACHE_DIR", "/home/ada/.cache/sage")  # on nfs4: shared
    warned = launch(f"{tmp_path}/sweep")
    assert len(warned) == 3, warned
    assert warned[0].startswith(f"warning: the MLflow store is the SQLite file {store}, and 2 SLURM jobs")
    assert warned[1].startswith(
        f"warning: the MLflow SQLite store (tracking.uri / $MLFLOW_TRACKING_URI) {store.parent} is on tmpfs"
    )
    assert warned[2].startswith(f"warning: the sweep dir (hydra.sweep.dir) {tmp_path}/sweep is on tmpfs")
    monkeypatch.setenv("SAGE_CACHE_DIR", f"{tmp_path}/cache")
    cache = "warning: the cache (sage.paths.cache_dir(): $SAGE_CACHE_DIR, else ~/.cache/sage)"
    assert launch(f"{tmp_path}/sweep")[1].startswith(f"{cache} {tmp_path}/cache is on tmpfs")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("SAGE_CACHE_DIR", "/home/ada/.cache/sage")
    assert launch("/home/ada/sweeps/a") == []


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_the_readme_says_where_a_grid_jobs_logs_are(launcher):
    """Issue 47: a grid's terminal is quiet until the grid ends, and the README never said where each job's
    log is. It names the folder each launcher gives submitit, and the files submitit writes there."""
    from submitit.core.utils import JobPaths

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    folder = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)["submitit_folder"]
    named = folder.replace("${hydra.sweep.dir}", "<sweep dir>").replace("%j", "<job id>")
    paths = JobPaths(folder, job_id="<job id>", task_id=0)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"each one's log is in `{named}/` (`{paths.stdout.name}` and `_log.err`)" in readme
    assert paths.stderr.name.endswith("_log.err")


def grid_refused(
    tmp_path: Path, *args: str, path: str | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    """``sage-train -m <args>`` into a new sweep dir and a store of its own: (the call, the store's file)."""
    store = tmp_path / "mlflow.db"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    if path is not None:
        env["PATH"] = path
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "-m", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return r, store


@pytest.mark.parametrize(
    "grid", [["seed=1,2"], ["hparams_search=branch_threshold_ratio_testbed"]], ids=["grid", "optuna"]
)
def test_a_slurm_grid_without_a_slurm_client_is_one_line_before_anything_exists(tmp_path, grid):
    """The README's grid and Optuna commands on a machine with no SLURM client: one line, exit 2, and no sweep
    dir, lock, study or MLflow run (it used to make a study and a FAILED parent run, then a traceback)."""
    (tmp_path / "bin").mkdir()
    r, store = grid_refused(tmp_path, "hydra/launcher=slurm", *grid, path=str(tmp_path / "bin"))
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == [
        "error: hydra/launcher=slurm: no SLURM client here (sbatch, sinfo, sacct not on PATH); submit from "
        "the cluster's login node, or run the grid here with hydra/launcher=local"
    ], r.stdout + r.stderr
    assert not (tmp_path / "sweep").exists() and not store.exists()


def test_a_grid_refused_at_its_first_job_leaves_no_sweep_dir_nor_lock(tmp_path):
    """A mistyped key swept over is found when the launcher composes the jobs, after the driver took the sweep
    dir's lock: the one line, and neither the lock file nor the sweep dir it made is left behind."""
    r, store = grid_refused(tmp_path, "hydra/launcher=local", "trl.learning_rat=1e-4,2e-4")
    assert r.returncode == 2 and last_line(r.stderr) == (
        "error: trl.learning_rat=0.0001: no trl option has a key 'learning_rat'; did you mean "
        "trl.learning_rate?"
    )
    assert not (tmp_path / "sweep").exists()
