"""Paired bootstrap intervals for differences between methods, over problems and training seeds.

Data: for each run, the per-problem unbiased pass@k (``sage.metrics``, numpy only), averaged over the
run's evaluation seeds, from the correctness matrices its evaluation logged. A method's value is the mean
over problems, averaged over its training seeds; with one matrix per run this is exactly the logged
``pass_at_k`` metric, so an interval is always about the number the tables show.

Resampling, B times (a fixed RNG seed, so a report is reproducible):

- problems with replacement, the SAME problem indices for both methods (paired by problem: both evaluated
  the same held-out problems, and problem difficulty is the largest source of variance, shared by both);
- training seeds with replacement. When both methods ran the same seed set (a grid: ``seed=1,2,3`` for every
  method) the same seed indices are drawn for both (paired by seed: seed s fixes the same data order and
  evaluation draws for both methods). Otherwise each method's seeds are drawn independently.

Each draw gives the difference of the two means; the interval is its 2.5 / 97.5 percentiles. A difference
is marked (``*``) only when its interval excludes 0 AND seed noise was resampled on every trained side: with
one training seed, an interval covers problem noise only, and a difference that seed noise could explain
is never presented as a result. The start model (``base``) has no training seed, so one base seed is enough.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sage.metrics import pass_at_k

LEVEL = 0.95


def per_problem_pass_at_k(correct_by_eval_seed: Sequence[np.ndarray], ks: Sequence[int]) -> np.ndarray:
    """(len(ks), problems): unbiased pass@k of each problem, averaged over the evaluation seeds' boolean
    (problems x samples) matrices (which must all have the same shape)."""
    mats = [np.asarray(m, dtype=bool) for m in correct_by_eval_seed]
    if not mats:
        raise ValueError("no correctness matrix")
    shapes = {m.shape for m in mats}
    if len(shapes) != 1 or mats[0].ndim != 2 or 0 in mats[0].shape:
        raise ValueError(f"matrices must share one non-empty (problems x samples) shape, not {shapes}")
    n = mats[0].shape[1]
    k = np.asarray(ks, dtype=np.int64)[:, None]
    return np.mean([pass_at_k(n, m.sum(axis=1)[None, :], k) for m in mats], axis=0)


def _counts(rng: np.random.Generator, n: int, draws: int) -> np.ndarray:
    """(draws, n): how often each of n items is drawn in n draws with replacement, per bootstrap draw."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=draws).astype(np.float64)


def _means(values: np.ndarray, seed_w: np.ndarray, problem_w: np.ndarray) -> np.ndarray:
    """Bootstrap means (draws[, k]) of (seeds, problems[, k]) values under per-draw seed and problem
    counts."""
    s, p = values.shape[:2]
    return np.einsum("bs,sp...,bp->b...", seed_w, values, problem_w, optimize=True) / (s * p)


@dataclass(frozen=True)
class Interval:
    """Mean difference (method minus reference) and its bootstrap interval."""

    diff: float
    lo: float
    hi: float
    paired_by_seed: bool
    seeds_resampled: bool  # False: a trained side had one seed, the interval covers problem noise only

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    @property
    def marked(self) -> bool:
        return self.excludes_zero and self.seeds_resampled


def paired_difference(
    values: np.ndarray,
    seeds: Sequence[int],
    ref_values: np.ndarray,
    ref_seeds: Sequence[int],
    *,
    draws: int = 2000,
    rng_seed: int = 0,
    level: float = LEVEL,
    ref_is_base: bool = False,
) -> Interval:
    """Bootstrap interval of mean(values) - mean(ref_values), both (seeds, problems) arrays over the same
    problems in the same order (see the module docstring). ``ref_is_base``: the reference is the start
    model, which has no training seed noise to measure."""
    values, ref_values = np.asarray(values, dtype=float), np.asarray(ref_values, dtype=float)
    if values.ndim != 2 or ref_values.ndim != 2 or values.shape[1] != ref_values.shape[1]:
        raise ValueError(f"not paired by problem: shapes {values.shape} and {ref_values.shape}")
    if len(seeds) != len(values) or len(ref_seeds) != len(ref_values):
        raise ValueError("one seed per row of values")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    order, ref_order = np.argsort(seeds), np.argsort(ref_seeds)
    values, ref_values = values[order], ref_values[ref_order]
    paired = sorted(seeds) == sorted(ref_seeds)
    rng = np.random.default_rng(rng_seed)
    problem_w = _counts(rng, values.shape[1], draws)
    seed_w = _counts(rng, len(values), draws)
    ref_w = seed_w if paired else _counts(rng, len(ref_values), draws)
    diffs = _means(values, seed_w, problem_w) - _means(ref_values, ref_w, problem_w)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(diffs, [tail, 100 - tail])
    resampled = len(values) > 1 and (len(ref_values) > 1 or ref_is_base)
    diff = float(values.mean() - ref_values.mean())
    return Interval(diff, float(lo), float(hi), paired, resampled)


def mean_band(
    values: np.ndarray, *, draws: int = 2000, rng_seed: int = 0, level: float = LEVEL
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and bootstrap interval (over problems and seeds) of a (seeds, problems, k) array, per k:
    the band of a pass@k curve."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(rng_seed)
    problem_w = _counts(rng, values.shape[1], draws)
    seed_w = _counts(rng, values.shape[0], draws)
    means = _means(values, seed_w, problem_w)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail], axis=0)
    return values.mean(axis=(0, 1)), lo, hi


def band_ks(n: int, points: int = 24) -> list[int]:
    """k at which a curve's band is computed: 1, n and about ``points`` values evenly spaced on a log
    axis (the figure's axis), so the band is as smooth as the curve without n bootstraps."""
    return sorted({1, n, *np.unique(np.round(np.geomspace(1, n, points)).astype(int)).tolist()})
