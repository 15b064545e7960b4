"""Which problems moved between two rows of a report: pure functions of per-problem pass@k arrays.

Data: each training seed's per-problem unbiased pass@k (``sage.metrics.pass_at_k`` on the logged
correctness matrices, averaged over the run's evaluation seeds: ``analysis.bootstrap.per_problem_pass_at_k``),
for two rows paired by problem. Nothing is sampled.

- Lost (``lost``): a problem whose pass@k under the method is below ``threshold`` x the other row's, so a
  problem the other row solves at k (its pass@k > 0) and the method mostly does not; gained: the same with
  the rows swapped. Counted per seed pair (``seed_pairs``), then the mean over seed pairs with its t
  interval over them (``seed_mean``).
- Crossing (``crossing``): the smallest k at which the other row's mean pass@k over problems (k = 1..n) is
  at least the method's: where the start model catches up with a trained one. 1 when the method is not
  ahead at k = 1; None when it is ahead at every k up to n.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from analysis.bootstrap import Interval, t_interval

LOST_THRESHOLD = 0.5
ONE_SEED = "one seed: no interval"
_TIE = 1e-12  # two curves that reach the same value (both 1.0 at large k) by different sums are level


def lost(values: np.ndarray, ref_values: np.ndarray, threshold: float = LOST_THRESHOLD) -> np.ndarray:
    """Per problem (the last axis): the method's pass@k below ``threshold`` x the other row's. Strict, so
    a problem the other row never solves (pass@k 0) is never lost."""
    values, ref_values = np.asarray(values, dtype=float), np.asarray(ref_values, dtype=float)
    if values.shape != ref_values.shape:
        raise ValueError(f"not paired by problem: shapes {values.shape} and {ref_values.shape}")
    if not 0 < threshold <= 1:
        raise ValueError(f"the lost threshold must be in (0, 1], not {threshold}")
    return values < threshold * ref_values


def gained(values: np.ndarray, ref_values: np.ndarray, threshold: float = LOST_THRESHOLD) -> np.ndarray:
    """Per problem: the other row's pass@k below ``threshold`` x the method's (``lost``, rows swapped)."""
    return lost(ref_values, values, threshold)


def seed_pairs(seeds: Sequence[int], ref_seeds: Sequence[int]) -> list[tuple[int, int]]:
    """Indices (i, j) into the two rows' seeds that are compared: the same training seed on both sides; a
    side with one seed (the start model's one evaluation, or a row with one run) is paired with every seed
    of the other."""
    seeds, ref_seeds = list(seeds), list(ref_seeds)
    if len(ref_seeds) == 1:
        return [(i, 0) for i in range(len(seeds))]
    if len(seeds) == 1:
        return [(0, j) for j in range(len(ref_seeds))]
    return [(seeds.index(s), ref_seeds.index(s)) for s in sorted(set(seeds) & set(ref_seeds))]


def mean_curve(per_problem: np.ndarray) -> np.ndarray:
    """(..., problems, n) per-problem pass@k at k = 1..n -> (..., n): the pass@k curve, mean over
    problems."""
    return np.asarray(per_problem, dtype=float).mean(axis=-2)


def crossing(curve: Sequence[float], ref_curve: Sequence[float]) -> int | None:
    """The smallest k (curves at k = 1..n) at which ``ref_curve`` is at least ``curve``; None when
    ``curve`` stays above it up to k = n."""
    curve, ref_curve = np.asarray(curve, dtype=float), np.asarray(ref_curve, dtype=float)
    if curve.shape != ref_curve.shape or curve.ndim != 1 or len(curve) == 0:
        raise ValueError(f"two curves over the same k = 1..n, not shapes {curve.shape} and {ref_curve.shape}")
    caught = np.flatnonzero(ref_curve >= curve - _TIE)
    return int(caught[0]) + 1 if len(caught) else None


def seed_mean(values: Sequence[float], interval: bool = True) -> Interval:
    """The mean of one number per seed pair with its t interval over them (``analysis.bootstrap``'s, one
    variance part on pairs - 1 degrees of freedom); lo/hi NaN with one pair or ``interval=False``."""
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError(f"one value per seed pair, not shape {v.shape}")
    mean = float(v.mean())
    if len(v) < 2 or not interval:
        nan = math.nan
        return Interval(mean, nan, nan, nan, nan, nan, nan)
    return t_interval(mean, [float(v.var(ddof=1)) / len(v)], [len(v) - 1])


def _within(i: Interval, lo: float, hi: float) -> Interval:
    """``i`` with its bounds cut to the values the quantity can take (a count of 2 and 0 over two seed
    pairs has a t interval reaching below 0): what it excludes, it excluded before."""
    if not i.has_interval:
        return i
    return replace(i, lo=min(max(i.lo, lo), hi), hi=max(min(i.hi, hi), lo))


@dataclass(frozen=True)
class Moved:
    """One compared pair at one dataset: for each seed pair, which problems the method lost and gained at
    pass@k, and where the curves cross."""

    k: int
    n: int  # the curves' last k: the fewer samples per problem of the two rows
    seeds: list[tuple[int, int]]  # (method seed, other row's seed) of each pair
    lost: np.ndarray  # (pairs, problems) bool
    gained: np.ndarray  # (pairs, problems) bool
    crossings: list[int | None]  # per pair
    interval: bool  # whether the pairs measure the seed noise of each trained side

    @property
    def problems(self) -> int:
        return self.lost.shape[1]

    def count(self, which: str) -> Interval:
        """``lost`` or ``gained``: the problems per seed pair, mean with its interval (within 0 and the
        problems, where the count is)."""
        return _within(seed_mean(getattr(self, which).sum(axis=1), self.interval), 0, self.problems)

    def everywhere(self, which: str) -> np.ndarray:
        """Indices of the problems lost (or gained) in every seed pair."""
        return np.flatnonzero(getattr(self, which).all(axis=0))

    def share(self, which: str) -> np.ndarray:
        """Per problem: the fraction of seed pairs in which it was lost (or gained)."""
        return getattr(self, which).mean(axis=0)

    def count_text(self, which: str, digits: int = 1) -> str:
        i = self.count(which)
        if not i.has_interval:
            return f"{i.diff:.{digits}f} ({ONE_SEED})"
        return f"{i.diff:.{digits}f} [{i.lo:.{digits}f}, {i.hi:.{digits}f}]"

    def crossing_interval(self) -> Interval | None:
        """Mean crossing k with its interval over seed pairs; None unless every pair crosses."""
        if any(c is None for c in self.crossings):
            return None
        found = seed_mean([float(c) for c in self.crossings], self.interval)  # type: ignore[arg-type]
        return _within(found, 1, self.n)

    def crossing_text(self, digits: int = 1) -> str:
        none = f"no crossing up to k = {self.n}"
        if all(c is None for c in self.crossings):
            return none
        each = ", ".join("—" if c is None else str(c) for c in self.crossings)
        i = self.crossing_interval()
        if i is None:
            return f"per seed pair: {each} (—: {none})"
        if len(self.crossings) == 1:
            return f"{self.crossings[0]} ({ONE_SEED})"
        if not i.has_interval:
            return f"{i.diff:.{digits}f} ({ONE_SEED}; per seed pair: {each})"
        return f"{i.diff:.{digits}f} [{i.lo:.{digits}f}, {i.hi:.{digits}f}] (per seed pair: {each})"

    def summary(self) -> dict[str, object]:
        """The numbers of the pair, one line of ``moved.csv`` (``SUMMARY`` columns after row, reference,
        dataset and threshold); NaN where there is none."""
        out: dict[str, object] = {"k": self.k, "n": self.n, "problems": self.problems}
        out["seed_pairs"] = ";".join(f"{a}-{b}" for a, b in self.seeds)
        for which in ("lost", "gained"):
            i = self.count(which)
            out |= {which: i.diff, f"{which}_lo": i.lo, f"{which}_hi": i.hi}
        i = self.crossing_interval()
        nan = math.nan
        out |= (
            {"crossing": nan, "crossing_lo": nan, "crossing_hi": nan}
            if i is None
            else {"crossing": i.diff, "crossing_lo": i.lo, "crossing_hi": i.hi}
        )
        out["crossings"] = ";".join("none" if c is None else str(c) for c in self.crossings)
        out |= {"lost_text": self.count_text("lost"), "gained_text": self.count_text("gained")}
        out["crossing_text"] = self.crossing_text()
        return out


SUMMARY = [
    "row", "reference", "dataset", "threshold", "k", "n", "problems", "seed_pairs", "lost", "lost_lo",
    "lost_hi", "gained", "gained_lo", "gained_hi", "crossing", "crossing_lo", "crossing_hi", "crossings",
    "lost_text", "gained_text", "crossing_text",
]  # fmt: skip
"""The columns of ``moved.csv``: one line per compared pair and dataset (``crossings``: per seed pair,
``none`` where the curves do not cross up to k = n)."""


def compare(
    values: np.ndarray,
    ref_values: np.ndarray,
    curves: np.ndarray,
    ref_curves: np.ndarray,
    seeds: Sequence[int],
    ref_seeds: Sequence[int],
    *,
    k: int,
    threshold: float = LOST_THRESHOLD,
    ref_is_base: bool = False,
) -> Moved:
    """A method against another row: ``values`` / ``ref_values`` are (seeds, problems) per-problem pass@k
    at ``k``, ``curves`` / ``ref_curves`` (seeds, n) mean pass@k curves at k = 1..n (the same n), in the
    order of ``seeds`` / ``ref_seeds``. ``ref_is_base``: the other row is the start model, whose one
    evaluation has no training seed, so its one seed still gives the pairs an interval."""
    values, ref_values = np.asarray(values, dtype=float), np.asarray(ref_values, dtype=float)
    curves, ref_curves = np.asarray(curves, dtype=float), np.asarray(ref_curves, dtype=float)
    for name, a, s in (("values", values, seeds), ("curves", curves, seeds)):
        if a.ndim != 2 or len(a) != len(s):
            raise ValueError(f"{name}: one row per seed ({len(s)}), not shape {a.shape}")
    for name, a, s in (("ref_values", ref_values, ref_seeds), ("ref_curves", ref_curves, ref_seeds)):
        if a.ndim != 2 or len(a) != len(s):
            raise ValueError(f"{name}: one row per seed ({len(s)}), not shape {a.shape}")
    pairs = seed_pairs(seeds, ref_seeds)
    if not pairs:
        raise ValueError(f"no seed in common between seeds {list(seeds)} and {list(ref_seeds)}")
    i, j = (list(x) for x in zip(*pairs, strict=True))
    measured = len(set(i)) > 1 and (ref_is_base or len(set(j)) > 1)
    return Moved(
        k=k,
        n=curves.shape[1],
        seeds=[(int(seeds[a]), int(ref_seeds[b])) for a, b in pairs],
        lost=lost(values[i], ref_values[j], threshold),
        gained=gained(values[i], ref_values[j], threshold),
        crossings=[crossing(curves[a], ref_curves[b]) for a, b in pairs],
        interval=measured,
    )


# ------------------------------------------------------------------ per-problem labels and frames
_TESTBED_ROWS = "sage.testbed.task.heldout_rows"  # as the configs name it and runs log it (sage.data.arith)
_TESTBED_PROBLEM = re.compile(r"(\d+)\*(\d+)\+(\d+)=")  # sage.eval.analyses.TESTBED_PROBLEM (torch-free)


def _param(value: str) -> int | str | None:
    if value == "None":
        return None
    return int(value) if value.lstrip("-").isdigit() else value


def problem_labels(params: Mapping[str, str], dataset: str) -> tuple[list[str], list[str]] | str:
    """(ids, tiers) of the problems a run evaluated on ``dataset``, in the order of its correctness
    matrices, rebuilt from its logged params; or why not. Only the testbed's held-out problems are rebuilt
    (generated, no file or download; their tier is ``sage.data.arith.problem_tier``'s, in the run's
    world as the evaluation's analyses took it: the fork world's rule in the fork world, else the
    multiplier's); a benchmark's rows live in files or on the hub that sage-report does not open."""
    from sage.data.arith import heldout_rows, problem_tier

    prefix = f"eval.datasets.{dataset}."
    target = params.get(prefix + "_target_")
    if target != _TESTBED_ROWS:
        return f"{dataset} is not the testbed's ({target or 'no _target_ logged'})"
    kwargs = {
        key.removeprefix(prefix): _param(v)
        for key, v in params.items()
        if key.startswith(prefix) and key != prefix + "_target_"
    }
    try:
        rows = heldout_rows(**kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        return f"{dataset}'s rows cannot be rebuilt from its params ({e})"
    limit = _param(params.get("eval.limit", "None"))
    if isinstance(limit, int):
        rows = rows[:limit]
    world = "fork" if params.get("model.source.world") == "fork" else "graded"
    tiers = []
    for r in rows:
        m = _TESTBED_PROBLEM.fullmatch(r["problem"])
        if m is None:
            return f"{dataset}: row {r['id']!r} is not a testbed problem"
        tiers.append(problem_tier(world, int(m[1]), int(m[2])))
    return [str(r["id"]) for r in rows], tiers


def problems_frame(
    problems: int,
    passes: Mapping[str, tuple[np.ndarray, np.ndarray]],
    k: int,
    moved: Mapping[str, Moved] | None = None,
    ids: Sequence[str] | None = None,
    tiers: Sequence[str] | None = None,
) -> pd.DataFrame:
    """One line per problem: ``problem`` (its position in the evaluated dataset), ``id`` and ``tier``
    (empty where unknown), each row's ``<row> pass@1`` and ``<row> pass@<k>`` (mean over its seeds; from
    ``passes``: row -> (pass@1, pass@k) per problem), and for each compared pair (``moved``: name -> Moved)
    the fraction of its seed pairs in which the problem was lost, and gained."""
    frame = pd.DataFrame(
        {
            "problem": np.arange(problems),
            "id": list(ids) if ids is not None else [""] * problems,
            "tier": list(tiers) if tiers is not None else [""] * problems,
        }
    )
    for row, (p1, pk) in passes.items():
        for kk, v in ((1, p1), (k, pk)):
            v = np.asarray(v, dtype=float)
            if v.shape != (problems,):
                raise ValueError(f"{row}: pass@{kk} of {v.shape} problems, not ({problems},)")
            frame[f"{row} pass@{kk}"] = v
    for name, m in (moved or {}).items():
        if m.problems != problems:
            raise ValueError(f"{name}: {m.problems} problems, not {problems}")
        frame[f"{name} lost"] = m.share("lost")
        frame[f"{name} gained"] = m.share("gained")
    return frame
