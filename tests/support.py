"""Helpers the tests share (imported as ``support``, never from another test module)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The whole stderr of a refused command: exit code 2 and exactly one line, returned."""
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def only_hydra_files(run_dir: Path) -> bool:
    """Nothing of the run itself: at most the run files Hydra writes into output_dir before the task."""
    return not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".hydra", "main.log"}
