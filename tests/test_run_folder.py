"""A run folder holds one config, one writer and one MLflow run, and keeps its results (issue 23).

Each case was first reproduced against the code before the fix: a grid rerun with a changed seed list
continued other seeds' runs, an extended Optuna study scored a new trial from an old trial's model, a
resume with another config trained in the folder, two writers shared a folder, sage-report grouped an
extended run by its first length and split rows on trl.save_steps, extending a run deleted its sage-eval
results, a copied folder logged into the original's MLflow run, and torn weight files gave tracebacks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support import (
    REPO,
    TINY,
    as_foreground,
    compose,
    entry_point,
    env_for,
    one_line_error,
    sage_eval,
    sage_train,
)

from sage.config import ConfigError
from sage.durable import LOCK_FILE, writer_lock
from sage.run_folder import (
    IDENTITY_FILE,
    NO_RESULT_KEYS,
    check_identity,
    identity,
    job_dir,
    matches,
    record_identity,
)
from sage.tracking import RUN_ID_FILE, start_run
from sage.train.resume import set_aside_incomplete_checkpoints

SINCE = r" since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \w+"  # when the holder took the lock


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def train_runs(uri: str, experiment: str) -> list:
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [r for r in runs if r.data.tags.get("sage.kind") == "train"]


# ------------------------------------------------------------------ identity (fast)
def test_the_identity_leaves_out_only_what_a_resume_may_change(tmp_path):
    base = compose("seed=2")
    same = compose(
        "seed=2",
        "trl.max_steps=7",  # extends the run
        "eval.n_samples=3",  # measures it differently
        "trl.save_steps=3",  # changes no result
        "tracking.experiment=x",
        "resume=auto",
    )
    assert identity(base) == identity(same)
    assert {"seed", "divergence._target_", "trl.learning_rate"} <= set(identity(base))
    assert not any(
        k.startswith(("eval.", "tracking.")) or k in ("trl.max_steps", "trl.save_steps")
        for k in identity(base)
    )
    record_identity(base, tmp_path)
    check_identity(same, tmp_path)  # a resume that extends the run
    other = compose("seed=7", "guide=branch", "divergence=forward_kl")
    with pytest.raises(ConfigError) as e:
        check_identity(other, tmp_path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"output_dir={tmp_path} holds a run of another config")
    for key in ("divergence._target_", "guide._target_", "seed=7 (the folder's: 2)"):
        assert key in message


def test_a_folder_of_an_earlier_version_is_checked_against_its_config_yaml(tmp_path):
    OmegaConf.save(compose("seed=2"), tmp_path / "config.yaml", resolve=True)
    check_identity(compose("seed=2", "trl.max_steps=9"), tmp_path)
    with pytest.raises(ConfigError, match="seed=3"):
        check_identity(compose("seed=3"), tmp_path)
    assert not (tmp_path / IDENTITY_FILE).exists()  # a check writes nothing


def test_a_sweep_job_folder_is_named_by_its_config_not_its_job_number():
    assert job_dir(["seed=3", "experiment=grpo"]) == job_dir(["experiment=grpo", "seed=3", "resume=auto"])
    assert job_dir(["seed=3"]) != job_dir(["seed=1"])
    # what the launcher and the sweeper add, and what changes no result, do not rename a job's folder
    assert job_dir(["seed=1", "++tracking.tags.trial='4'", "trl.save_steps=2"]) == "seed=1"
    # an unsafe character is replaced, and a hash keeps two such names apart
    a, b = job_dir(["data.source=/x/a.jsonl"]), job_dir(["data.source=/x_a.jsonl"])
    assert "/" not in a and a != b
    assert len(job_dir([f"guide.ratio={i / 7}" for i in range(40)])) <= 130


# ------------------------------------------------------------------ one writer (fast)
def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    with writer_lock(tmp_path):
        with pytest.raises(ConfigError) as e:
            with writer_lock(tmp_path):
                pass
    assert re.fullmatch(
        re.escape(f"output_dir={tmp_path} is being written by another run (pid {os.getpid()} on host ")
        + re.escape(socket.gethostname())
        + SINCE
        + re.escape("); wait for it to end, or choose another output_dir"),
        str(e.value),
    ), str(e.value)
    with writer_lock(tmp_path):  # released at the end of the run
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()  # a refused command into the folder leaves nothing there


def test_a_second_grid_driver_over_a_job_being_written_is_one_line_naming_the_holder(tmp_path):
    """Issue 47: a second grid driver's job, refused by its writer lock inside a submitit job, ended in the
    launcher's report and a 40-line traceback. The grid now stops before it submits anything."""
    sweep = tmp_path / "sweep"
    # values Hydra's sweeper writes back as given (it writes false as False)
    job = ["seed=1", "trl.max_steps=0", "eval.limit=2", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    folder = sweep / job_dir(job)
    folder.mkdir(parents=True)
    with writer_lock(folder):  # the first driver's job, still running
        r = entry_point("sage.train", "-m", "hydra/launcher=local", *job, f"hydra.sweep.dir={sweep}")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, "\n".join(lines[-50:])
    assert lines[-1].startswith("error: job #0 (seed=1 trl.max_steps=0 eval.limit=2 tracking.uri=")
    assert re.search(
        re.escape(f"): output_dir={folder} is being written by another run (pid {os.getpid()} on host ")
        + re.escape(socket.gethostname())
        + SINCE
        + re.escape("); wait for it to end, or choose another hydra.sweep.dir")
        + "$",
        lines[-1],
    ), lines[-1]
    assert not (sweep / ".submitit").exists()  # nothing submitted


def test_a_second_grid_driver_into_a_held_sweep_dir_is_one_line_and_writes_nothing(tmp_path):
    """Issue 47: two different grids launched into one sweep dir at once merged under the first grid's
    parent run and name, and multirun.yaml kept only the second grid's sweep."""
    from sage.durable import _acquire
    from sage.grid import JOBS_FILE
    from sage.run_folder import GRID_LOCK_FILE

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    job = ["seed=3", "trl.max_steps=0", "eval.limit=2", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    held = _acquire(sweep, GRID_LOCK_FILE)  # the first grid's driver, still running
    try:
        r = entry_point("sage.train", "-m", "hydra/launcher=local", *job, f"hydra.sweep.dir={sweep}")
    finally:
        held.close()
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, "\n".join(lines[-50:])
    assert re.fullmatch(
        re.escape(
            f"error: hydra.sweep.dir={sweep} is being driven by another grid (pid {os.getpid()} on host "
        )
        + re.escape(socket.gethostname())
        + SINCE
        + re.escape("); wait for it to end, or choose another hydra.sweep.dir"),
        lines[-1],
    ), lines[-1]
    assert sorted(p.name for p in sweep.iterdir()) == [GRID_LOCK_FILE]  # nothing submitted or recorded
    assert not (sweep / JOBS_FILE).exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_grid_extended_in_its_sweep_dir_is_renamed_to_what_it_now_compares(tmp_path):
    """Issue 47: extending a grid in its sweep dir kept its first name ("experiment=grpo,grpo_branch x
    seed=1,2" over four methods). Two launches into one sweep dir, seeds 1 then 2: one parent run, named
    by both, its lock released after each."""
    from sage.run_folder import GRID_LOCK_FILE

    sweep, uri = tmp_path / "sweep", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["trl.max_steps=0", "eval.limit=2", "eval.n_samples=2", "eval.ks=[1,2]", f"tracking.uri={uri}"]
    for seed in ("1", "2"):
        r = entry_point(
            "sage.train", "-m", "hydra/launcher=local", f"seed={seed}", "rollout=fast,hf", *common,
            f"hydra.sweep.dir={sweep}", timeout=900,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert not (sweep / GRID_LOCK_FILE).exists()  # released when the grid ends
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name("sage").experiment_id
    (parent,) = client.search_runs([exp], "tags.`sage.kind` = 'grid'")
    assert parent.info.run_name == "seed=1,2 x rollout=fast,hf"
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 4


# ------------------------------------------------------------------ MLflow (fast)
def tracking_cfg(uri: str, **extra):
    """What start_run reads of a config: the tracking node (every field the schema has), seed, two keys."""
    from sage.config import TrackingConfig

    cfg = OmegaConf.create({"seed": 1, "trl": {"max_steps": 2, "save_steps": 50}, **extra})
    cfg.tracking = OmegaConf.structured(TrackingConfig(uri=uri, experiment="e"))
    return cfg


def test_a_copied_folder_starts_its_own_mlflow_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a = tmp_path / "a"
    a.mkdir()
    with start_run(tracking_cfg(uri), a, kind="train", resume=False) as tracker:
        original = tracker.run_id
    record = json.loads((a / f"{RUN_ID_FILE}.json").read_text())
    assert record == {"run_id": original, "tracking_uri": uri, "folder": str(a.resolve())}
    shutil.copytree(a, tmp_path / "b")
    with start_run(tracking_cfg(uri), tmp_path / "b", kind="train", resume=True) as tracker:
        copy = tracker.run_id
    assert copy != original and (tmp_path / "b" / RUN_ID_FILE).read_text() == copy
    assert mlflow_client(uri).get_run(original).info.status == "FINISHED"
    with start_run(tracking_cfg(uri), a, kind="train", resume=True) as tracker:  # the original continues
        assert tracker.run_id == original


def test_the_report_labels_an_extended_run_by_its_length_and_ignores_save_steps(tmp_path):
    from analysis import load

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, extra in [("extended", {}), ("fresh", {"seed": 2}), ("saves", {"seed": 3})]:
        (tmp_path / name).mkdir()
        cfg = tracking_cfg(uri, method="grpo", **extra)
        if name == "saves":
            cfg.trl.save_steps = 1
        with start_run(cfg, tmp_path / name, kind="train", resume=False):
            pass
    longer = tracking_cfg(uri, method="grpo")
    longer.trl.max_steps = 4  # resume=true trl.max_steps=4
    with start_run(longer, tmp_path / "extended", kind="train", resume=True):
        pass
    client = mlflow_client(uri)
    frame = load.runs_frame(load.fetch_runs(client, "e"))
    rows = dict(zip(frame["seed"], load.assign_rows(frame), strict=True))
    assert rows == {1: "GRPO [trl.max_steps=4]", 2: "GRPO [trl.max_steps=2]", 3: "GRPO [trl.max_steps=2]"}


# ------------------------------------------------------------------ torn weight files (fast)
def safetensors_file(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path))


def cut(path: Path, fraction: float = 0.75) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * fraction))


