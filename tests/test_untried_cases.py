"""The cases issue 56 had not yet tried, each probed through the command line as a user (or SLURM) meets it:
SIGTERM while a run waits on another process's lock; SIGTERM as SLURM's preemption sends it and the requeued
rerun with resume=auto; a resume under another rollout backend; guide=archer under every divergence; the
entropy-bucket metrics of a guide that never fires."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import prefork
import pytest
from hydra import compose, initialize_config_dir

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


def one_line(r: subprocess.CompletedProcess) -> str:
    """The whole stderr of a refused command: exit code 2 and exactly one line, returned."""
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing of the run itself: at most the files Hydra writes into output_dir before the task."""
    return not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".hydra", "main.log"}


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
    from sage.config import instantiate_node, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train")
    with mock.patch.dict(os.environ, {"SAGE_CACHE_DIR": str(cache)}):
        with mock.patch("sage.paths.build_once", lambda final, *args, **kwargs: final):
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
from sage.quick_exit import quick_exit_when_interrupted

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
    assert one_line(r) == (
        f"error: guide=archer reshapes the anchor of a divergence, but {why}: choose divergence=reverse_kl "
        "(SAGE), forward_kl or sequence_kl with divergence.beta > 0, or guide=none"
    )
    assert only_hydra_files(tmp_path / "run") and not store.exists()  # no run, no MLflow store
