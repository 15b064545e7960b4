"""``build_once``: a build killed before its clean-up leaves no folder behind once the next build runs."""

import os
import signal
import subprocess
import sys
from pathlib import Path

_KILLED_BUILD = """
import os, signal, sys
from pathlib import Path
from sage.paths import build_once
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

    from sage.paths import build_once

    def build(tmp: Path) -> None:
        (tmp / "done.json").write_text("{}")

    assert build_once(final, "done.json", build) == final
    assert (final / "done.json").is_file()
    assert not stale.exists()
    assert sorted(p.name for p in final.parent.iterdir() if p.name.startswith(".tmp-")) == [other.name]
    assert os.listdir(final) == ["done.json"]
