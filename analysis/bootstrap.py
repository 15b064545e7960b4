"""Intervals for differences between methods (over problems and training seeds), and bands of curves.

Data: for each run, the per-problem unbiased pass@k (``sage.metrics``, numpy only), averaged over the
run's evaluation seeds, from the correctness matrices its evaluation logged. A method's value is the mean
over problems, averaged over its training seeds; with one matrix per run this is exactly the logged
``pass_at_k`` metric, so an interval is always about the number the tables show.

Differences (``difference``): a t interval whose variance has two parts, each estimated where it can be.
A run's value is modelled as  mu_m + a_p + alpha_mp + b_ms + e_msp  (problem p, method m, training seed s):
a_p is shared by every method and cancels in a difference paired by problem; alpha_mp is how a method's
gain varies over problems; b_ms is the seed's effect on the whole run; e_msp the rest. Then

    Var(diff) = sigma_alpha^2 / P  +  (sigma_b^2 + sigma_e^2 / P) * (1/S_m + 1/S_ref)

- the seed part from the between-seed variance of the run means, POOLED over every trained row of the
  table (with Sum(S_m - 1) degrees of freedom) and the residual variance (sigma_e^2) likewise: with 2-5
  seeds, one method's own seeds estimate their variance too poorly (a bootstrap of 2-5 seeds understates
  it: its "95%" intervals covered a true null in 72-87% of simulated studies at 2-5 seeds). Pooling assumes
  the rows' seed noise is alike (the same recipe, other knobs);
- the problem part from the spread over problems of the seed-averaged per-problem difference, less the
  residual noise it holds;
- the degrees of freedom by Welch-Satterthwaite; seeds are not paired (a shared seed set would make the
  two sides' seed effects correlate; positive correlation only makes the interval conservative).

Its coverage is checked by simulation at 2, 3 and 5 seeds (tests/test_bootstrap.py). A side with one
training seed gets no interval (nothing measures its seed noise); the start model (``base``) has no
training seed, so its one evaluation is enough. Each interval carries its two-sided p-value, for Holm's
correction over a table's family of comparisons (``holm``), and the smallest difference it would detect
with 80% power (two-sided 5%).

Curve bands (``mean_band``) resample problems and seeds (a bootstrap, B draws, fixed RNG seed): a
description of the curve's uncertainty, not a test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from sage.metrics import pass_at_k

LEVEL, POWER = 0.95, 0.80


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
class SeedNoise:
    """The seed noise of a table's trained rows at one (dataset, k), pooled over the rows with 2+ seeds."""

    run_var: float  # between training seeds, of a run's mean over problems (sigma_b^2 + sigma_e^2 / P)
    resid_var: float  # of one (seed, problem) value, beyond its problem's and its seed's effects (sigma_e^2)
    df: int  # of run_var: Sum(seeds - 1)


def seed_noise(rows: Sequence[np.ndarray]) -> SeedNoise | None:
    """Pooled from the (seeds, problems) arrays of trained rows (rows with one seed add nothing); None when
    no row has two seeds."""
    run_ss = res_ss = 0.0
    run_df = res_df = 0
    for v in rows:
        v = np.asarray(v, dtype=float)
        seeds, problems = v.shape
        if seeds < 2:
            continue
        means = v.mean(axis=1)
        run_ss += float(((means - means.mean()) ** 2).sum())
        run_df += seeds - 1
        resid = v - v.mean(axis=1, keepdims=True) - v.mean(axis=0, keepdims=True) + v.mean()
        res_ss += float((resid**2).sum())
        res_df += (seeds - 1) * (problems - 1)
    if run_df == 0:
        return None
    return SeedNoise(run_ss / run_df, res_ss / res_df if res_df else 0.0, run_df)


@dataclass(frozen=True)
class Interval:
    """Mean difference (method minus reference), its t interval, p-value and 80%-power detectable
    difference; ``lo``/``hi``/``p``/``mde`` are NaN when a trained side has one seed (no interval)."""

    diff: float
    lo: float
    hi: float
    se: float
    df: float
    p: float
    mde: float

    @property
    def has_interval(self) -> bool:
        return not math.isnan(self.lo)

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    @property
    def marked(self) -> bool:
        return self.has_interval and self.excludes_zero


def difference(
    values: np.ndarray,
    ref_values: np.ndarray,
    noise: SeedNoise | None,
    *,
    ref_is_base: bool = False,
    level: float = LEVEL,
) -> Interval:
    """mean(values) - mean(ref_values), both (seeds, problems) arrays over the same problems in the same
    order, with the interval of the module docstring; ``noise``: the table's pooled seed noise
    (``seed_noise``). ``ref_is_base``: the reference is the start model, which has no training seed."""
    values, ref_values = np.asarray(values, dtype=float), np.asarray(ref_values, dtype=float)
    if values.ndim != 2 or ref_values.ndim != 2 or values.shape[1] != ref_values.shape[1]:
        raise ValueError(f"not paired by problem: shapes {values.shape} and {ref_values.shape}")
    diff = float(values.mean() - ref_values.mean())
    none = Interval(diff, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    if len(values) < 2 or (len(ref_values) < 2 and not ref_is_base) or noise is None:
        return none
    inv = 1 / len(values) + (0.0 if ref_is_base else 1 / len(ref_values))
    per_problem = values.mean(axis=0) - ref_values.mean(axis=0)
    problems = len(per_problem)
    seed_part = noise.run_var * inv
    spread = float(per_problem.var(ddof=1)) if problems > 1 else 0.0
    problem_part = max(0.0, spread - noise.resid_var * inv) / problems
    var = seed_part + problem_part
    if var == 0.0:  # no noise at all: the difference is what it is
        return Interval(diff, diff, diff, 0.0, math.inf, 1.0 if diff == 0 else 0.0, 0.0)
    denom = seed_part**2 / noise.df + (problem_part**2 / (problems - 1) if problems > 1 else 0.0)
    df = var**2 / denom if denom > 0 else math.inf
    se = math.sqrt(var)
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    p = float(2 * stats.t.sf(abs(diff) / se, df))
    mde = float(stats.t.ppf(0.5 + level / 2, df) + stats.t.ppf(POWER, df)) * se
    return Interval(diff, diff - half, diff + half, se, df, p, mde)


def holm(p_values: Sequence[float], alpha: float = 1 - LEVEL) -> list[bool]:
    """Which of a family's hypotheses Holm's step-down procedure rejects at family-wise level ``alpha``
    (NaN p-values: comparisons without an interval, not part of the family)."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    rejected = [False] * len(p_values)
    for rank, (p, i) in enumerate(tested):
        if p > alpha / (len(tested) - rank):
            break
        rejected[i] = True
    return rejected


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
