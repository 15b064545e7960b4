"""The cases issue 56 had not yet tried, each probed through the command line as a user (or SLURM) meets it:
SIGTERM while a run waits on another process's lock (the process must be gone within 5 s); SIGTERM as SLURM's
preemption sends it and the requeued rerun with resume=auto; a resume under another rollout backend or on
another number of processes; guide=archer under every divergence (refused where there is no anchor); the
entropy-bucket metrics of a guide that never fires."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import prefork
import pytest
from hydra import compose, initialize_config_dir
from support import one_line_error, only_hydra_files

REPO = Path(__file__).resolve().parents[1]
# A shrunk run: one prompt group of two completions per step, no evaluation at the end.
QUICK = ("trl.per_device_train_batch_size=4", "trl.num_generations=2", "eval.at_end=false")


def sage_train(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """sage-train as a user types it (forked from the pre-imported server where it can)."""
    return prefork.run(
        [sys.executable, "-m", "sage.train", *overrides],
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def as_foreground() -> None:
    """``preexec_fn`` of a child a test signals: SIGINT and SIGTERM unblocked and at their default, as for a
    command typed at a terminal, whatever the test worker's own state (an ignored or blocked signal is
    inherited across exec)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def sage_train_process(*overrides: str, env: dict[str, str]) -> subprocess.Popen:
    """sage-train in a fresh interpreter of its own (a signal goes to its pid), stderr into stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "sage.train", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        preexec_fn=as_foreground,
    )


def read_until(proc: subprocess.Popen, needle: str, deadline_s: float) -> list[str]:
    """The lines ``proc`` prints up to and including the first that holds ``needle``."""
    deadline, lines = time.monotonic() + deadline_s, []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
    raise AssertionError(f"exit {proc.wait()} before {needle!r}:\n" + "".join(lines)[-3000:])


# ------------------------------------------------------------------------- SIGTERM during a lock wait
def base_model_build_folder(cache: Path) -> Path:
    """Where model=tiny's base model is built under the cache ``cache`` (nothing is built)."""
    from sage.config import register_configs
    from sage.targets import instantiate_node

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train")
    with mock.patch.dict(os.environ, {"SAGE_CACHE_DIR": str(cache)}):
        with mock.patch("sage.durable.build_once", lambda final, *args, **kwargs: final):
            return Path(instantiate_node(cfg.model.source))


@pytest.mark.slow
def test_sigterm_while_waiting_on_a_build_lock_exits_within_5_s(tmp_path):
    """Issue 56: SIGTERM to a sage-train that waited for another job's build of its base model printed its
    line, and the process was still there 5 s later: after the line, the interpreter's teardown of torch's,
    transformers' and TRL's modules took 5 s on an idle machine and 24 s on a loaded one (SLURM kills 30 s
    after its SIGTERM). It now exits as soon as the line is out, and leaves the other job's lock alone."""
    cache = tmp_path / "cache"
    final = base_model_build_folder(cache)
    final.parent.mkdir(parents=True)
    lock_path = final.parent / f".{final.name}.lock"
    out = tmp_path / "run"
    with open(lock_path, "w") as lock:  # another job building the same base model holds its lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = sage_train_process(
            f"output_dir={out}",
            "eval.at_end=false",
            "tracking.enabled=false",
            env={"SAGE_CACHE_DIR": str(cache)},
        )
        try:
            read_until(proc, f"waiting for the lock of {final}", deadline_s=600)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            exited = time.monotonic() - sent
            rest = proc.stdout.read()
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 143, rest[-3000:]
        assert exited < 5, f"exited {exited:.1f} s after SIGTERM"
        assert rest.strip().splitlines() == [
            "terminated (SIGTERM): no MLflow run had started and nothing was recorded; rerun the same "
            "command to start"
        ]
        assert not (out / ".writer.lock").exists()  # its own lock released
        assert not final.exists()  # it built nothing
        # the other job's lock is still held: a third process cannot take it
        with open(lock_path) as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)


