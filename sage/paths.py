"""Where things live on disk: the config tree, the cache root, and the shared base-model evaluation cells."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# An absolute path: relative config paths resolve differently under a console script and `python -m`.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def cache_dir() -> Path:
    """Root of everything built once per machine (testbed models, shared base evaluations)."""
    return Path(os.environ.get("SAGE_CACHE_DIR") or Path.home() / ".cache" / "sage")


def base_results_dir(model_path: str) -> Path:
    """Evaluation cells of a start model, shared by every run (and ``sage-eval``) that starts from it."""
    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "eval" / key
