"""No process that sage-train or sage-eval started outlives it.

vLLM runs its engine in processes of its own (EngineCore, and on the CPU build a worker under it). Shut down
by :func:`sage.eval.sampling.shutdown_engine` they go; but when the run itself is killed (SIGKILL from a
timeout, the OOM killer, ``kill -9``; SIGTERM, whose default action skips every ``finally``), they are
re-parented and keep running, holding the engine's memory share (0.3 of the machine's RAM on a CPU, most of
a GPU) and a core: the next engine is then refused memory. SLURM kills a job's whole cgroup, a laptop or a
test's timeout does not.

So each entry point starts one watcher process. It records, once a second, the processes the run has
started (its descendants, the watcher itself aside); when the run's process is gone it gives them a grace
period to end by themselves (a pool's workers whose pipe closed), then kills the ones of its last record
that still run. A descendant that left the tree on purpose (a daemon that forked away) is no longer in the
record. multiprocessing's resource tracker is spared: it ends by itself once every process holding it is
gone, and then unlinks the shared memory they leaked. The watcher is in a session of its own, so a signal
to the run's process group does not take it first.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import psutil

POLL_S, GRACE_S = 1.0, 3.0


def reap_on_exit() -> subprocess.Popen:
    """Start the watcher of this process (the entry points call it once, first thing)."""
    return subprocess.Popen(
        [sys.executable, "-m", "sage.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        # no torch, no CUDA in the watcher: it imports psutil only
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def descendants(run: psutil.Process, me: int) -> list[psutil.Process]:
    return [p for p in run.children(recursive=True) if p.pid != me]


def _spared(p: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except psutil.Error:
        return True  # gone, or not ours to read


def watch(pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Until ``pid`` is gone; then kill its descendants of the last record that still run after
    ``grace_s`` (a Process object checks its creation time, so a reused pid is never hit). Returns the pids
    it killed."""
    me = os.getpid()
    record: list[psutil.Process] = []
    try:
        run = psutil.Process(pid)
        # readable once the run has exited: the watcher wakes then, not at its next poll, so a finished run's
        # stderr (which the watcher shares) closes as soon as the run's does
        exited = os.pidfd_open(pid)
        while True:
            seen = descendants(run, me)
            # a record taken after the run's death misses what it started (re-parented by then): keep the last
            # one taken while it still ran (a zombie runs no more)
            if not run.is_running() or run.status() == psutil.STATUS_ZOMBIE:
                break
            record = seen
            if select.select([exited], [], [], poll_s)[0]:
                break
    except (psutil.NoSuchProcess, ProcessLookupError):
        pass
    record = [p for p in record if not _spared(p)]
    _, record = psutil.wait_procs(record, timeout=grace_s)
    killed = []
    for p in record:
        try:
            p.kill()  # SIGKILL: vLLM's worker ignores SIGTERM, and nothing is left for it to do
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return killed


if __name__ == "__main__":
    killed = watch(int(sys.argv[1]))
    if killed:
        print(
            f"sage: killed {len(killed)} process(es) left behind by run process {sys.argv[1]}: {killed}",
            file=sys.stderr,
        )
