"""Result cells: one stored (checkpoint, dataset, seed) evaluation, keyed by everything that changes its
samples so that results made under other settings are never mixed in, written atomically so that a killed
evaluation leaves no half-finished cell; and the run's ``results.json``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sage.eval.sampling import SamplingSettings
from sage.metrics import pass_at_k_curve
from sage.paths import tmp_folder_for

RESULTS_FILE = "results.json"
BLOCK_SEQUENCES = 1024
"""Sequences (problems x samples) per block of a cell, the unit a multi-process evaluation shares out
(``sage.eval.evaluate.problem_blocks``): at the paper's 256 samples, 4 problems, so that AIME's 30 problems
still give each GPU of a node a block; and as many sequences as vLLM runs at once on an 80 GiB GPU, so
that a block fills the engine's batch."""
CELL_FORMAT = 2
"""How a cell's samples follow from its key; bumped whenever that changes, so that cells drawn the old way
are never mixed in. 1: one random stream per cell (the HF backend) or a seed per request (vLLM); 2: a
stream per block, seeded from (cell seed, block index); vLLM seeds the engine, not each request."""


@dataclass(frozen=True)
class CellKey:
    """Everything that changes the samples of a stored cell, recorded with it: the sampling settings and
    what they were applied to. ``template`` fingerprints the rendered prompt (system prompt, chat template,
    output tags); ``model`` the checkpoint's files (Checkpoint.fingerprint); ``blocks`` and ``format`` how
    the cell is cut into separately seeded blocks (BLOCK_SEQUENCES, CELL_FORMAT)."""

    settings: SamplingSettings
    template: str
    backend: str
    dtype: str
    model: str
    blocks: int = BLOCK_SEQUENCES
    format: int = CELL_FORMAT

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


def store_cell(
    cell: Path, key: CellKey, ids: list[str], correct: np.ndarray, completions: list[list[str]]
) -> None:
    """Written to a temporary folder of its own and renamed: a killed evaluation leaves no half-finished cell,
    and two writers (on a file system flock does not reach across) never write into one folder."""
    tmp = tmp_folder_for(cell)  # evaluate_model holds the cell's folder_lock
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