def test_a_checkpoint_whose_weights_are_cut_short_is_set_aside(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    rl = tmp_path / "rl"
    for step in (1, 2):
        folder = rl / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        safetensors_file(folder / "model.safetensors")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    cut(rl / "checkpoint-2" / "model.safetensors")  # trainer_state.json is there, the weights are not whole
    set_aside_incomplete_checkpoints(rl)
    assert get_last_checkpoint(str(rl)) == str(rl / "checkpoint-1")
    assert (rl / "checkpoint-2.incomplete" / "model.safetensors").is_file()  # kept


def test_a_save_interrupted_in_its_temporary_folder_is_set_aside(tmp_path):
    rl = tmp_path / "rl"
    (rl / ".tmp-checkpoint-3" / "checkpoint-3").mkdir(parents=True)
    (rl / ".tmp-checkpoint-3" / "checkpoint-3" / "model.safetensors").write_bytes(b"partial")
    set_aside_incomplete_checkpoints(rl)
    assert sorted(p.name for p in rl.iterdir()) == ["checkpoint-3.incomplete"]


# ------------------------------------------------------------------ real runs
def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` but Hydra's own (size, mtime): what a refused command must not touch."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and ".hydra" not in p.parts and p.name != "main.log"
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run that saved a checkpoint at each step; tests work on copies of it."""
    root = tmp_path_factory.mktemp("run_folder")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    r = sage_train(
        *TINY,
        "trl.max_steps=2",
        "trl.save_steps=1",
        f"output_dir={root / 'a'}",
        env=env_for(uri),
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (root / "a" / "rl").iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    return {"root": root, "uri": uri, "run": root / "a"}


def copy_of(finished, name: str) -> Path:
    dst = finished["root"] / name
    shutil.copytree(finished["run"], dst)
    return dst


@pytest.mark.slow
def test_a_resume_with_another_config_is_one_line_and_writes_nothing(finished):
    run = copy_of(finished, "other_config")
    before = tree(run)
    r = sage_train(
        *TINY, "trl.max_steps=3", "resume=true", "seed=7", "guide=branch", "divergence=forward_kl",
        f"output_dir={run}", env=env_for(finished["uri"]),
    )  # fmt: skip
    line = one_line_error(r)
    assert line.startswith(f"error: output_dir={run} holds a run of another config: ")
    assert "divergence._target_=" in line and "guide._target_=" in line and "seed=7 (the folder's: 0)" in line
    assert tree(run) == before


@pytest.mark.slow
def test_two_writers_in_one_folder(tmp_path):
    """The second sage-train into a folder a live one writes is one line naming the first's pid and host."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "shared"
    first = subprocess.Popen(
        [sys.executable, "-m", "sage.train", *TINY, "trl.max_steps=500", "seed=1", f"output_dir={out}"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env_for(uri)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=as_foreground,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "config.yaml").exists():  # past its start-up checks: it writes the folder now
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        r = sage_train(
            *TINY, "trl.max_steps=2", "seed=2", "resume=auto", f"output_dir={out}", env=env_for(uri)
        )
        assert first.poll() is None  # still training: the refusal came while it held the folder
    finally:
        first.send_signal(signal.SIGINT)  # Ctrl-C: it closes its MLflow run and grading workers
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
    assert re.fullmatch(
        re.escape(f"error: output_dir={out} is being written by another run (pid {first.pid} on host ")
        + re.escape(socket.gethostname())
        + SINCE
        + re.escape("); wait for it to end, or choose another output_dir"),
        one_line_error(r),
    ), one_line_error(r)
    assert OmegaConf.load(out / "config.yaml").seed == 1


@pytest.fixture(scope="module")
def extended_copy(finished):
    """A copy of the finished run, evaluated by sage-eval, then extended to 3 steps."""
    run = copy_of(finished, "extended")
    env = env_for(finished["uri"])
    r = sage_eval(f"checkpoint={run / 'final'}", "eval.n_samples=2", "eval.ks=[1,2]", "eval.limit=4", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = {
        "results": (run / "final" / "eval" / "results.json").read_text(),
        "weights": (run / "final" / "model.safetensors").read_bytes(),
        "run_id": next(
            p for p in (run / "final" / "eval").glob(f"{RUN_ID_FILE}.*") if p.suffix != ".json"
        ).read_text(),
    }
    r = sage_train(*TINY, "resume=true", "trl.max_steps=3", "trl.save_steps=1", f"output_dir={run}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return {**finished, "run": run, "evaluated": evaluated}


@pytest.mark.slow
def test_extending_a_run_keeps_its_sage_eval_results_beside_their_weights(extended_copy):
    run, evaluated = extended_copy["run"], extended_copy["evaluated"]
    kept = run / "final-step-2"
    assert json.loads((run / "final" / "sage_final.json").read_text())["global_step"] == 3
    results = json.loads((kept / "eval" / "results.json").read_text())
    # the same numbers, naming the folder that now holds the weights they measured
    assert results == {**json.loads(evaluated["results"]), "checkpoint": str(kept.resolve())}
    assert (kept / "model.safetensors").read_bytes() == evaluated["weights"]
    # the evaluation run names the folder that now holds the weights it measured
    tags = mlflow_client(extended_copy["uri"]).get_run(evaluated["run_id"]).data.tags
    assert tags["checkpoint"] == str(kept)


@pytest.mark.slow
def test_a_copied_run_folder_resumes_into_a_new_mlflow_run(extended_copy):
    client = mlflow_client(extended_copy["uri"])
    original = (extended_copy["root"] / "a" / RUN_ID_FILE).read_text()
    copy = (extended_copy["run"] / RUN_ID_FILE).read_text()
    assert copy != original
    assert max(m.step for m in client.get_metric_history(original, "train/loss")) == 2  # nothing added
    assert client.get_run(original).info.status == "FINISHED"
    assert not any(k.startswith("resumed.") for k in client.get_run(original).data.tags)
    assert client.get_run(copy).data.params["trl.max_steps"] == "3"


@pytest.mark.slow
def test_a_resume_past_a_checkpoint_with_cut_weights_continues_from_the_one_before(finished):
    run = copy_of(finished, "torn")
    cut(run / "rl" / "checkpoint-2" / "model.safetensors")
    r = sage_train(*TINY, "resume=true", "trl.max_steps=3", "trl.save_steps=1", f"output_dir={run}",
                   env=env_for(finished["uri"]))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"continuing from {run / 'rl' / 'checkpoint-1'}" in r.stdout + r.stderr
    assert (run / "rl" / "checkpoint-2.incomplete" / "model.safetensors").is_file()
    assert json.loads((run / "final" / "sage_final.json").read_text())["global_step"] == 3


@pytest.mark.slow
def test_sage_eval_of_weights_cut_short_is_one_line_before_anything(finished):
    checkpoint = finished["root"] / "torn_final"
    shutil.copytree(finished["run"] / "final", checkpoint)
    shutil.rmtree(checkpoint / "eval", ignore_errors=True)
    size = (checkpoint / "model.safetensors").stat().st_size
    cut(checkpoint / "model.safetensors")
    r = sage_eval(f"checkpoint={checkpoint}", "tracking.experiment=torn", env=env_for(finished["uri"]))
    assert one_line_error(r) == (
        f"error: checkpoint={checkpoint}: weight file model.safetensors is cut short "
        f"({int(size * 0.75)} bytes; the header describes {size})"
    )
    assert not (checkpoint / "eval").exists()
    client = mlflow_client(finished["uri"])
    experiment = client.get_experiment_by_name("torn")  # the store check may create it: no run in it
    assert experiment is None or not client.search_runs([experiment.experiment_id])


# ------------------------------------------------------------------ sweeps rerun in the same folder
def multirun(*args: str, uri: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return entry_point("sage.train", "-m", *args, env=env_for(uri), cwd=REPO, timeout=timeout)


def took_another_config(runs: list) -> list[str]:
    """The resumed.<key> tags of keys that define a run's results: a run continued under another config."""
    return [
        k
        for r in runs
        for k in r.data.tags
        if k.startswith("resumed.") and not matches(k.removeprefix("resumed."), NO_RESULT_KEYS)
    ]


@pytest.mark.slow
def test_a_grid_rerun_with_a_changed_seed_list_gives_each_seed_its_own_run(tmp_path):
    """`seed=1`, then `seed=2,1` in the same sweep dir (job 0 is now seed 2): seed 2 trains in a folder of
    its own, seed 1 continues its own finished run; MLflow holds one run per seed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    grid = [
        "hydra/launcher=local",
        *TINY,
        "trl.max_steps=1",
        "eval.at_end=false",
        f"hydra.sweep.dir={tmp_path / 'grid'}",
    ]
    r = multirun(*grid, "seed=1", uri=uri)
    assert r.returncode == 0, r.stderr[-3000:]
    r = multirun(*grid, "seed=2,1", uri=uri)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = train_runs(uri, "sage")
    assert sorted(int(r.data.tags["seed"]) for r in runs) == [1, 2]  # one run per seed
    assert not took_another_config(runs)
    for run in runs:  # each seed's run lives in a folder that holds that seed's config and model
        folder = Path(run.data.tags["output_dir"])
        assert OmegaConf.load(folder / "config.yaml").seed == int(run.data.tags["seed"])
        assert json.loads((folder / IDENTITY_FILE).read_text())["seed"] == int(run.data.tags["seed"])
        assert json.loads((folder / "final" / "sage_final.json").read_text())["global_step"] == 1


@pytest.mark.slow
def test_an_extended_study_never_scores_a_new_trial_from_an_old_trials_model(tmp_path):
    """n_trials=1, then n_trials=2 in the same sweep dir: trial 1 trains in a folder of its own."""
    import optuna

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = [
        "hydra/sweeper=optuna",
        "hydra.sweeper.objectives=[pass_at_1/trained/arith_heldout]",
        "hydra.sweeper.directions=[maximize]",
        "hydra.sweeper.study_name=ext",
        f"hydra.sweeper.storage=sqlite:///{tmp_path / 'study.db'}",
        "hydra.sweeper.n_jobs=1",
        "guide=branch",
        "guide.ratio=interval(0.1,0.5)",
        *TINY,
        "trl.max_steps=1",
        "resume=auto",  # what sage's launchers give every job (Hydra's basic one runs these trials)
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    for n in (1, 2):
        r = multirun(*study, f"hydra.sweeper.n_trials={n}", uri=uri)
        assert r.returncode == 0, r.stderr[-3000:]
    runs = train_runs(uri, "sage")
    assert sorted(r.data.tags["trial"] for r in runs) == ["0", "1"]  # one MLflow run per trial
    assert not took_another_config(runs)  # trial 0's run is trial 0's alone
    trials = optuna.load_study(study_name="ext", storage=f"sqlite:///{tmp_path / 'study.db'}").trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in trials:  # each trial trained its own model in its own folder
        folder = tmp_path / "sweep" / "ext" / str(t.number)
        assert t.user_attrs["job_dir"] == str(folder)
        assert OmegaConf.load(folder / "config.yaml").guide.ratio == pytest.approx(t.params["guide.ratio"])
        assert json.loads((folder / "final" / "sage_final.json").read_text())["global_step"] == 1
