"""Paired bootstrap intervals of sage-report (analysis.bootstrap): hand-computable cases, the per-problem
pass@k against sage.metrics, the marker, the few-seeds warning, and a whole report on an MLflow store
filled in the test through sage.tracking's own Tracker.log_eval (the path sage-train logs by)."""

import csv
import io

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from analysis import assemble, bootstrap, figures, report, selection, tables
from analysis.bootstrap import Interval
from analysis.sections import differences
from analysis.tables import Diff
from sage.metrics import pass_at_k, pass_at_k_over_seeds


# ------------------------------------------------------------------ per-problem pass@k
def test_per_problem_pass_at_k_agrees_with_sage_metrics():
    rng = np.random.default_rng(3)
    mats = [rng.random((7, 10)) < rng.random((7, 1)) for _ in range(3)]  # 3 eval seeds, 7 problems
    ks = [1, 2, 5, 10]
    per_problem = bootstrap.per_problem_pass_at_k(mats, ks)
    assert per_problem.shape == (4, 7)
    summary = pass_at_k_over_seeds(mats, ks)  # what log_eval logs as pass_at_<k>/<label>/<ds>
    for i, k in enumerate(ks):
        assert per_problem[i].mean() == pytest.approx(summary[f"pass@{k}"], abs=1e-12)
        for p in range(7):
            expected = np.mean([pass_at_k(10, int(m[p].sum()), k) for m in mats])
            assert per_problem[i, p] == pytest.approx(expected, abs=1e-12)
    # by hand: n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6; no correct sample: 0; k=n with one correct: 1
    hand = np.array([[True, False, False, False], [False] * 4, [False, False, False, True]])
    assert bootstrap.per_problem_pass_at_k([hand], [2, 4]).tolist() == [[0.5, 0.0, 0.5], [1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="share one"):
        bootstrap.per_problem_pass_at_k([hand, hand[:2]], [1])


# ------------------------------------------------------------------ differences: the t interval
def test_seed_noise_and_the_interval_by_hand():
    """2 seeds x 2 problems per side. A: [[.5, .7], [.3, .5]], B: [[.4, .4], [.1, .1]].
    Run means A .6/.4, B .4/.1: between-seed variances .02 and .045, each on 1 df (its own seeds). Residuals
    (value less its seed's and its problem's mean plus the grand mean) are all 0: A is additive, B constant
    per seed. Seed part .02/2 + .045/2 = .0325 on min(1, 1) = 1 df; per-problem differences (seed-averaged)
    .4-.25 and .6-.25: variance .02, over 2 problems .01, on 1 df. Var .0425; both parts on 1 df, so the
    critical value is t(.975, 1) = 12.706 and the interval is exactly a t interval on 1 df."""
    a, b = np.array([[0.5, 0.7], [0.3, 0.5]]), np.array([[0.4, 0.4], [0.1, 0.1]])
    na, nb = bootstrap.seed_noise(a), bootstrap.seed_noise(b)
    assert (na.run_var, na.resid_var, na.df) == pytest.approx((0.02, 0.0, 1))
    assert (nb.run_var, nb.resid_var, nb.df) == pytest.approx((0.045, 0.0, 1))
    i = bootstrap.difference(a, b)
    se = 0.0425**0.5
    assert i.diff == pytest.approx(0.25) and i.se == pytest.approx(se) and i.df == pytest.approx(1)
    half = 12.706204736174694 * se  # t(.975, 1)
    assert (i.lo, i.hi) == pytest.approx((0.25 - half, 0.25 + half))
    # on 1 df the t is Cauchy: p = 1 - 2 atan(t) / pi; the 80% quantile is tan(.3 pi) = 1.3764
    assert i.p == pytest.approx(1 - 2 * np.arctan(0.25 / se) / np.pi)
    assert i.mde == pytest.approx((12.706204736174694 + np.tan(0.3 * np.pi)) * se)
    assert not i.marked
    # against the start model (no training seed): only A's seeds count
    base = bootstrap.difference(a, b[:1], ref_is_base=True)
    # seed part .02 / 2; per-problem differences 0 and .2 (A's seed means .4, .6 less B's .4): var .02, / 2
    assert base.se == pytest.approx((0.02 / 2 + 0.02 / 2) ** 0.5)
    # the residual noise: A + [[0, e], [0, -e]] has residuals +-e/2 in its 4 cells, on 1 x 1 df
    e = 0.1
    noisy = a + np.array([[0, e], [0, -e]])
    assert bootstrap.seed_noise(noisy).resid_var == pytest.approx(4 * (e / 2) ** 2)
    with pytest.raises(ValueError, match=r"\(seeds, problems\) array"):
        bootstrap.seed_noise(a[0])


def test_cochran_cox_critical_value_by_hand():
    """Parts .01 on 1 df and .03 on infinitely many: the critical value is (.01 x 12.7062 + .03 x 1.95996)
    / .04 = 4.6465, larger than the t quantile on Welch-Satterthwaite's .04^2 / (.01^2 / 1) = 16 df (2.12);
    the p-value is the level at which the critical value equals |diff| / se; the effective df the t whose
    97.5% quantile is 4.6465 (between 1 and 16)."""
    parts, dfs = [0.01, 0.03], [1, np.inf]
    crit = (0.01 * 12.706204736174694 + 0.03 * 1.959963984540054) / 0.04
    assert bootstrap.critical(parts, dfs, 0.05) == pytest.approx(crit)
    assert bootstrap.critical([0.02], [3], 0.05) == pytest.approx(stats.t.ppf(0.975, 3))  # one part: a t
    i = bootstrap.t_interval(0.5, parts, dfs)
    assert (i.lo, i.hi, i.se) == pytest.approx((0.5 - crit * 0.2, 0.5 + crit * 0.2, 0.2))
    assert stats.t.ppf(0.975, i.df) == pytest.approx(crit) and 1 < i.df < 16
    assert bootstrap.critical(parts, dfs, i.p) == pytest.approx(0.5 / 0.2)  # |diff| / se = 2.5
    assert 0.05 < i.p < 1 and not i.marked
    far = bootstrap.t_interval(5.0, parts, dfs)  # 25 se: marked, p far below .05, consistent with it
    assert far.marked and bootstrap.critical(parts, dfs, far.p) == pytest.approx(25.0)
    # far out only the 1-df part's Cauchy tail counts: critical ~ (.01 / .04) x 2 / (pi p) = 1e50 / .2
    assert bootstrap.t_interval(1e50, parts, dfs).p * np.pi * 1e51 == pytest.approx(1, rel=1e-6)
    assert bootstrap.t_interval(1e3, [0.01], [np.inf]).p == 0.0  # a normal tail below 1e-100
    # one part: the t test itself, at any degrees of freedom
    for df in (1, 2.5, 7, 99):
        for diff in (0.01, 0.05, 0.3):
            one = bootstrap.t_interval(diff, [0.01], [df])
            assert one.p == pytest.approx(2 * stats.t.sf(diff / 0.1, df), rel=1e-6)
            assert one.df == pytest.approx(df)
    assert bootstrap.t_interval(0.0, parts, dfs).p == 1.0
    with pytest.raises(ValueError, match="no degrees of freedom"):
        bootstrap.t_interval(0.1, [0.01, 0.02], [3, 0])


def test_one_seed_gets_no_interval():
    a, b = np.ones((1, 20)), np.zeros((2, 20))
    for i in (bootstrap.difference(a, b), bootstrap.difference(b, a)):
        assert not i.has_interval and not i.marked and np.isnan(i.p)
    assert Diff(bootstrap.difference(a, b), 1, 2, 2).text() == "+1.000 (1 seed: no interval)"
    assert bootstrap.seed_noise(a) is None  # one seed: nothing measures its noise
    # against the start model one trained side is enough
    assert bootstrap.difference(np.ones((2, 20)), np.zeros((1, 20)), ref_is_base=True).marked


def test_identical_and_shifted_methods():
    values = np.random.default_rng(0).random((8, 40))
    same = bootstrap.difference(values, values)
    assert same.diff == 0 and same.lo < 0 < same.hi and same.p == pytest.approx(1.0)
    shifted = bootstrap.difference(values + 0.5, values)
    assert shifted.diff == pytest.approx(0.5) and shifted.marked and shifted.p < 0.01
    with pytest.raises(ValueError, match="not paired by problem"):
        bootstrap.difference(values, values[:, :20])


def test_holm_by_hand():
    # sorted p .001 .012 .03 .04 against .05/4 .05/3 .05/2 .05/1: the first two pass, .03 > .025 stops
    assert bootstrap.holm([0.04, 0.001, 0.03, 0.012]) == [False, True, False, True]
    assert bootstrap.holm([0.01, float("nan"), 0.02]) == [True, False, True]  # NaN: not in the family
    assert bootstrap.holm([0.2, 0.01]) == [False, True]
    assert bootstrap.holm([]) == []


# (sd of a method's gain over problems, of a seed's effect on a whole run, of one (seed, problem) value)
SEED_NOISE = (0.05, 0.01, 0.03)  # the tables' seed std of pass@1 (.010), 256 samples per problem
PROBLEM_NOISE = (0.15, 0.005, 0.2)  # few samples per problem, methods that differ problem by problem
# Each regime: (sd, each row's seed-noise scale (the first row is the reference), share of a seed's effect
# shared by every row that ran that seed). The study's GRPO w/o KL had 3.7x the pooled seed variance.
REGIMES = {
    "seed noise": (SEED_NOISE, (1, 1, 1, 1, 1, 1), 0.0),
    "problem noise": (PROBLEM_NOISE, (1, 1, 1, 1, 1, 1), 0.0),
    "unequal seed noise": (SEED_NOISE, (1, 1, 2, 4, 1, 1), 0.0),
    "unequal, reference 4x": (SEED_NOISE, (4, 1, 2, 1, 1, 1), 0.0),
    "unequal, seeds shared": (SEED_NOISE, (1, 1, 2, 4, 2, 1), 0.5),
}


def simulate(seeds: int, studies: int, rng: np.random.Generator, regime: str, problems: int = 200):
    """Studies of len(scale) rows (the first the reference) on ``problems`` problems under a true null:
    problem difficulty shared by all (std .25), then ``sd``: a method's gain varying over problems, a
    seed's effect on a whole run (``shared`` of its variance common to every row run with that seed, the
    rest the row's own), per (seed, problem) noise; a row's seed effect and per-value noise are scaled by
    its ``scale``. Yields each study's (rows, seeds, problems) values and the exact variance of each row's
    difference from the reference (what an oracle knows, ignoring the shared part's covariance)."""
    (sd_alpha, sd_b, sd_e), scale, shared = REGIMES[regime]
    scale = np.asarray(scale, dtype=float)[:, None, None]
    run_var = (sd_b**2 + sd_e**2 / problems) * scale[:, 0, 0] ** 2
    oracle_var = sd_alpha**2 * 2 / problems + (run_var[1:] + run_var[0]) / seeds
    methods = len(scale)
    for _ in range(studies):
        a = rng.normal(0, 0.25, problems)
        alpha = rng.normal(0, sd_alpha, (methods, 1, problems))
        common = rng.normal(0, sd_b * shared**0.5, (1, seeds, 1))
        b = scale * (common + rng.normal(0, sd_b * (1 - shared) ** 0.5, (methods, seeds, 1)))
        e = scale * rng.normal(0, sd_e, (methods, seeds, problems))
        yield a + alpha + b + e, oracle_var


def pooled_covers(rows: np.ndarray) -> np.ndarray:
    """The interval sage-report gave before this one: seed noise pooled over every row of the table
    (Sum(seeds - 1) df), the problem part as now; whether each row's difference from the first covers 0."""
    _, seeds, problems = rows.shape
    run_var = rows.mean(axis=2).var(axis=1, ddof=1).mean()
    resid = rows - rows.mean(axis=2, keepdims=True) - rows.mean(axis=1, keepdims=True)
    resid += rows.mean(axis=(1, 2), keepdims=True)
    resid_var = (resid**2).sum() / (len(rows) * (seeds - 1) * (problems - 1))
    out = []
    for m in range(1, len(rows)):
        per_problem = rows[m].mean(axis=0) - rows[0].mean(axis=0)
        seed_part = run_var * 2 / seeds
        problem_part = max(0.0, per_problem.var(ddof=1) - resid_var * 2 / seeds) / problems
        df = (seed_part + problem_part) ** 2 / (
            seed_part**2 / (len(rows) * (seeds - 1)) + problem_part**2 / (problems - 1)
        )
        half = stats.t.ppf(0.975, df) * (seed_part + problem_part) ** 0.5
        out.append(abs(per_problem.mean()) <= half)
    return np.array(out)


def old_bootstrap_covers(rows: np.ndarray, rng: np.random.Generator, draws: int = 400) -> np.ndarray:
    """The interval sage-report gave before the t interval: problems and seeds resampled (the same indices
    for every method, as for a grid's shared seed set), 2.5 / 97.5 percentiles; whether each difference's
    covers 0."""
    _, seeds, problems = rows.shape
    w = rng.multinomial(seeds, np.full(seeds, 1 / seeds), size=draws)
    pw = rng.multinomial(problems, np.full(problems, 1 / problems), size=draws)
    means = np.einsum("bs,msp,bp->mb", w, rows, pw) / (seeds * problems)
    lo, hi = np.percentile(means[1:] - means[0], [2.5, 97.5], axis=1)
    return (lo <= 0) & (0 <= hi)


STUDIES = 800


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("seeds", [2, 3, 5, 8])
def test_the_interval_holds_its_level_at_few_seeds_and_unequal_seed_noise(seeds, regime):
    """800 simulated studies of 6 rows (5 comparisons each) at 2, 3, 5 and 8 seeds, with every row's seed
    noise alike, with rows at 2x and 4x the others' seed SD (the reference too), and with seeds shared
    across rows: the 95% per-pair interval covers the true difference (0) at least 93% of the time for each
    row, and its median width is within 1.5x of the oracle's (the true variance, with the t quantile of the
    interval's own seed degrees of freedom, ``seed_df``: the width its variance estimate costs). The
    intervals it replaced fail here: seed noise pooled over the table's rows covers less than 93% for the 4x
    row (less than 90% with a 4x reference), and at 2-5 seeds the bootstrap of problems and seeds covered
    less than 93% even with equal noise."""
    rng = np.random.default_rng([seeds, len(regime)])
    unequal = regime.startswith("unequal")
    covered, widths, oracle, pooled, boot = [], [], [], [], []
    for study, (rows, oracle_var) in enumerate(simulate(seeds, STUDIES, rng, regime)):
        intervals = [bootstrap.difference(rows[m], rows[0]) for m in range(1, len(rows))]
        covered.append([i.lo <= 0 <= i.hi for i in intervals])
        widths.append([i.hi - i.lo for i in intervals])
        oracle.append(2 * stats.t.ppf(0.975, bootstrap.seed_df(seeds)) * oracle_var**0.5)
        if unequal:
            pooled.append(pooled_covers(rows))
        if regime == "seed noise" and seeds <= 5 and study < 200:  # the old bootstrap (slow) on a share
            boot.extend(old_bootstrap_covers(rows, rng))
    coverage = np.mean(covered, axis=0)
    assert coverage.min() >= 0.93, coverage
    ratio = np.median(widths, axis=0) / np.median(oracle, axis=0)
    assert ratio.max() <= 1.5, ratio
    if unequal:
        old = np.mean(pooled, axis=0)
        worst = old.min()
        assert worst < (0.90 if regime == "unequal, reference 4x" else 0.93), old
    if boot:
        assert np.mean(boot) < 0.93, np.mean(boot)  # what the report showed before: too narrow


# ------------------------------------------------------------------ differences paired by training seed
def test_the_paired_interval_by_hand():
    """3 seeds x 2 problems. The reference's seeds move whole runs: [[.3, .3], [.1, .1], [.5, .5]]; the method
    is the reference plus z = [[.1, .3], [.2, .4], [.3, .5]], the same seed on the same row. Paired, only z
    counts: its seed means .2, .3, .4 (variance .01, on 2 df), over 3 seeds: seed part .01 / 3; z is additive
    (.1 + seed + problem), so its residuals are 0 and its problem means .2, .4 keep their whole spread .02,
    over 2 problems: problem part .01, on 1 df. Cochran-Cox: (.01/3 t(.975, 1.25) + .01 t(.975, 1)) / (.04/3),
    the seed part on seed_df(3) = (3 + 2) / 4 = 1.25 df."""
    ref = np.array([[0.3, 0.3], [0.1, 0.1], [0.5, 0.5]])
    z = np.array([[0.1, 0.3], [0.2, 0.4], [0.3, 0.5]])
    i = bootstrap.difference(ref + z, ref, paired=True)
    t13, t1 = stats.t.ppf(0.975, 1.25), 12.706204736174694  # t(.975, 1.25) = 8.03, t(.975, 1)
    assert bootstrap.seed_df(3) == 1.25 and t13 == pytest.approx(8.03, abs=0.01)
    crit = (0.01 / 3 * t13 + 0.01 * t1) / (0.04 / 3)
    se = (0.04 / 3) ** 0.5
    assert i.diff == pytest.approx(0.3) and i.se == pytest.approx(se)
    assert (i.lo, i.hi) == pytest.approx((0.3 - crit * se, 0.3 + crit * se))
    assert stats.t.ppf(0.975, i.df) == pytest.approx(crit) and 1 < i.df < 2
    # the residual noise of the differences leaves the problem part: z + [[0, e], [0, -e], [0, 0]] has
    # residuals e/2 x [[-1, 1], [1, -1], [0, 0]] on 2 x 1 df, variance e^2 / 2; its seed means .2+e/2, .3-e/2,
    # .4; its problem means .2, .4 (unchanged): problem part (.02 - e^2 / 2 / 3) / 2
    e = 0.1
    noisy = bootstrap.difference(ref + z + np.array([[0, e], [0, -e], [0, 0]]), ref, paired=True)
    means = np.array([0.2 + e / 2, 0.3 - e / 2, 0.4])
    assert noisy.se == pytest.approx((means.var(ddof=1) / 3 + (0.02 - e**2 / 6) / 2) ** 0.5)
    # one seed pair: nothing measures the difference's seed noise
    assert not bootstrap.difference(ref[:1] + z[:1], ref[:1], paired=True).has_interval
    with pytest.raises(ValueError, match="not paired by seed: 3 seeds and 2 reference seeds"):
        bootstrap.difference(ref + z, ref[:2], paired=True)
    with pytest.raises(ValueError, match="start model has no training seed"):
        bootstrap.difference(ref + z, ref[:1], ref_is_base=True, paired=True)


def test_pairing_narrows_the_interval_when_seed_effects_are_shared():
    """Seeds move both rows' runs together (reference run means .3, .1, .5; the method's .48, .3, .72): their
    per-seed differences .18, .2, .22 vary far less than either row (variances .0004 against .04 and .0444).
    The problems add nothing (every problem moved alike), so both intervals are t intervals on seed_df(3) =
    1.25 df and their widths are in the ratio of the seed parts' roots, sqrt(.0004 / (.04 + .0444)): the
    paired one excludes 0 (t = .2 / sqrt(.0004 / 3) = 17.3), the unpaired one does not (1.19)."""
    ref = np.array([[0.3, 0.3], [0.1, 0.1], [0.5, 0.5]])
    method = ref + np.array([[0.18, 0.18], [0.2, 0.2], [0.22, 0.22]])
    paired = bootstrap.difference(method, ref, paired=True)
    unpaired = bootstrap.difference(method, ref)
    assert paired.diff == unpaired.diff == pytest.approx(0.2)
    assert (paired.se, unpaired.se) == pytest.approx(((0.0004 / 3) ** 0.5, (0.0844 / 3) ** 0.5))
    assert paired.df == pytest.approx(1.25) and unpaired.df == pytest.approx(1.25)
    width = lambda i: i.hi - i.lo  # noqa: E731
    assert width(paired) / width(unpaired) == pytest.approx((0.0004 / 0.0844) ** 0.5)
    assert paired.marked and not unpaired.marked
    # the default stays the unpaired interval
    assert bootstrap.difference(method, ref, paired=False) == unpaired


PAIRED_NOISE = {"seed noise": SEED_NOISE, "problem noise": PROBLEM_NOISE}
RHOS, SCALES = (0.0, 0.5, 0.9, 0.95), (1, 2, 4)
# At 2 seeds the seed part has 1 df, and Cochran-Cox's critical value covers less than 95% when the problem
# part is a few percent of it (integrated numerically: 93.9% at a problem part 2.5% of the seed part; from
# 3 seeds on, 95.0%): these studies' counts put 0.93 at least 3.9 binomial SDs below the coverage a cell
# can have (at 2 seeds 10000 studies, SD 0.0024 about 0.939; from 3 seeds on SD <= 0.0049 about 0.95).
PAIRED_STUDIES = {2: 10_000, 3: 3_000, 5: 2_000, 8: 2_000}


def simulate_pairs(seeds, studies, rng, sd, rho, scale, problems=200):
    """(method, reference) arrays of ``studies`` studies, each (studies, seeds, problems), under a true null,
    the model of ``simulate`` with both rows run on the same seeds: a seed's effect on the whole run and its
    per-(seed, problem) noise correlate at ``rho`` between the rows, the method's SD ``scale`` x the
    reference's. Vectorised over studies: the paired interval sees only each study's differences."""
    sd_alpha, sd_b, sd_e = sd

    def correlated(shape, sd):
        x, y = rng.standard_normal(shape), rng.standard_normal(shape)
        return scale * sd * (rho * x + (1 - rho**2) ** 0.5 * y), sd * x

    b, b_ref = correlated((studies, seeds, 1), sd_b)
    e, e_ref = correlated((studies, seeds, problems), sd_e)
    a = rng.normal(0, 0.25, (studies, 1, problems))
    alpha = rng.normal(0, sd_alpha, (2, studies, 1, problems))
    return a + alpha[0] + b + e, a + alpha[1] + b_ref + e_ref


def resid_vars(x):
    """``seed_noise(x[i]).resid_var`` of each study i of a (studies, seeds, problems) array."""
    _, seeds, problems = x.shape
    resid = (
        x - x.mean(axis=2, keepdims=True) - x.mean(axis=1, keepdims=True) + x.mean(axis=(1, 2), keepdims=True)
    )
    return (resid**2).sum(axis=(1, 2)) / ((seeds - 1) * (problems - 1))


def paired_intervals(values, ref, df=None):
    """``difference(..., paired=True)``'s (lo, hi) for each study, vectorised (the test checks it against the
    function on a share of the studies); ``df``: the seed part's degrees of freedom (default ``seed_df``)."""
    _, seeds, problems = values.shape
    z = values - ref
    resid_var = resid_vars(z)
    seed_part = np.maximum(z.mean(axis=2).var(axis=1, ddof=1), resid_var / problems) / seeds
    problem_part = np.maximum(0.0, z.mean(axis=1).var(axis=1, ddof=1) - resid_var / seeds) / problems
    var = seed_part + problem_part
    df = bootstrap.seed_df(seeds) if df is None else df
    t_seed, t_problem = stats.t.ppf(0.975, df), stats.t.ppf(0.975, problems - 1)
    half = (seed_part * t_seed + problem_part * t_problem) / var * var**0.5
    diff = values.mean(axis=(1, 2)) - ref.mean(axis=(1, 2))
    return diff - half, diff + half


@pytest.mark.parametrize("seeds", [2, 3, 5, 8])
def test_the_paired_interval_holds_its_level_with_seed_effects_shared_across_rows(seeds):
    """Simulated studies of two rows on the same seeds, under a true null, in every cell of: the rows' seed
    effects correlated at 0, .5, .9 and .95; the method's seed SD 1x, 2x and 4x the reference's; seed noise
    or problem noise dominant (the regimes of ``simulate``). The 95% paired interval covers 0 in at least 93%
    of studies in each cell, and its median width is within 1.5x of the oracle's (the true variance of the
    difference, t quantile on the interval's ``seed_df``)."""
    studies = PAIRED_STUDIES[seeds]
    coverage, ratio = {}, {}
    for name, sd in PAIRED_NOISE.items():
        for rho in RHOS:
            for scale in SCALES:
                rng = np.random.default_rng([seeds, len(name), int(100 * rho), scale])
                values, ref = simulate_pairs(seeds, studies, rng, sd, rho, scale)
                lo, hi = paired_intervals(values, ref)
                for s in range(20):  # the vectorised intervals are the function's
                    i = bootstrap.difference(values[s], ref[s], paired=True)
                    assert (i.lo, i.hi) == pytest.approx((lo[s], hi[s]), rel=1e-9, abs=1e-12)
                cell = (name, rho, scale)
                coverage[cell] = float(np.mean((lo <= 0) & (0 <= hi)))
                # Var(diff) = sigma_g^2 / P + (sigma_c^2 + sigma_u^2 / P) / S, each c and u of variance
                # (1 + scale^2 - 2 rho scale) x the reference's
                shared = 1 + scale**2 - 2 * rho * scale
                problems = values.shape[2]
                var = 2 * sd[0] ** 2 / problems + shared * (sd[1] ** 2 + sd[2] ** 2 / problems) / seeds
                oracle = 2 * stats.t.ppf(0.975, bootstrap.seed_df(seeds)) * var**0.5
                ratio[cell] = float(np.median(hi - lo)) / oracle
    worst = min(coverage, key=coverage.get)
    assert coverage[worst] >= 0.93, (worst, coverage)
    assert max(ratio.values()) <= 1.5, ratio


# ------------------------------------------------------------------ skewed seed effects (issue 58)
def test_seed_df_covers_the_mean_of_exponential_seed_effects():
    """``seed_df(S)``: the degrees of freedom at which a t interval covers 95% of the mean of S exponential
    values (skewness 2) with nothing else in its variance, where S - 1 covers 88-93%: (S + 2) / 4, at 2 seeds
    the same 1 df as S - 1. 40,000 samples per S: a binomial SD of 0.0011 about 0.95."""
    rng = np.random.default_rng(58)
    assert bootstrap.seed_df(2) == 1 and bootstrap.seed_df(8) == 2.5
    for seeds in (3, 4, 5, 8, 12, 16):
        x = rng.exponential(1.0, (40_000, seeds)) - 1.0
        t = np.abs(x.mean(axis=1)) / (x.std(axis=1, ddof=1) / seeds**0.5)
        old = float(np.mean(t <= stats.t.ppf(0.975, seeds - 1)))
        new = float(np.mean(t <= stats.t.ppf(0.975, bootstrap.seed_df(seeds))))
        assert old < 0.935 and 0.945 <= new <= 0.96, (seeds, old, new)


def seed_effects(rng, kind, shape):
    """Standardised seed effects (mean 0, SD 1): normal, exponential, lognormal(0, sigma), or t with 3 df."""
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "exponential":
        return rng.exponential(1.0, shape) - 1.0
    if kind.startswith("lognormal"):
        s = float(kind.removeprefix("lognormal"))
        return (rng.lognormal(0.0, s, shape) - np.exp(s * s / 2)) / (
            (np.exp(s * s) - 1) * np.exp(s * s)
        ) ** 0.5
    assert kind == "t3", kind
    return rng.standard_t(3, shape) / 3**0.5


def shared_stream(rng, p, samples):
    """Binomial counts of ``samples`` draws for (runs, ...) success probabilities ``p``, all runs reading one
    shared stream of uniforms per problem (a count is #{u < p}, as every run evaluated with one sampling
    seed): built run by run in order of p, each count the previous one plus a binomial of the draws left
    over the probability added (exact for uniforms shared by every run)."""
    order = np.argsort(p, axis=0)
    counts = np.empty(p.shape, dtype=np.int64)
    prev_p, prev_c = np.zeros(p.shape[1:]), np.zeros(p.shape[1:], dtype=np.int64)
    for ranked in range(len(p)):
        run = np.take_along_axis(p, order[ranked : ranked + 1], axis=0)[0]
        step = np.clip((run - prev_p) / np.maximum(1 - prev_p, 1e-12), 0.0, 1.0)
        prev_c = prev_c + rng.binomial(samples - prev_c, step)
        prev_p = run
        np.put_along_axis(counts, order[ranked : ranked + 1], prev_c[None], axis=0)
    return counts


# Each case: (seed effects' family, the method's seed SD over the reference's, the share of each seed's effect
# common to both rows, which rows' effects are skewed, SD of the method's gain over problems, SD of a seed's
# effect varying over problems). The seed SD .016 against a run mean's sampling SD of .0045 (100 problems x
# 256 samples at p .15-.45): seed effects dominate the run means, as in the fork and dose studies' rare share.
SKEWED = {
    "normal, 4x, shared .9": ("normal", 4, 0.9, "both", 0.0, 0.0),
    "exponential, 1x": ("exponential", 1, 0.0, "both", 0.0, 0.0),
    "exponential, 2x, shared .5": ("exponential", 2, 0.5, "both", 0.0, 0.0),
    "exponential, 4x, shared .9": ("exponential", 4, 0.9, "both", 0.0, 0.0),
    "exponential, 4x, shared .99": ("exponential", 4, 0.99, "both", 0.0, 0.0),
    "exponential method only, 4x": ("exponential", 4, 0.0, "method", 0.0, 0.0),
    "lognormal(0, .5), 2x, shared .5": ("lognormal0.5", 2, 0.5, "both", 0.0, 0.0),
    "lognormal(0, .5), 4x, shared .9": ("lognormal0.5", 4, 0.9, "both", 0.0, 0.0),
    "t3, 1x": ("t3", 1, 0.0, "both", 0.0, 0.0),
    "t3, 4x, shared .9": ("t3", 4, 0.9, "both", 0.0, 0.0),
    "exponential, problem-varying": ("exponential", 2, 0.5, "both", 0.03, 0.02),
}


def simulate_skewed(rng, seeds, studies, case, problems=100, samples=256, sd_b=0.016):
    """(method, reference) arrays (studies, seeds, problems) under a true null: each problem's success
    probability (uniform .15-.45, shared by both rows) plus the method's gain varying over problems, plus a
    seed's effect on the whole run (a share common to both rows run with that seed, the rest the row's own;
    the method's x its scale) and a seed's effect varying over problems, clipped to [0, 1]; the observed
    values binomial counts over ``samples`` from one shared stream (``shared_stream``)."""
    kind, scale, shared, skewed, sd_alpha, sd_sp = SKEWED[case]
    base = rng.uniform(0.15, 0.45, (studies, 1, problems))

    def effects(skew):
        return seed_effects(rng, kind if skew else "normal", (studies, seeds, 1))

    common = effects(skewed == "both")
    own = effects(True), effects(skewed == "both")
    p = [
        base
        + rng.normal(0.0, sd_alpha, (studies, 1, problems))
        + sd_b * s * (shared**0.5 * common + (1 - shared) ** 0.5 * o)
        + rng.normal(0.0, sd_sp, (studies, seeds, problems))
        for s, o in zip((scale, 1.0), own, strict=True)
    ]
    runs = np.clip(np.concatenate(p, axis=1), 0.0, 1.0).transpose(1, 0, 2)  # (2 x seeds, studies, problems)
    values = (shared_stream(rng, runs, samples) / samples).transpose(1, 0, 2)
    return values[:, :seeds], values[:, seeds:]


def unpaired_intervals(values, ref, df=None):
    """``difference(values, ref)``'s (lo, hi) for each study of two (studies, seeds, problems) arrays of
    equal seeds, vectorised; ``df``: the seed part's degrees of freedom (default ``seed_df``)."""
    _, seeds, problems = values.shape
    resid = [resid_vars(x) for x in (values, ref)]
    seed_part = (
        sum(
            np.maximum(x.mean(axis=2).var(axis=1, ddof=1), r / problems)
            for x, r in zip((values, ref), resid, strict=True)
        )
        / seeds
    )
    spread = (values.mean(axis=1) - ref.mean(axis=1)).var(axis=1, ddof=1)
    problem_part = np.maximum(0.0, spread - (resid[0] + resid[1]) / seeds) / problems
    var = seed_part + problem_part
    df = bootstrap.seed_df(seeds) if df is None else df
    t_seed, t_problem = stats.t.ppf(0.975, df), stats.t.ppf(0.975, problems - 1)
    half = (seed_part * t_seed + problem_part * t_problem) / var * var**0.5
    diff = values.mean(axis=(1, 2)) - ref.mean(axis=(1, 2))
    return diff - half, diff + half


SKEWED_STUDIES = 2000


def skewed_coverage(seeds, studies, case, *, check=0):
    """Coverage of 0 by the unpaired and the paired interval, on ``seed_df`` and on seeds - 1 df (the
    interval before issue 58), in ``studies`` simulated studies of ``case``; the first ``check`` studies'
    vectorised intervals are checked against ``difference``."""
    rng = np.random.default_rng([seeds, *map(ord, case)])
    values, ref = simulate_skewed(rng, seeds, studies, case)
    for s in range(check):
        for paired, (lo, hi) in (
            (False, unpaired_intervals(values, ref)),
            (True, paired_intervals(values, ref)),
        ):
            i = bootstrap.difference(values[s], ref[s], paired=paired)
            assert (i.lo, i.hi) == pytest.approx((lo[s], hi[s]), rel=1e-9, abs=1e-12)
    out = {}
    for name, fn in (("unpaired", unpaired_intervals), ("paired", paired_intervals)):
        for df in (None, seeds - 1):
            lo, hi = fn(values, ref, df)
            out[name, "seed_df" if df is None else "S - 1"] = float(np.mean((lo <= 0) & (0 <= hi)))
    return out


@pytest.mark.parametrize("seeds", [4, 8])
def test_the_intervals_hold_under_skewed_and_heavy_tailed_seed_effects(seeds):
    """2,000 simulated studies per case (``SKEWED``: exponential, lognormal(0, .5) and t3 seed effects, the
    method's seed SD 1-4x the reference's, shared by the rows' seeds at 0-.99, problem-varying effects), with
    binomial counts from one shared evaluation stream on 100 problems: the unpaired and the paired interval
    each cover 0 in at least 94% of studies in every case (a binomial SD of .005 about .95). On S - 1 df (the
    interval before issue 58) each covers less than 94% in the worst case."""
    coverage = {case: skewed_coverage(seeds, SKEWED_STUDIES, case, check=5) for case in SKEWED}
    for which in ("unpaired", "paired"):
        new = {case: c[which, "seed_df"] for case, c in coverage.items()}
        old = {case: c[which, "S - 1"] for case, c in coverage.items()}
        assert min(new.values()) >= 0.94, (which, new)
        assert min(old.values()) < 0.94, (which, old)


def test_a_seed_variance_is_never_0():
    """Two seeds whose run means are equal (.35 each) but whose problems differ (.35 +- noise of mean 0): the
    run means' between-seed variance is 0, and the seed part is floored at the sampling variance a run mean
    holds, resid_var / P (residuals +-noise, on 1 x 39 df), over the 2 seeds; the seed-averaged problems are
    all .35, so the problem part is 0 and the interval is the floor's alone. Paired against a reference of .32
    everywhere, the per-seed differences get the same floor."""
    noise = np.random.default_rng(5).normal(0, 0.05, 40)
    noise -= noise.mean()
    alike = 0.35 + np.stack([noise, -noise])
    n = bootstrap.seed_noise(alike)
    assert n.run_var == pytest.approx(0, abs=1e-15)
    assert n.resid_var == pytest.approx(2 * (noise**2).sum() / 39)
    floor = (n.resid_var / 40 / 2) ** 0.5
    i = bootstrap.difference(alike, np.full((1, 40), 0.32), ref_is_base=True)
    assert i.diff == pytest.approx(0.03) and i.se == pytest.approx(floor) and i.lo < i.diff < i.hi
    paired = bootstrap.difference(alike, np.full((2, 40), 0.32), paired=True)
    assert paired.se == pytest.approx(floor) and paired.lo < paired.diff < paired.hi


def test_curve_band_and_its_ks():
    rng = np.random.default_rng(6)
    values = rng.random((3, 40, 2))
    mean, lo, hi = bootstrap.mean_band(values)
    assert mean == pytest.approx(values.mean(axis=(0, 1)))
    assert np.all(lo < mean) and np.all(mean < hi)
    const = np.full((3, 40, 1), 0.25)
    _, lo, hi = bootstrap.mean_band(const)
    assert (lo[0], hi[0]) == pytest.approx((0.25, 0.25))
    ks = bootstrap.band_ks(256)
    assert ks[0] == 1 and ks[-1] == 256 and ks == sorted(set(ks)) and 20 <= len(ks) <= 26
    assert bootstrap.band_ks(1) == [1]


def test_figure_band_is_the_given_interval():
    import matplotlib.pyplot as plt

    frame = pd.DataFrame({"seed": [1, 2, 1, 2], "k": [1, 1, 4, 4], "value": [0.2, 0.4, 0.5, 0.7]})
    band = pd.DataFrame({"k": [1, 4], "lo": [0.1, 0.45], "hi": [0.5, 0.8]})
    fig, ax = plt.subplots()
    figures._line(ax, frame, "k", "A", band=band)
    (poly,) = ax.collections
    ys = poly.get_paths()[0].vertices[:, 1]
    assert (ys.min(), ys.max()) == pytest.approx((0.1, 0.8))  # the bootstrap band, not mean ± std
    plt.close(fig)


# ------------------------------------------------------------------ marker and rendering
def iv(diff, lo, hi, p=0.01):
    return Interval(diff, lo, hi, se=0.01, df=10.0, p=p, mde=0.03)


def test_marker_and_cells():
    marked = Diff(iv(0.031, 0.012, 0.050), 5, 5, 5)
    assert marked.text() == "+0.031 [0.012, 0.050] *"
    assert Diff(iv(0.031, 0.012, 0.050), 5, 5, 5, holm=True).text() == "+0.031 [0.012, 0.050] *†"
    assert Diff(iv(-0.01, -0.03, 0.01, p=0.4), 5, 5, 5).text() == "-0.010 [-0.030, 0.010]"
    nan = float("nan")
    one = Diff(Interval(0.3, nan, nan, nan, nan, nan, nan), 1, 5, 5)
    assert one.text() == "+0.300 (1 seed: no interval)"
    assert (
        Diff(iv(-0.2, -0.3, -0.1), 4, 5, 5).text() == "-0.200 [-0.300, -0.100] * (4/5 seeds, reference 5/5)"
    )
    t = tables.Table(
        "d", "d", ["x pass@1"], [("A", [marked]), ("B", ["— (no correctness matrices)"]), ("C", [one])]
    )
    assert "| A | +0.031 [0.012, 0.050] * |" in tables.to_markdown(t)
    assert r"A & +0.031 [0.012, 0.050] * \\" in tables.to_latex(t)
    rows = list(csv.DictReader(io.StringIO(tables.to_csv(t))))
    assert rows[0] == {
        "row": "A", "column": "x pass@1", "diff": "0.031", "lo": "0.012", "hi": "0.05",
        "excludes_zero": "True", "marked": "True", "p": "0.01", "holm": "False", "se": "0.01", "df": "10.0",
        "mde_80": "0.03", "seeds": "5", "ref_seeds": "5", "asked": "5", "text": "+0.031 [0.012, 0.050] *",
    }  # fmt: skip
    assert rows[1]["text"] == "— (no correctness matrices)" and rows[1]["diff"] == ""
    assert (rows[2]["diff"], rows[2]["lo"], rows[2]["p"]) == ("0.3", "", "")


def test_few_seeds_warning_names_trained_rows_only():
    meas = pd.DataFrame(
        [("base", s, "base") for s in (1,)]
        + [("GRPO", s, "trained") for s in (1, 2, 3, 4, 5)]
        + [("GRPO + Branch", s, "trained") for s in (1, 2, 3)],
        columns=["row", "seed", "label"],
    )
    w = selection.few_seeds_warning(meas, [1, 2, 3, 4, 5], 5)
    assert w is not None and "\n" not in w
    assert w.startswith("fewer than 5 training seeds for Table 1 methods: GRPO + Branch (3);")
    assert "GRPO (" not in w and "base" not in w
    assert selection.few_seeds_warning(meas, [1, 2, 3, 4, 5], 3) is None
    assert "GRPO (2), GRPO + Branch (2)" in selection.few_seeds_warning(meas, [1, 2], 5)  # asked seeds only


# ------------------------------------------------------------------ a whole report
DS = "arith_heldout"
PROBLEMS, SAMPLES, KS = 60, 16, [1, 16]


def success(method: str, seed: int) -> np.ndarray:
    """Per-problem success probability: half easy problems, half hard ones that only rare paths solve.
    GRPO sharpens (easy up, hard down a little); GRPO w/o KL loses the hard ones; forward KL (one seed)
    loses them too."""
    rng = np.random.default_rng(seed)
    easy, hard = np.full(PROBLEMS // 2, 0.5), np.full(PROBLEMS // 2, 0.06)
    if method == "base":
        return np.concatenate([easy, hard])
    jitter = rng.normal(0, 0.02)
    if method in ("grpo", "grpo_branch"):
        return np.concatenate([easy + 0.3 + jitter, hard - 0.02])
    return np.concatenate([easy + 0.4 + jitter, hard * 0])  # grpo_nokl, grpo_fkl


def matrices(method: str, seed: int) -> list[np.ndarray]:
    """Two evaluation seeds of (problems x samples) correctness. GRPO + Branch samples exactly what GRPO
    does (the same generator), so its difference is exactly 0."""
    name = "grpo" if method == "grpo_branch" else method
    p = success(name, seed)
    rng = np.random.default_rng([seed, len(name), sum(map(ord, name))])
    return [rng.random((PROBLEMS, SAMPLES)) < p[:, None] for _ in range(2)]


SYNTH = {"grpo": (1, 2, 3), "grpo_nokl": (1, 2, 3), "grpo_branch": (1, 2, 3), "grpo_fkl": (1,)}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A store of finished sage-train-like runs whose evaluations are logged by sage.tracking.Tracker."""
    from sage.tracking import Tracker, open_store

    root = tmp_path_factory.mktemp("boot_store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client, exp = open_store(uri, "boot")
    ids = {}
    for method, seeds in SYNTH.items():
        for seed in seeds:
            tags = {"sage.kind": "train", "seed": str(seed), "method": method, "base_model": "tb"}
            run = client.create_run(exp, tags=tags)
            client.log_param(run.info.run_id, "seed", str(seed))
            tracker = Tracker(client, run.info.run_id, resumed=False)
            for label, name in (("base", "base"), ("trained", method)):
                mats = matrices(name, 0 if label == "base" else seed)
                completions = [[["x"] * SAMPLES for _ in range(PROBLEMS)] for _ in mats]
                result = {
                    "summary": pass_at_k_over_seeds(mats, KS),
                    "correct": mats,
                    "completions": completions,
                }
                tracker.log_eval(label, DS, result, KS, None)
            client.set_terminated(run.info.run_id)
            ids[(method, seed)] = run.info.run_id
    # a run whose evaluation logged metrics but no correctness matrices (an older sage-train)
    tags = {"sage.kind": "train", "seed": "1", "method": "dapo", "base_model": "tb"}
    first = min(client.get_run(r).info.start_time for r in ids.values())
    run = client.create_run(exp, start_time=first - 1000, tags=tags)  # older: not the base row's source
    for k in KS:
        client.log_metric(run.info.run_id, f"pass_at_{k}/trained/{DS}", 0.5)
    for k in range(1, SAMPLES + 1):
        client.log_metric(run.info.run_id, f"pass_at_k_curve/trained/{DS}", 0.5, step=k)
    client.set_terminated(run.info.run_id)
    return {"uri": uri, "client": client, "root": root, "ids": ids}


def make(synth, name, **kw):
    out = synth["root"] / name / "r.md"
    return assemble.make_report(
        synth["client"],
        synth["uri"],
        experiment="boot",
        out=out,
        figures_dir=out.parent / "figures",
        tables_dir=out.parent / "tables",
        **kw,
    )


def metric(synth, method, seed, key):
    return synth["client"].get_run(synth["ids"][(method, seed)]).data.metrics[key]


def test_report_intervals_from_the_logged_matrices(synth):
    rep = make(synth, "default")
    vs_grpo, vs_base = rep.tables["diff_vs_reference"], rep.tables["diff_vs_base"]
    assert vs_grpo.title == "each method minus GRPO: pass@1 and pass@k"
    assert vs_grpo.columns == [f"{DS} pass@1", f"{DS} pass@16"]
    assert [r for r, _ in vs_grpo.rows] == [
        "GRPO w/o KL",
        "GRPO + forward KL",
        "GRPO + Branch",
        "DAPO w/o KL",
    ]
    # the point estimate is the difference of the logged pass@k means, for every k
    for k in KS:
        key = f"pass_at_{k}/trained/{DS}"
        mean = {m: np.mean([metric(synth, m, s, key) for s in SYNTH[m]]) for m in ("grpo", "grpo_nokl")}
        cell = vs_grpo.cell("GRPO w/o KL", f"{DS} pass@{k}")
        assert cell.interval.diff == pytest.approx(mean["grpo_nokl"] - mean["grpo"], abs=1e-12)
        assert cell.interval.lo <= cell.interval.diff <= cell.interval.hi
        assert (cell.n, cell.ref_n, cell.asked) == (3, 3, 3)
    # losing the hard problems: pass@16 falls against GRPO and against the start model, beyond the noise
    nokl = vs_base.cell("GRPO w/o KL", f"{DS} pass@16")
    base16 = metric(synth, "grpo", 1, f"pass_at_16/base/{DS}")
    assert nokl.interval.diff == pytest.approx(
        np.mean([metric(synth, "grpo_nokl", s, f"pass_at_16/trained/{DS}") for s in (1, 2, 3)]) - base16
    )
    assert nokl.interval.hi < 0 and nokl.interval.marked and nokl.text().endswith(" *†")
    assert vs_grpo.cell("GRPO w/o KL", f"{DS} pass@16").interval.marked
    assert vs_base.cell("GRPO", f"{DS} pass@1").interval.lo > 0  # sharpening raises pass@1
    # GRPO + Branch sampled exactly what GRPO did: exactly 0, no marker (the seed noise is the table's)
    same = vs_grpo.cell("GRPO + Branch", f"{DS} pass@16")
    assert same.interval.diff == 0 and same.interval.lo < 0 < same.interval.hi and "*" not in same.text()
    # one seed: no interval, no marker
    fkl = vs_grpo.cell("GRPO + forward KL", f"{DS} pass@16")
    assert fkl.text().endswith("(1 seed: no interval)") and not fkl.interval.marked
    assert vs_grpo.cell("DAPO w/o KL", f"{DS} pass@1") == "— (DAPO w/o KL: no correctness matrices)"
    assert any("DAPO w/o KL seed 1" in n and "no correctness matrices" in n for n in rep.notes)

    md = rep.markdown
    assert "## Differences against GRPO" in md and "## Differences against the start model" in md
    assert md.count(differences.NOISE_SENTENCE) == 3  # the head and both sections
    assert f"| GRPO w/o KL | {vs_grpo.cell('GRPO w/o KL', f'{DS} pass@1').text()} |" in md
    # each table states its family and its power below it
    family = sum(c.interval.has_interval for _, cells in vs_grpo.rows for c in cells if isinstance(c, Diff))
    assert family == 4  # w/o KL and Branch at pass@1 and pass@16; forward KL has one seed, DAPO no matrices
    assert f"- Family: {family} comparisons with an interval (t, 95%);" in md
    assert "- Smallest difference detectable with 80% power (two-sided 5%), median over rows: " in md
    tables_dir = synth["root"] / "default" / "tables"
    rows = list(csv.DictReader(io.StringIO((tables_dir / "diff_vs_base.csv").read_text())))
    row = next(r for r in rows if r["row"] == "GRPO w/o KL" and r["column"] == f"{DS} pass@16")
    assert float(row["diff"]) == nokl.interval.diff and row["marked"] == "True"
    assert nokl.text() in (tables_dir / "diff_vs_base.tex").read_text()

    # fewer than 5 seeds: one warning line, in the report and in Report.warnings
    assert rep.warnings == [
        "fewer than 5 training seeds for Table 1 methods: GRPO (3), GRPO w/o KL (3), GRPO + forward KL (1), "
        "GRPO + Branch (3), DAPO w/o KL (1); their intervals rest on few seeds (--min-seeds 5)"
    ]
    assert f"**Warning:** {rep.warnings[0]}\n" in md

    # Figure 3: the curve with the bootstrap band
    assert rep.figures[f"passk_{DS}"].stat().st_size > 1000
    band = "bands: 95% bootstrap interval over problems and training seeds"
    band += " (mean ± std over seeds for DAPO w/o KL)"  # its run logged a curve but no matrices
    assert band in md


def logged_values(method: str, k: int) -> np.ndarray:
    """(seeds, problems) per-problem pass@k of a method's trained runs, from the matrices the store holds."""
    return np.stack([bootstrap.per_problem_pass_at_k(matrices(method, s), [k])[0] for s in SYNTH[method]])


def test_report_paired_seeds_and_the_primarys_power(synth):
    """--paired-seeds: a row run on the reference's seeds (GRPO w/o KL, GRPO + Branch: 1, 2, 3) gets
    difference(..., paired=True) on the same arrays; one whose seeds differ (forward KL: seed 1) keeps the
    unpaired interval, named in one line below the table; against the start model nothing changes. The
    text around the tables says which interval each got, and the primary states its interval, which, and
    the smallest difference it would detect at 80% power, paired or not."""
    primary = ("grpo_nokl", DS, 16)
    rep = make(synth, "paired", paired_seeds=True, primary=primary)
    plain = make(synth, "unpaired_primary", primary=primary)
    vs_grpo, plain_grpo = rep.tables["diff_vs_reference"], plain.tables["diff_vs_reference"]
    for k in KS:
        column = f"{DS} pass@{k}"
        ref = logged_values("grpo", k)
        for method, row in (("grpo_nokl", "GRPO w/o KL"), ("grpo_branch", "GRPO + Branch")):
            values = logged_values(method, k)
            assert vs_grpo.cell(row, column).interval == bootstrap.difference(values, ref, paired=True)
            assert plain_grpo.cell(row, column).interval == bootstrap.difference(values, ref)
        fkl = vs_grpo.cell("GRPO + forward KL", column)
        assert fkl.interval == bootstrap.difference(logged_values("grpo_fkl", k), ref)
        assert rep.tables["diff_vs_base"].rows == plain.tables["diff_vs_base"].rows
    # the seeds move both rows' runs together (the same jitter): pairing removes it, the interval narrows
    nokl, plain_nokl = (t.cell("GRPO w/o KL", f"{DS} pass@1").interval for t in (vs_grpo, plain_grpo))
    assert nokl.diff == plain_nokl.diff and nokl.hi - nokl.lo < plain_nokl.hi - plain_nokl.lo

    md = rep.markdown
    section = md.split("## Differences against GRPO\n")[1].split("\n## ")[0]
    assert "interval paired by training seed (--paired-seeds:" in section
    note = "- Intervals paired by training seed (--paired-seeds), each row against GRPO on the same seeds"
    assert note in section
    unpaired = [line for line in section.splitlines() if line.startswith("- Unpaired")]
    assert unpaired == [
        "- Unpaired (each side's own seed noise), the seed sets differing from the reference's: "
        f"GRPO + forward KL on {DS} (seeds [1] vs [1, 2, 3])"
    ]
    base = md.split("## Differences against the start model\n")[1].split("\n## ")[0]
    assert "unpaired, the start model has no training seed" in base and "Intervals paired" not in base
    assert "Differences against GRPO are paired by training seed (--paired-seeds) for the rows run on" in md
    assert "paired" not in plain.markdown.split("## Which problems moved")[0]  # the default is unchanged

    # the primary: its own interval, which one, and its smallest detectable difference at 80% power
    at_16 = [t.cell("GRPO w/o KL", f"{DS} pass@16").interval for t in (vs_grpo, plain_grpo)]
    for r, i, how in zip((rep, plain), at_16, ("paired by training seed, ", ""), strict=True):
        first = r.markdown.split("\n## ")[1]
        assert first.startswith("Primary comparison (declared before the run)")
        assert f"(two-sided, Cochran-Cox t, {how}{i.df:.0f} effective df)" in first
        assert f"the smallest difference this study could detect at 80% power: {i.mde:.3f}" in first
        assert i.has_interval and i.mde > 0
    assert report.parse_args(["--paired-seeds"]).paired_seeds and not report.parse_args([]).paired_seeds


def test_report_options_reference_seed_and_no_bootstrap(synth, capsys):
    first = make(synth, "a", rng_seed=3, extra_ks=[4])
    assert first.tables["diff_vs_reference"].columns == [f"{DS} pass@1", f"{DS} pass@4", f"{DS} pass@16"]
    make(synth, "b", rng_seed=3, extra_ks=[4])
    make(synth, "c", rng_seed=4, extra_ks=[4])
    read = lambda r: (synth["root"] / r / "tables" / "diff_vs_reference.csv").read_text()  # noqa: E731
    assert read("a") == read("b") == read("c")  # the intervals draw nothing: the RNG moves the bands only

    out = synth["root"] / "cli" / "r.md"
    argv = [
        "--tracking-uri",
        synth["uri"],
        "--experiment",
        "boot",
        "--out",
        str(out),
        "--perplexity-max",
        "0",
    ]
    assert report.main([*argv, "--reference", "grpo_nokl", "--min-seeds", "1", "--bootstrap", "500"]) == 0
    err = capsys.readouterr().err
    assert "warning:" not in err
    md = out.read_text()
    assert "## Differences against GRPO w/o KL" in md
    assert "**Warning:**" not in md
    assert report.main([*argv, "--reference", "nope", "--seeds", "1,2"]) == 2  # named, so refused (issue 56)
    err = capsys.readouterr().err
    assert err.startswith("sage-report: --reference nope: no trained row of that name (rows: ")
    assert "--reference picks one)" in err
    assert report.main([*argv, "--seeds", "1,2"]) == 0
    err = capsys.readouterr().err
    assert "warning: fewer than 5 training seeds for Table 1 methods: GRPO (2)," in err
    assert report.main([*argv, "--bootstrap", "0"]) == 0
    md = out.read_text()
    assert "Differences" not in md and differences.NOISE_SENTENCE not in md
    assert "bands: mean ± std over training seeds" in md
