"""A killed run takes the processes it started with it (sage.reaper), as a killed vLLM run must: its engine
processes, re-parented, would keep the engine's memory share and refuse the next engine."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from sage import reaper

# A stand-in for sage-train with a vLLM engine: it starts the watcher as the entry points do, then a child
# that ignores SIGTERM (as vLLM's CPU worker did) with a grandchild under it, a multiprocessing resource
# tracker, and a daemon that forks away from the tree; it prints their pids and waits to be killed.
RUN = textwrap.dedent(
    """
    import json, multiprocessing.resource_tracker as rt, os, subprocess, sys, time
    from sage.reaper import reap_on_exit
    reap_on_exit()
    stubborn = subprocess.Popen([sys.executable, "-c", '''
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(g.pid, flush=True)
    time.sleep(600)
    '''], stdout=subprocess.PIPE, text=True)
    grandchild = int(stubborn.stdout.readline())
    rt.ensure_running()
    daemon = subprocess.run([sys.executable, "-c", '''
    import os, subprocess, sys
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(p.pid)
    '''], capture_output=True, text=True, check=True)
    tracker = rt._resource_tracker._pid
    print(json.dumps({"stubborn": stubborn.pid, "grandchild": grandchild, "tracker": tracker,
                      "daemon": int(daemon.stdout)}), flush=True)
    if sys.argv[1] == "exit":  # a run that stops what it started, as a finished run does
        time.sleep(2)
        os.kill(grandchild, 9)
        stubborn.kill(); stubborn.wait()
        sys.exit(0)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start(how: str) -> tuple[subprocess.Popen, dict]:
    run = subprocess.Popen(
        [sys.executable, "-c", RUN, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pids = json.loads(run.stdout.readline())
    assert all(alive(p) for p in pids.values()), pids
    time.sleep(2 * reaper.POLL_S)  # the watcher's record holds them
    return run, pids


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_run_takes_the_processes_it_started_with_it(sig):
    run, pids = start("wait")
    try:
        os.kill(run.pid, sig)
        # stderr ends when its last holder ends: the watcher, the stubborn child and the grandchild
        _, err = run.communicate(timeout=reaper.POLL_S + reaper.GRACE_S + 30)
        # the stubborn child ignores SIGTERM and the grandchild was never signalled: the watcher killed both
        assert not alive(pids["stubborn"]) and not alive(pids["grandchild"])
        assert f"killed 2 process(es) left behind by run process {run.pid}" in err
        # the resource tracker is spared, and ends by itself once nothing holds it
        assert gone_within([pids["tracker"]], 10)
        # a process that left the tree on purpose is not the run's to kill
        assert alive(pids["daemon"])
    finally:
        kill_all(pids)


def test_a_run_that_ends_by_itself_leaves_nothing_to_kill():
    run, pids = start("exit")
    try:
        _, err = run.communicate(timeout=reaper.POLL_S + reaper.GRACE_S + 30)
        assert run.returncode == 0
        assert "killed" not in err  # its watcher ended and killed nothing
        assert alive(pids["daemon"])
    finally:
        kill_all(pids)


def kill_all(pids: dict) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
