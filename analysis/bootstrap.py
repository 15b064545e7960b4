"""Intervals for differences between methods (over problems and training seeds), and bands of curves.

Data: for each run, the per-problem unbiased pass@k (``sage.metrics``, numpy only), averaged over the
run's evaluation seeds, from the correctness matrices its evaluation logged. A method's value is the mean
over problems, averaged over its training seeds; with one matrix per run this is exactly the logged
``pass_at_k`` metric, so an interval is always about the number the tables show.

Differences (``difference``): a t interval whose variance has two parts, each estimated where it can be.
A run's value is modelled as  mu_m + a_p + alpha_mp + b_ms + e_msp  (problem p, method m, training seed s):
a_p is shared by every method and cancels in a difference paired by problem; alpha_mp is how a method's
gain varies over problems; b_ms is the seed's effect on the whole run; e_msp the rest. The seed noise
(sigma_b,m and sigma_e,m) is each method's own: rows of one table need not share it (GRPO w/o KL's seed
variance was 3.7x the others' at tail pass@1, and pooling it over the table's rows let a "95%" interval
cover a true null in 82-90% of simulated studies with one row at twice the others' seed SD). Then

    Var(diff) = sigma_alpha^2 / P  +  v_m / S_m  +  v_ref / S_ref,    v_m = sigma_b,m^2 + sigma_e,m^2 / P

- each side's seed part from the between-seed variance of ITS OWN run means (``seed_noise``, S_m - 1
  degrees of freedom): the pair's two rows only, never the rest of the table;
- the problem part from the spread over problems of the seed-averaged per-problem difference, less the
  residual noise it holds (each side's sigma_e,m^2 / S_m, estimated from its own residuals);
- the critical value: the seed part is on the fewer of the two sides' seeds (Hsu's conservative choice;
  ``seed_df`` of them, below: the figures of this paragraph are for S - 1 df), the problem part on P - 1,
  and the interval's t quantile is the two parts' t quantiles weighted by the parts (Cochran and Cox).
  Welch-Satterthwaite's degrees of freedom are too
  optimistic at 2-3 seeds when one side's seed noise dominates (they are largest exactly when that
  side's variance came out too small): 92-93% coverage with a 4x row at 2 seeds. The price, in the
  test's simulated regimes: median widths 4-8% above Welch-Satterthwaite's at 8 seeds, 7-17% at 5,
  1.2-1.5x at 3 and 1.5-2.7x at 2. Seeds are not paired here
  (a shared seed set makes the two sides' seed effects correlate; positive correlation only makes the
  interval conservative). With 2 seeds the seed part has 1 degree of freedom, so its intervals are wide:
  that is what two seeds measure; pairing them (below) is what a shared seed set buys.

Its coverage is checked by simulation at 2, 3, 5 and 8 seeds, with rows at 1x, 2x and 4x seed SD and seeds
shared across rows (tests/test_bootstrap.py). A side with one training seed gets no interval (nothing
measures its seed noise); the start model (``base``) has no training seed, so its one evaluation is enough
(its sampling noise stays in the problem part). Each interval carries its two-sided p-value, for Holm's
correction over a table's family of comparisons (``holm``), and the smallest difference it would detect
with 80% power (two-sided 5%).

Paired by training seed (``difference(..., paired=True)``): rows of one study share their training seeds
(seed s of GRPO and seed s of Branch share the data order and the other draws the seed makes), so their
run means move together (correlation 0.90 measured between rows of the study). The unpaired interval adds
the two rows' seed variances where only the variance of their difference counts, and is ~2.8x as wide as
the paired one there. Paired, row i of both arrays is the same training seed, and the analysis is of the
one (seeds, problems) array of differences

    z_sp = values[s, p] - ref_values[s, p] = delta + g_p + c_s + u_sp,

g_p = alpha_mp - alpha_ref,p (the gain's variation over problems), c_s = b_ms - b_ref,s (the seed's effect
on the difference: whatever the two rows share of it cancels) and u_sp = e_msp - e_ref,sp (the rest,
however correlated the two rows' e are). The difference is mean(z), and

    Var(diff) = sigma_g^2 / P  +  sigma_c^2 / S  +  sigma_u^2 / (S P)

- the seed part, sigma_c^2 / S + sigma_u^2 / (S P): the between-seed variance of the per-seed differences
  of run means  d_s = mean_p z_sp  (its expectation is sigma_c^2 + sigma_u^2 / P), over S, on S - 1
  degrees of freedom (its critical value on ``seed_df(S)``, below).
  One variance of one set of S numbers: there is no second side whose noise differs
  (the Behrens-Fisher problem above), so it needs neither Hsu's nor Welch's degrees of freedom, and
  unequal seed noise of the two rows is simply part of sigma_c;
- the problem part, sigma_g^2 / P: the seed-averaged per-problem differences mean_s z_sp have variance
  sigma_g^2 + sigma_u^2 / S over problems, so their spread less resid / S, over P, with resid the residual
  variance of z itself (``seed_noise(z).resid_var``, (S - 1)(P - 1) df: z less its seed and problem means),
  which estimates sigma_u^2 whether or not the two rows' e correlate (the unpaired sum of each side's
  residual variance over-subtracts when they correlate positively), floored at 0, on P - 1 degrees of
  freedom;
- the two parts combined by Cochran and Cox's critical value (``t_interval``), as unpaired. At 2 seeds
  (1 df) it covers less than 95% when the problem part is a few percent of the seed part: the seed part's
  estimate is often near 0, and the critical value then falls towards the problem part's z before the
  standard error has grown (93.9% at its worst, a problem part 2.5% of the seed part, integrating over the
  chi-square; 95.0% from 3 seeds on; simulated, 93.6-94.2% in the worst 2-seed cells). The unpaired
  interval, with two seed variances and Hsu's df, covered 97.4-98.9% in the three such cells simulated.

Both arrays must have the same seeds in the same order (the caller knows the seed ids; here only the counts
can be checked, and unequal counts are refused). With the start model as the reference there is no seed to
pair with: refused. Coverage is checked by simulation at 2, 3, 5 and 8 seeds, the two rows' seed effects
correlated at 0, 0.5, 0.9 and 0.95 and the method's seed SD 1x, 2x and 4x the reference's
(tests/test_bootstrap.py).

Skewed seed effects (issue 58): both intervals put their seed part on ``seed_df(S)`` = (S + 2) / 4 degrees of
freedom, not S - 1 (equal at 2 seeds, below it from 3). A training seed's effect on a run need not be normal:
a seed that breaks out (or collapses) makes it right-skewed, and a t interval of the mean of S skewed values
under-covers on one side (the samples that missed the rare large value have a small mean AND a small
variance). With exponential seed effects (skewness 2) the t interval on S - 1 df covers 88% at 4 seeds and 90%
at 8. Simulated with binomial counts from one shared evaluation stream, 100 problems, seed effects dominating
the run means (as in the fork and dose studies' rare share), exponential or lognormal, the method's seed SD
1-4x the reference's (tests/test_bootstrap.py's SKEWED cases, 10,000 studies each, binomial SD <= .0034): on
S-1 df the paired interval covered 0.871-0.968 and the unpaired one 0.909-0.987 at 4 and 8 seeds; on
``seed_df``, 0.944-0.996 and 0.966-0.999 (t3 seed effects 0.992-0.999, normal 0.991-0.998). The degrees of
freedom ``seed_df`` are those at which the t interval covers 95% of the mean of S exponential values with
nothing else in the variance (fitted to the simulated quantile: 95.0-95.6% at 3-24 seeds, 400,000 samples
each; checked in tests/test_bootstrap.py): the interval holds, at any share of problem and sampling noise, for
seed effects of a difference as skewed as an exponential. The least margin: lognormal(0, 1) effects (skewness
6.2) of a 4x row shared at .9, 0.944 paired at 8 seeds. The price is width: the seed part's quantile is 1.87x
that on S - 1 df at 3 seeds (8.03 against 4.30), 1.89x at 4 (6.02 against 3.18), 1.51x at 8 (3.57 against
2.36), 1.25x at 16; at 2 seeds it is the same 1 df, which covers ~90% of the mean of 2 exponential values (95%
would take 0.8 df, a quantile of 23.5). Rejected: a studentized bootstrap over seeds (0.71-0.95 for the mean
of 4-8 skewed or normal values, 0.93 at 4 normal ones: 4-8 seeds give too few distinct resamples), BCa (a
percentile method, too narrow at few seeds), and a sign-flip permutation of the per-seed differences (exact
only when they are symmetric, as the skewed case is not; at 4 seeds its smallest two-sided p-value is 1/8, so
it gives no 95% interval). Symmetric heavy tails (t with 3 df) need no correction (0.96-0.99 on S - 1 df).

A seed variance is never taken as 0 (issue 58: at 2 seeds a row whose two seeds scored alike had seed
variance 0 and a falsely narrow interval): the between-seed variance of run means is floored at the
sampling variance a run mean holds, resid_var / P (the residual variance of the (seed, problem) values,
estimated on (S - 1)(P - 1) degrees of freedom, over the problems): a run mean varies between seeds by at
least its own sampling noise, whatever the seeds' effects. The floor applies to each side's run_var
(unpaired) and to the per-seed differences' (paired).

``METHOD`` names the interval in one line; every report and scripts/positive_control.py print it.

Curve bands (``mean_band``) resample problems and seeds (a bootstrap, B draws, fixed RNG seed): a
description of the curve's uncertainty, not a test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from sage.metrics import pass_at_k

LEVEL, POWER = 0.95, 0.80
METHOD = (
    "intervals: t over problems and training seeds, Cochran-Cox critical value, the seed part on "
    "(S + 2) / 4 df (holds under exponential-skewed seed effects), seed variance floored at its sampling "
    "part (analysis/bootstrap.py)"
)


def seed_df(seeds: int) -> float:
    """Degrees of freedom of a seed part estimated from ``seeds`` (>= 2) training seeds: (S + 2) / 4, those at
    which a t interval covers 95% of the mean of S exponential values (module docstring)."""
    return (seeds + 2) / 4


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
    """The seed noise of one trained row at one (dataset, k), from its own seeds."""

    run_var: float  # between training seeds, of a run's mean over problems (sigma_b^2 + sigma_e^2 / P)
    resid_var: float  # of one (seed, problem) value, beyond its problem's and its seed's effects (sigma_e^2)
    df: int  # of run_var: seeds - 1


def seed_noise(values: np.ndarray) -> SeedNoise | None:
    """From a row's (seeds, problems) array; None when it has one seed (nothing measures its noise)."""
    v = np.asarray(values, dtype=float)
    if v.ndim != 2:
        raise ValueError(f"seed_noise takes a (seeds, problems) array, not shape {v.shape}")
    seeds, problems = v.shape
    if seeds < 2:
        return None
    means = v.mean(axis=1)
    run_var = float(((means - means.mean()) ** 2).sum()) / (seeds - 1)
    resid = v - v.mean(axis=1, keepdims=True) - v.mean(axis=0, keepdims=True) + v.mean()
    res_df = (seeds - 1) * (problems - 1)
    return SeedNoise(run_var, float((resid**2).sum()) / res_df if res_df else 0.0, seeds - 1)


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
    *,
    ref_is_base: bool = False,
    level: float = LEVEL,
    paired: bool = False,
) -> Interval:
    """mean(values) - mean(ref_values), both (seeds, problems) arrays over the same problems in the same
    order, with the per-pair interval of the module docstring (each side's seed noise from its own
    seeds). ``ref_is_base``: the reference is the start model, which has no training seed. ``paired``: row
    i of both arrays is the same training seed, and the interval is the paired one of the module docstring
    (the seed noise of the per-seed differences)."""
    values, ref_values = np.asarray(values, dtype=float), np.asarray(ref_values, dtype=float)
    if values.ndim != 2 or ref_values.ndim != 2 or values.shape[1] != ref_values.shape[1]:
        raise ValueError(f"not paired by problem: shapes {values.shape} and {ref_values.shape}")
    if paired and ref_is_base:
        raise ValueError("paired by seed with ref_is_base: the start model has no training seed to pair")
    if paired and len(values) != len(ref_values):
        raise ValueError(f"not paired by seed: {len(values)} seeds and {len(ref_values)} reference seeds")
    diff = float(values.mean() - ref_values.mean())
    none = Interval(diff, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    if paired:
        return _paired(diff, values - ref_values, none, level)
    sides = [seed_noise(values)] + ([] if ref_is_base else [seed_noise(ref_values)])
    if any(n is None for n in sides):
        return none
    counts = [len(values), len(ref_values)]
    problems = values.shape[1]
    seed_part = sum(_floored(n, problems) / s for n, s in zip(sides, counts, strict=False))
    resid = sum(n.resid_var / s for n, s in zip(sides, counts, strict=False))
    per_problem = values.mean(axis=0) - ref_values.mean(axis=0)
    spread = float(per_problem.var(ddof=1)) if problems > 1 else 0.0
    problem_part = max(0.0, spread - resid) / problems
    # the seed part on the fewer of the two sides' seeds (Hsu's conservative choice), the parts' quantiles
    # combined by Cochran and Cox: Welch-Satterthwaite, on the halves or on these two parts, covered a true
    # null in 92-93% of simulated studies with a 4x row at 2 seeds (the df estimate is largest exactly when a
    # seed variance came out too small)
    df = seed_df(min(n.df for n in sides) + 1)
    return t_interval(diff, [seed_part, problem_part], [df, problems - 1], level=level)


def _floored(noise: SeedNoise, problems: int) -> float:
    """A run mean's between-seed variance, at least the sampling variance it holds (module docstring)."""
    return max(noise.run_var, noise.resid_var / problems)


def _paired(diff: float, z: np.ndarray, none: Interval, level: float) -> Interval:
    """The paired interval of ``diff`` from the (seeds, problems) differences ``z`` (module docstring)."""
    noise = seed_noise(z)
    if noise is None:  # one seed pair: nothing measures the seed noise of the difference
        return none
    seeds, problems = z.shape
    per_problem = z.mean(axis=0)
    spread = float(per_problem.var(ddof=1)) if problems > 1 else 0.0
    problem_part = max(0.0, spread - noise.resid_var / seeds) / problems
    seed_part = _floored(noise, problems) / seeds
    return t_interval(diff, [seed_part, problem_part], [seed_df(seeds), problems - 1], level=level)


def t_interval(
    diff: float, parts: Sequence[float], dfs: Sequence[float], *, level: float = LEVEL
) -> Interval:
    """The interval of ``diff`` whose variance is the sum of independent ``parts``, each estimated on its
    ``dfs`` degrees of freedom: Cochran and Cox's critical value, the parts' t quantiles weighted by the
    parts (``critical``); the p-value is the level at which it equals |diff| / se, the detectable
    difference the critical value plus the weighted 80% quantile, times se. ``df`` is the effective degrees
    of freedom: the t whose quantile is the interval's critical value. A part on 0 df must be 0."""
    if len(parts) != len(dfs):
        raise ValueError(f"{len(parts)} variance parts but {len(dfs)} degrees of freedom")
    if any(v < 0 or (v > 0 and d <= 0) for v, d in zip(parts, dfs, strict=True)):
        raise ValueError(f"variance parts must be >= 0, and 0 on no degrees of freedom: {parts}, dfs {dfs}")
    var = float(sum(parts))
    if var == 0.0:  # no noise at all: the difference is what it is
        return Interval(diff, diff, diff, 0.0, math.inf, 1.0 if diff == 0 else 0.0, 0.0)
    se = math.sqrt(var)
    crit = critical(parts, dfs, 1 - level)
    t = abs(diff) / se
    if t == 0:
        p = 1.0
    elif critical(parts, dfs, _TINY) < t:
        p = 0.0  # below 1e-100: reported as 0
    else:  # critical() falls as the level rises: one root in log(level)
        p = math.exp(optimize.brentq(lambda la: critical(parts, dfs, math.exp(la)) - t, math.log(_TINY), 0.0))
    mde = (crit + critical(parts, dfs, 2 * (1 - POWER))) * se
    z = float(special.ndtri(0.5 + level / 2))
    df = float(special.stdtridf(0.5 + level / 2, crit)) if crit > z else math.inf
    return Interval(diff, diff - crit * se, diff + crit * se, se, df, p, mde)


_TINY = 1e-100  # the smallest p-value searched: scipy's t quantile is exact there for any df (at 1e-300
# it returns +inf on some)


def critical(parts: Sequence[float], dfs: Sequence[float], alpha: float) -> float:
    """Cochran and Cox's two-sided critical value at level ``alpha``: each part's t quantile
    (1 - alpha / 2, on its degrees of freedom) weighted by the part. Conservative where Welch-Satterthwaite
    is not: with 2-3 seeds that df estimate is largest exactly when a seed variance came out too small."""
    # the lower quantile at alpha / 2, negated: exact down to tiny alpha, where 1 - alpha / 2 rounds to 1;
    # scipy.special's, the numbers of scipy.stats.t without its per-call overhead (the p-value's root
    # search and the coverage test call this often)
    pairs = [(v, d) for v, d in zip(parts, dfs, strict=True) if v > 0]
    return sum(v * -float(special.stdtrit(d, alpha / 2)) for v, d in pairs) / float(sum(parts))


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
