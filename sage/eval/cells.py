"""Result cells: one stored (checkpoint, dataset, seed) evaluation, keyed by everything that changes its
samples so that results made under other settings are never mixed in, written atomically so that a killed
evaluation leaves no half-finished cell; and the run's ``results.json``."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sage.eval.sampling import SamplingSettings
from sage.metrics import pass_at_k_curve

RESULTS_FILE = "results.json"


@dataclass(frozen=True)
class CellKey:
    """Everything that changes the samples of a stored cell, recorded with it: the sampling settings and
    what they were applied to. ``template`` fingerprints the rendered prompt (system prompt, chat template,
    output tags); ``model`` the checkpoint's files (Checkpoint.fingerprint)."""

    settings: SamplingSettings
    template: str
    backend: str
    dtype: str
    model: str

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def cell_dir(results_dir: Path, key: CellKey) -> Path:
    return results_dir / f"{key.key()}_seed{key.settings.seed}"


def load_cell(cell: Path, key: CellKey, ids: list[str]) -> dict | None:
    """A finished cell made under exactly this key and these problems, else None."""
    if not (cell / "correct.npy").exists():
        return None
    meta = json.loads((cell / "meta.json").read_text())
    if meta["key"] != asdict(key) or meta["ids"] != ids:
        return None
    return {
        "correct": np.load(cell / "correct.npy"),
        "completions": json.loads((cell / "completions.json").read_text()),
    }


@contextlib.contextmanager
def cell_lock(cell: Path) -> Iterator[None]:
    """Held while a cell is looked up and, if missing, sampled. The base model's cells are shared by every
    run of a grid, and a grid's jobs evaluate them at the same time: the second job waits for the first and
    reuses its cell instead of sampling the same cell again beside it (and racing it to the folder). The lock
    is released when its holder dies."""
    cell.parent.mkdir(parents=True, exist_ok=True)
    with open(cell.parent / f".{cell.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def store_cell(
    cell: Path, key: CellKey, ids: list[str], correct: np.ndarray, completions: list[list[str]]
) -> None:
    """Written to a temporary folder of its own and renamed: a killed evaluation leaves no half-finished cell,
    and two writers (on a file system flock does not reach across) never write into one folder."""
    for stale in cell.parent.glob(f".tmp-{cell.name}-*"):  # left by a killed writer (called under the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{cell.name}-", dir=cell.parent))
    try:
        np.save(tmp / "correct.npy", correct)
        (tmp / "completions.json").write_text(json.dumps(completions))
        (tmp / "curve.json").write_text(json.dumps(pass_at_k_curve(correct)))
        (tmp / "meta.json").write_text(json.dumps({"key": asdict(key), "ids": ids}))
        if cell.exists():  # a stale cell under the same key (its problems changed): replaced, not mixed
            shutil.rmtree(cell)
        os.replace(tmp, cell)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_results(path: Path, model_path: str, results: dict[str, dict]) -> None:
    payload: dict[str, Any] = {
        "checkpoint": model_path,
        "datasets": {
            name: {
                "n_problems": int(r["correct"][0].shape[0]),
                "summary": r["summary"],
                "curve": r["curve"],
                "settings": r["settings"],
            }
            for name, r in results.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