QUICK_EXIT = r"""
import atexit, sys, threading, time
from sage.cli import quick_exit_when_interrupted

class Module:  # an object freed only by the interpreter's teardown of its modules
    def __del__(self):
        print("teardown", flush=True)

kept = Module()
atexit.register(print, "atexit handler", flush=True)
threading.Thread(target=lambda: (time.sleep(0.5), print("thread joined", flush=True))).start()
with quick_exit_when_interrupted():
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [143, 130, 2, 0])
def test_an_interrupted_exit_skips_only_the_teardown(code):
    """After SIGTERM (143) or Ctrl-C (130) the interpreter's exit still joins the running threads and runs
    the atexit handlers (MLflow's, multiprocessing's, logging's); only the modules' teardown is skipped. Any
    other exit is the interpreter's own."""
    r = subprocess.run(
        [sys.executable, "-c", QUICK_EXIT, str(code)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == code, r.stderr
    teardown = ["teardown"] if code not in (130, 143) else []
    assert r.stdout.splitlines() == ["thread joined", "atexit handler", *teardown], r.stdout


# ----------------------------------------------------------------- guide=archer under every divergence
@pytest.mark.parametrize(
    ("divergence", "why"),
    [
        (["divergence=none"], "divergence=none has no anchor"),
        (["divergence=reverse_kl", "divergence.beta=0"], "divergence.beta=0 leaves no anchor"),
    ],
)
def test_archer_without_an_anchor_is_one_line_before_any_run(divergence, why, tmp_path):
    """guide=archer releases or keeps a divergence's anchor per token: with none to shape it is refused by
    design. The line named the guide's class (guide=ArcherGuide, not an option one can type) and said
    divergence=none where divergence.beta=0 was the cause."""
    store = tmp_path / "mlflow.db"
    r = sage_train(
        "guide=archer",
        *divergence,
        f"output_dir={tmp_path / 'run'}",
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"},
    )
    assert one_line_error(r) == (
        f"error: guide=archer reshapes the anchor of a divergence, but {why}: choose divergence=reverse_kl "
        "(SAGE), forward_kl or sequence_kl with divergence.beta > 0, or guide=none"
    )
    assert only_hydra_files(tmp_path / "run") and not store.exists()  # no run, no MLflow store


@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "sequence_kl"])
def test_archer_trains_under_every_divergence_with_an_anchor(divergence, tmp_path):
    """guide=archer under each divergence that has an anchor trains: finite loss, divergence and q at every
    step, Archer's split logged (q_high 0: the anchor released above each completion's 0.8 quantile), the
    final model saved. (Its maths under each divergence: tests/test_guides.py.)"""
    out = tmp_path / "run"
    r = sage_train(
        *QUICK,
        "tracking.enabled=false",
        "guide=archer",
        f"divergence={divergence}",
        "trl.max_steps=2",
        f"output_dir={out}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(algorithm=grpo, divergence={divergence}, guide=archer, beta=0.05)" in r.stdout
    steps = [e for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for entry in steps:
        assert all(math.isfinite(entry[k]) for k in ("loss", "divergence", "kl", "guide/q_mean")), entry
        assert entry["guide/q_high"] == 0.0 and entry["guide/quantile"] == 0.8
    assert json.loads((out / "final" / "sage_final.json").read_text())["global_step"] == 2


# ---------------------------------------------------------------- SLURM's preemption, then its requeue
@pytest.fixture(scope="module")
def preempted_and_requeued(tmp_path_factory):
    """A run preempted as SLURM does it (SIGTERM to the job's process while it trains, a checkpoint every
    step), then requeued: the same command again, with the ``resume=auto`` every launcher adds. Before the
    requeue, the save that a SIGKILL after SLURM's grace period would cut short is left beside the
    checkpoints: the next step's folder with its weights cut in half."""
    from sage.tracking import RUN_ID_FILE
    from sage.train.resume import checkpoint_problem

    root = tmp_path_factory.mktemp("preempted")
    out = root / "run"
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    command = (*QUICK, "trl.max_steps=4", "trl.save_steps=1", "resume=auto", f"output_dir={out}")
    proc = sage_train_process(*command, env=env)
    try:
        said = read_until(proc, "step 2/4", deadline_s=900)
        proc.send_signal(signal.SIGTERM)
        said.append(proc.communicate(timeout=120)[0])
    finally:
        proc.kill()
        proc.wait()
    preempted = {"code": proc.returncode, "said": "".join(said), "run_id": (out / RUN_ID_FILE).read_text()}
    rl = out / "rl"
    whole = sorted(
        (d for d in rl.glob("checkpoint-*") if checkpoint_problem(d) is None),
        key=lambda d: int(d.name.split("-")[1]),
    )
    assert whole, preempted["said"][-3000:]
    last = whole[-1]
    cut = rl / f"checkpoint-{int(last.name.split('-')[1]) + 1}"
    if not cut.exists():
        shutil.copytree(last, cut)
        weights = cut / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    requeued = sage_train(*command, env=env)
    return preempted, last, cut, requeued, out, env["MLFLOW_TRACKING_URI"], command


@pytest.mark.slow
def test_a_preempted_run_requeued_continues_its_last_whole_checkpoint_and_its_mlflow_run(
    preempted_and_requeued,
):
    """The preempted job says what it kept (exit 143); its requeue continues from the last whole checkpoint
    (the cut one set aside, never loaded), trains each step once, and records into the same MLflow run,
    each step's metrics once, the run FINISHED."""
    from mlflow.tracking import MlflowClient

    from sage.tracking import RUN_ID_FILE

    preempted, last, cut, requeued, out, store, _ = preempted_and_requeued
    assert preempted["code"] == 143, preempted["said"][-3000:]
    assert "Traceback" not in preempted["said"], preempted["said"][-3000:]
    assert (
        preempted["said"]
        .strip()
        .splitlines()[-1]
        .startswith("terminated (SIGTERM): the MLflow run is marked KILLED; checkpoint-")
    )
    said = requeued.stdout + requeued.stderr
    assert requeued.returncode == 0, said[-3000:]
    assert f"resume=auto: continuing from {last}" in said, said[-3000:]
    assert f"{cut} cannot be resumed from" in said and cut.with_name(f"{cut.name}.incomplete").is_dir()
    history = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]
    assert json.loads((out / "final" / "sage_final.json").read_text())["global_step"] == 4

    client = MlflowClient(store)
    run_id = (out / RUN_ID_FILE).read_text()
    assert run_id == preempted["run_id"]
    every = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in every] == [run_id]  # the requeue started no run of its own
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in ("train/loss", "train/reward", "train/learning_rate"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2, 3, 4], key


# --------------------------------------------------- a resume under another rollout backend or process count
@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "env"),
    [
        (["rollout=fast"], {}),  # the run sampled its rollouts with rollout=hf (the default)
        ([], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}),  # torchrun's rank 0 of two
    ],
    ids=["rollout", "processes"],
)
def test_a_resume_under_another_rollout_or_process_count_is_one_line(preempted_and_requeued, change, env):
    """Continuing a run with another rollout backend (another sampler of the training rollouts) or on
    another number of processes (another batch per optimiser step: the trl.* keys stay the folder's) would
    mix two runs in one. Each is one line naming what changed, before the process group, the model or the
    MLflow run; the folder and its run are left as they were. Before, the process count was not checked:
    the Trainer resumed on two processes with twice the batch, saying only, in a log line, that it found
    no RNG file per process."""
    from mlflow.tracking import MlflowClient

    _, _, _, requeued, out, store, command = preempted_and_requeued
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    before = sorted(p.name for p in (out / "rl").iterdir()), (out / "config.yaml").read_text()
    r = sage_train(*command, "trl.max_steps=6", *change, env={"MLFLOW_TRACKING_URI": store, **env})
    line = one_line_error(r)
    if change:
        assert (
            line.startswith(f"error: output_dir={out} holds a run of another config: ")
            and "rollout_func" in line
        )
    else:
        assert re.fullmatch(
            rf"error: output_dir={re.escape(str(out))}: checkpoint-\d+ was trained on 1 process\(es\) \(4 "
            r"completions per optimiser step\), this run has 2 \(8\): a resume keeps the run's batch; "
            r"resume on 1 process\(es\), or choose another output_dir",
            line,
        ), line
    assert (sorted(p.name for p in (out / "rl").iterdir()), (out / "config.yaml").read_text()) == before
    client = MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"  # not reopened


