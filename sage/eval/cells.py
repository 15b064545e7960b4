"""Result cells: one stored (checkpoint, dataset, seed) evaluation, keyed by everything that changes its
samples (the rows' content included) so that results made under other settings or on other problems are
never mixed in, written atomically so that a killed evaluation leaves no half-finished cell, and checked
against the digests of its files when read; and the run's ``results.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sage.durable import cell_file_digest, tmp_folder_for
from sage.eval.sampling import SamplingSettings
from sage.metrics import pass_at_k_curve

log = logging.getLogger(__name__)

RESULTS_FILE = "results.json"
CELL_FILES = ("correct.npy", "completions.json", "curve.json")
"""The files of a cell whose sha256 its meta.json records (``load_cell`` checks them)."""
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
    the cell is cut into separately seeded blocks (BLOCK_SEQUENCES, CELL_FORMAT); ``rows`` the problems as
    graded (``rows_digest``): a data file rewritten under the same ids makes other cells."""

    settings: SamplingSettings
    template: str
    backend: str
    dtype: str
    model: str
    rows: str
    blocks: int = BLOCK_SEQUENCES
    format: int = CELL_FORMAT

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def rows_digest(rows: list[dict]) -> str:
    """The rows of a cell as they are sampled and graded: each row's id, problem text (the prompt is the
    template, ``CellKey.template``, around it), gold answer and verifier."""
    from sage.data.verifiers import row_verifier

    graded = [[r["id"], r["problem"], r["answer"], row_verifier(r)] for r in rows]
    return hashlib.sha256(json.dumps(graded, default=str).encode()).hexdigest()[:16]


def cell_dir(results_dir: Path, key: CellKey) -> Path:
    return results_dir / f"{key.key()}_seed{key.settings.seed}"


def load_cell(cell: Path, key: CellKey, ids: list[str]) -> dict | None:
    """A finished cell made under exactly this key and these problems, else None. A cell whose files are
    unreadable or differ from the digests its meta.json records (cut short, edited, a bad copy) is set
    aside as ``<cell>.set-aside``, named in one logged line, and None is returned: it is sampled again.
    Call under the cell's folder_lock."""
    if not cell.is_dir():
        return None
    try:
        meta = json.loads((cell / "meta.json").read_text())
        if meta["key"] != asdict(key) or meta["ids"] != ids:
            return None  # a stale cell under the same folder name: store_cell replaces it
        return _checked_cell(cell, meta, len(ids), key.settings.n_samples)
    except _CellProblem as e:
        why = str(e)
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
        why = f"meta.json is unreadable ({type(e).__name__}: {e})"
    _set_aside_cell(cell, why)
    return None


class _CellProblem(Exception):
    """Why a stored cell's files cannot be trusted."""


def _checked_cell(cell: Path, meta: dict, n_problems: int, n_samples: int) -> dict:
    digests = meta.get("digests")
    if not isinstance(digests, dict):
        raise _CellProblem("meta.json records no digests of the cell's files")
    for name in CELL_FILES:
        try:
            actual = cell_file_digest(cell / name)
        except OSError as e:
            raise _CellProblem(f"{name} is unreadable ({e.strerror or e})") from None
        if actual != digests.get(name):
            raise _CellProblem(f"{name} differs from the digest meta.json records")
    try:
        correct = np.load(cell / "correct.npy", allow_pickle=False)
        completions = json.loads((cell / "completions.json").read_text())
    except (OSError, ValueError, EOFError) as e:
        raise _CellProblem(f"its files are unreadable ({type(e).__name__}: {e})") from None
    if correct.dtype != bool or correct.shape != (n_problems, n_samples):
        raise _CellProblem(
            f"correct.npy holds {correct.dtype} {correct.shape}, not bool {(n_problems, n_samples)}"
        )
    if len(completions) != n_problems or any(len(c) != n_samples for c in completions):
        raise _CellProblem(
            f"completions.json does not hold {n_samples} completions for each of {n_problems} rows"
        )
    return {"correct": correct, "completions": completions}


def _set_aside_cell(cell: Path, why: str) -> None:
    aside, n = cell.with_name(f"{cell.name}.set-aside"), 1
    while aside.exists():  # a cell set aside before under the same key: both are kept
        n += 1
        aside = cell.with_name(f"{cell.name}.set-aside.{n}")
    os.replace(cell, aside)
    log.warning(
        "evaluation cell %s cannot be used (%s): set aside as %s; it is sampled again", cell, why, aside.name
    )


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
        digests = {name: cell_file_digest(tmp / name) for name in CELL_FILES}
        (tmp / "meta.json").write_text(json.dumps({"key": asdict(key), "ids": ids, "digests": digests}))
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
