"""Per-problem pass@k of every source from the correctness matrices its evaluation logged: the data of the
report's intervals, its 'Which problems moved' section and its curves' bands, checked against the logged
pass@k the tables show."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import bootstrap, load
from analysis.selection import SOURCES
from sage.metrics import metric_name


class ProblemValues:
    """Per-problem pass@k of every source, from the correctness matrices its evaluation logged: the data
    of the bootstrap intervals. Loaded once per (source, dataset); pass@k computed once per k."""

    def __init__(self, client, src: pd.DataFrame, datasets: Sequence[str], asked: Sequence[int], tmp: Path):
        self.notes: list[str] = []
        self.mats: dict[tuple[str, str], dict[int, list[np.ndarray]]] = {}
        self.ids: dict[str, set[tuple[str, ...] | None]] = {}  # per dataset: every source's problem ids
        self.row_ids: dict[tuple[str, str], dict[int, tuple[str, ...] | None]] = {}  # per (row, ds), by seed
        self.compared_on: dict[tuple[str, str, str], str] = {}  # (row, other row, ds) -> its note
        self._cache: dict[tuple[str, str, int, int], np.ndarray] = {}
        for row, seed, run_id, label in src[src["seed"].isin(asked)][SOURCES].itertuples(index=False):
            for ds in datasets:
                m = load.correctness(client, run_id, label, ds, tmp)
                if m is None:
                    self.notes.append(
                        f"intervals: {row} seed {seed} (run {run_id}) logged no correctness matrices for "
                        f"{label}/{ds} ({label}_{ds}_correct.npz): that seed is left out of the intervals, "
                        "and its pass@k in the tables, its logged metrics, is checked against nothing"
                    )
                    continue
                self.mats.setdefault((row, ds), {})[int(seed)] = m
                ids = load.problem_ids(client, run_id, label, ds, tmp)
                self.ids.setdefault(ds, set()).add(tuple(ids) if ids is not None else None)
                self.row_ids.setdefault((row, ds), {})[int(seed)] = tuple(ids) if ids is not None else None

    def common(self, row: str, other: str, ds: str) -> tuple[np.ndarray, np.ndarray, list[str]] | str | None:
        """How two rows' problems pair: None by position (the same problem ids, or ids some seed did not
        log); when every seed of each row logged one list of ids and the lists differ, the positions in
        each row of the problems both evaluated and their ids (in ``other``'s order), noted once in
        ``compared_on``; or why none pair."""
        lists = [set(self.row_ids.get((r, ds), {}).values()) for r in (row, other)]
        if any(len(listed) != 1 or None in listed for listed in lists):
            return None
        mine, theirs = (next(iter(listed)) for listed in lists)
        if mine == theirs:
            return None
        where, their_where = {p: i for i, p in enumerate(mine)}, {p: i for i, p in enumerate(theirs)}
        both = [p for p in their_where if p in where]
        if not both:
            return f"no problem in common ({len(mine)} and {len(theirs)} evaluated)"
        self.compared_on[(row, other, ds)] = (
            f"{row} vs {other} on {ds}: the rows evaluated different problems ({len(mine)} and "
            f"{len(theirs)}, {len(both)} in common): only the {len(both)} both evaluated are compared"
        )
        return np.array([where[p] for p in both]), np.array([their_where[p] for p in both]), both

    def paired(self, row: str, other: str, ds: str) -> tuple[tuple[int, int], tuple[int, int], object] | str:
        """Each row's (problems, samples) and how their problems pair (``common``), or why they do not."""
        shapes = (self.shape(row, ds), self.shape(other, ds))
        why = next(
            (f"{r}: {s}" for r, s in zip((row, other), shapes, strict=True) if isinstance(s, str)), None
        )
        if why is not None:
            return why
        common = self.common(row, other, ds)
        if isinstance(common, str):
            return common
        if common is None and shapes[0][0] != shapes[1][0]:
            return f"not paired by problem: {shapes[0][0]} vs {shapes[1][0]} problems"
        return shapes[0], shapes[1], common

    def shape(self, row: str, ds: str) -> tuple[int, int] | str:
        """(problems, samples) shared by every seed of a row, else why not."""
        shapes = {m[0].shape for m in self.mats.get((row, ds), {}).values()}
        if not shapes:
            return "no correctness matrices"
        if len(shapes) > 1:
            return f"seeds evaluated different (problems, samples): {sorted(shapes)}"
        return shapes.pop()

    def values(self, row: str, ds: str, ks: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        """(seeds, problems, len(ks)) per-problem pass@k and the seeds, for a row whose ``shape`` is a
        shape with samples >= max(ks)."""
        seeds = sorted(self.mats[(row, ds)])
        per_seed = [self.of_seed(row, ds, s, ks) for s in seeds]
        return np.stack(per_seed), seeds

    def of_seed(self, row: str, ds: str, seed: int, ks: Sequence[int]) -> np.ndarray:
        """(problems, len(ks)) per-problem pass@k of one seed's evaluation (k <= its samples)."""
        todo = [k for k in ks if (row, ds, seed, k) not in self._cache]
        if todo:
            computed = bootstrap.per_problem_pass_at_k(self.mats[(row, ds)][seed], todo)
            for k, v in zip(todo, computed, strict=True):
                self._cache[(row, ds, seed, k)] = v
        return np.stack([self._cache[(row, ds, seed, k)] for k in ks], axis=-1)


# how far a logged pass@k may be from its matrices' mean: the same sums in another order differ by ~1e-16
AGREEMENT = 1e-9


def disagreement(pv: ProblemValues, meas: pd.DataFrame) -> str | None:
    """The tables' pass@k (each source's logged metrics, ``meas``) against the correctness matrices its
    evaluation logged beside them, which the differences and 'Which problems moved' read: one line naming
    the first run and metric that disagrees beyond rounding (and how many more do), or None. Sources that
    logged no matrices are not checked (``ProblemValues`` notes them)."""
    wrong = []
    for row, seed, run_id, label, ds, k, value in meas.itertuples(index=False):
        seed = int(seed)
        mats = pv.mats.get((row, ds), {}).get(seed)
        if mats is None or value != value:  # no matrices, or no value (NaN): nothing shown contradicts
            continue
        n = mats[0].shape[1]
        key = metric_name(label, ds, f"pass@{k}")
        if k > n:
            wrong.append(f"run {run_id} ({row}, seed {seed}) logged {key}, but its matrices hold {n} samples")
            continue
        derived = float(pv.of_seed(row, ds, seed, [k]).mean())
        if not abs(derived - value) <= AGREEMENT:  # a NaN disagrees too
            wrong.append(
                f"run {run_id} ({row}, seed {seed}): its logged {key} is {value:.6g}, its correctness "
                f"matrices ({label}_{ds}_correct.npz) give {derived:.6g}"
            )
    if not wrong:
        return None
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return (
        f"{wrong[0]}{more}: the tables' pass@k and the differences would disagree; re-evaluate the run "
        "(sage-eval) or leave it out (--filter, --seeds)"
    )