@pytest.mark.parametrize(
    ("rng_files", "then", "now"), [(["rng_state.pth"], 1, 2), (["rng_state_0.pth", "rng_state_1.pth"], 2, 1)]
)
def test_a_checkpoints_process_count_is_read_from_its_rng_states(tmp_path, rng_files, then, now):
    """The Trainer saves one RNG state per process (rng_state.pth on one): a resume on another count is the
    one line, whichever way it changes, before the process group exists (rank 0 of a torchrun of ``now``)."""
    import torch

    checkpoint = tmp_path / "run" / "rl" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    for name in rng_files:
        torch.save({"python": 0}, checkpoint / name)
    ranks = {"WORLD_SIZE": str(now), "RANK": "0", "LOCAL_RANK": "0"} if now > 1 else {}
    r = sage_train(
        *QUICK, "tracking.enabled=false", "resume=auto", f"output_dir={tmp_path / 'run'}", env=ranks
    )
    assert one_line_error(r) == (
        f"error: output_dir={tmp_path / 'run'}: checkpoint-3 was trained on {then} process(es) ({4 * then} "
        f"completions per optimiser step), this run has {now} ({4 * now}): a resume keeps the run's batch; "
        f"resume on {then} process(es), or choose another output_dir"
    )
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {".hydra", "main.log", "rl"}  # nothing written


