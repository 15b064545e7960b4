"""``build_once``: a build killed before its clean-up leaves no folder behind once the next build runs."""

import os
import signal
import subprocess
import sys
from pathlib import Path

_KILLED_BUILD = """
import os, signal, sys
from pathlib import Path
from sage.durable import build_once
def build(tmp):
    (tmp / "half.bin").write_bytes(b"x")
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build: no finally runs
build_once(Path(sys.argv[1]), "done.json", build)
"""


def test_a_killed_build_leaves_nothing_after_the_next_build(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "abc123"
    other = tmp_path / "cache" / ".tmp-other-zzz"  # another entry's live build: not ours to remove
    other.mkdir(parents=True)
    r = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(final)], capture_output=True)
    assert r.returncode == -signal.SIGKILL
    (stale,) = final.parent.glob(".tmp-abc123-*")
    assert (stale / "half.bin").is_file() and not final.exists()

    from sage.durable import build_once

    def build(tmp: Path) -> None:
        (tmp / "done.json").write_text("{}")

    assert build_once(final, "done.json", build) == final
    assert (final / "done.json").is_file()
    assert not stale.exists()
    assert sorted(p.name for p in final.parent.iterdir() if p.name.startswith(".tmp-")) == [other.name]
    assert os.listdir(final) == ["done.json"]


_HOLDER = """
import sys
from pathlib import Path
from sage.durable import folder_lock
with folder_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def test_a_wait_on_another_process_lock_names_the_holder_and_says_it_still_waits(tmp_path, caplog):
    """Issue 47: `make run` said "building the testbed base model" and then nothing for minutes while it
    waited on another process's lock. The waiter now names the lock and its holder (pid, host, since when)
    in one line, says every ``every_s`` seconds that it still waits, and says when the lock is its own."""
    import logging
    import socket
    import threading

    from sage.durable import folder_lock

    final = tmp_path / "cache" / "abc123"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(final)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        threading.Timer(1.0, holder.stdin.close).start()  # the holder finishes a second from now
        with caplog.at_level(logging.INFO, logger="sage.durable"), folder_lock(final, every_s=0.3):
            lock = final.parent / ".abc123.lock"
            assert f'"pid": {os.getpid()}' in lock.read_text()  # ours now, for the next waiter to read
    finally:
        holder.kill()
        holder.wait()
    lines = [r.getMessage() for r in caplog.records if r.name == "sage.durable"]
    held_by = f"held by pid {holder.pid} on host {socket.gethostname()} since "
    assert lines[0].startswith(f"waiting for the lock of {final}, {held_by}"), lines
    assert lines[0].endswith(" ago) (lock file .abc123.lock)"), lines
    still = [ln for ln in lines if ln.startswith(f"still waiting for the lock of {final} (")]
    assert still and all(f"so far), {held_by}" in ln for ln in still), lines
    assert lines[-1].startswith(f"the lock of {final} is ours after "), lines
    assert lock.read_text() == ""  # released: no stale holder