# ------------------------------------------------------------ the entropy buckets of a guide that never fires
@pytest.mark.slow
def test_a_guide_that_never_fires_logs_finite_buckets_and_says_so(tmp_path):
    """guide=branch above every token's entropy leaves q at 1 everywhere: every bucket the step's tokens
    fill logs finite statistics (q exactly 1), a bucket no token fell in logs its share, 0, and nothing
    else (an empty bucket's mean is left out, never a NaN), MLflow holds no NaN, and the run ends with the
    one warning that the guide acted nowhere."""
    from mlflow.tracking import MlflowClient

    from sage.objective.buckets import STATS
    from sage.tracking import RUN_ID_FILE
    from sage.train.figures import BUCKETS

    store, out = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    r = sage_train(
        *QUICK,
        "guide=branch",
        "guide.threshold=100",
        "trl.max_steps=2",
        f"output_dir={out}",
        env={"MLFLOW_TRACKING_URI": store},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [e for e in json.loads((out / "train_log.json").read_text()) if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for entry in steps:
        assert entry["guide/active_frac"] == 0.0
        for bucket in BUCKETS:
            share = entry[f"anchor_buckets/{bucket}/share"]
            logged = {s: entry.get(f"anchor_buckets/{bucket}/{s}") for s in STATS}
            if share == 0.0:  # no token of the step in this bucket: its share alone
                assert all(v is None for s, v in logged.items() if s != "share"), (bucket, logged)
            else:
                assert all(v is not None and math.isfinite(v) for v in logged.values()), (bucket, logged)
                assert logged["q"] == 1.0
    assert any(e["anchor_buckets/q5/share"] > 0 for e in steps)  # the quintiles hold the step's tokens

    client = MlflowClient(store)
    run = client.get_run((out / RUN_ID_FILE).read_text())
    buckets = {k: v for k, v in run.data.metrics.items() if k.startswith("train/anchor_buckets/")}
    assert buckets and all(math.isfinite(v) for v in buckets.values()), buckets
    assert "anchor_buckets.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert re.search(
        r"guide.threshold=100(\.0)?: the guide acted on 0.00% of completion tokens", r.stdout + r.stderr
    )
