"""Pilot and replication apart (issue 48): the fork study's run means per seed group, from the committed page.

    .venv/bin/python scripts/pilot_replication.py docs/results/testbed_fork_primary.md \\
        --method grpo_fork_rare --reference grpo

Reads the per-run lines that ``scripts/positive_control.py`` printed into a page (``method seed share pass@1
pass@n (folder)``; a run printed twice, as the reference is in each comparison's block, counts once and must
read the same both times) and prints, for ``--method`` minus ``--reference`` on ``--metric``, for each seed
group of ``--groups`` (default ``1-4,5-8``: the positive control's pilot's seeds, which the study reused, and
the study's new seeds) and for all the seeds together:

- each row's mean and SD (ddof 1) of its run means, and the mean difference of run means;
- Welch's t-test on the run means (t, Welch-Satterthwaite df, two-sided p, se);
- the paired-by-seed t-test on the run means (the differences of the seeds both rows have: t, df, two-sided
  p, se, 95% interval);
- the correlation (Pearson) of the two rows' run means across the seeds they share;
- the smallest difference detectable at 80% power, two-sided 5%, from the run means: unpaired,
  (t_0.975 + t_0.80) x the Welch se with the t quantiles at min(n) - 1 df (the seed part of
  ``analysis/bootstrap.difference``, Hsu's df; that interval's problem part needs the per-problem data,
  which this page does not hold), and (1.96 + 0.84) x the same se; paired, (t_0.975 + t_0.80) at n - 1 df
  x the paired se.

These are tests on run means only (one number per run), not the per-pair interval over problems and seeds
that the page itself prints; with 100 problems x 256 samples per run the seed part dominates that interval.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PAGE = REPO / "docs" / "results" / "testbed_fork_primary.md"
METRICS = ("share", "pass@1", "pass@n")
RUN_LINE = re.compile(r"^\s+(\S+)\s+(\d+)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s+(\d+(?:\.\d+)?)\s+\(")
POWER = 0.80
LEVEL = 0.95


def read_runs(text: str) -> dict[tuple[str, int], tuple[float, float, float]]:
    """(method, seed) -> (share, pass@1, pass@n) from a page's per-run lines. A run printed more than once
    must print the same figures each time."""
    runs: dict[tuple[str, int], tuple[float, float, float]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        m = RUN_LINE.match(line)
        if not m:
            continue
        key = (m.group(1), int(m.group(2)))
        figures = (float(m.group(3)), float(m.group(4)), float(m.group(5)))
        if key in runs and runs[key] != figures:
            raise ValueError(f"line {number}: {key[0]} seed {key[1]} reads {figures}, earlier {runs[key]}")
        runs[key] = figures
    return runs


def parse_groups(spec: str) -> list[tuple[int, int]]:
    """'1-4,5-8' -> [(1, 4), (5, 8)]."""
    groups = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        lo_i, hi_i = int(lo), int(hi or lo)
        if hi_i < lo_i:
            raise ValueError(f"seed group {part!r}: its end is below its start")
        groups.append((lo_i, hi_i))
    return groups


@dataclass(frozen=True)
class Comparison:
    seeds: list[int]  # the seeds both rows have
    method_mean: float
    method_sd: float
    ref_mean: float
    ref_sd: float
    diff: float  # mean of the method's run means minus mean of the reference's
    welch_t: float
    welch_df: float
    welch_p: float
    welch_se: float  # sqrt(var_m / n_m + var_r / n_r)
    paired_diff: float  # mean of the per-seed differences (the seeds both rows have)
    paired_t: float
    paired_df: int
    paired_p: float
    paired_lo: float
    paired_hi: float
    paired_se: float  # sd of the per-seed differences / sqrt(n)
    correlation: float
    mde_unpaired: float  # (t_.975 + t_.80) at min(n) - 1 df, x the Welch se
    mde_normal: float  # (z_.975 + z_.80) x the Welch se
    mde_paired: float  # (t_.975 + t_.80) at n - 1 df, x the paired se


def compare(method: dict[int, float], reference: dict[int, float]) -> Comparison:
    """``method`` minus ``reference``, each seed -> run mean; every test needs 2 seeds on each side (the
    paired ones 2 shared seeds)."""
    if len(method) < 2 or len(reference) < 2:
        raise ValueError(f"each row needs 2 seeds: {len(method)} and {len(reference)}")
    m, r = np.array(list(method.values())), np.array(list(reference.values()))
    welch = stats.ttest_ind(m, r, equal_var=False)
    se = math.sqrt(m.var(ddof=1) / len(m) + r.var(ddof=1) / len(r))
    shared = sorted(set(method) & set(reference))
    if len(shared) < 2:
        raise ValueError(f"the paired test needs 2 seeds both rows have: {shared}")
    pm, pr = np.array([method[s] for s in shared]), np.array([reference[s] for s in shared])
    d = pm - pr
    df = len(d) - 1
    paired_se = float(d.std(ddof=1)) / math.sqrt(len(d))
    crit = float(stats.t.ppf(0.5 + LEVEL / 2, df))
    paired_t = float(d.mean()) / paired_se if paired_se > 0 else math.copysign(math.inf, d.mean())
    hsu = min(len(m), len(r)) - 1
    return Comparison(
        seeds=shared,
        method_mean=float(m.mean()),
        method_sd=float(m.std(ddof=1)),
        ref_mean=float(r.mean()),
        ref_sd=float(r.std(ddof=1)),
        diff=float(m.mean() - r.mean()),
        welch_t=float(welch.statistic),
        welch_df=float(welch.df),
        welch_p=float(welch.pvalue),
        welch_se=se,
        paired_diff=float(d.mean()),
        paired_t=paired_t,
        paired_df=df,
        paired_p=float(2 * stats.t.sf(abs(paired_t), df)),
        paired_lo=float(d.mean()) - crit * paired_se,
        paired_hi=float(d.mean()) + crit * paired_se,
        paired_se=paired_se,
        correlation=float(np.corrcoef(pm, pr)[0, 1]),
        mde_unpaired=float(stats.t.ppf(0.5 + LEVEL / 2, hsu) + stats.t.ppf(POWER, hsu)) * se,
        mde_normal=float(stats.norm.ppf(0.5 + LEVEL / 2) + stats.norm.ppf(POWER)) * se,
        mde_paired=float(crit + stats.t.ppf(POWER, df)) * paired_se,
    )


def report(
    runs: dict[tuple[str, int], tuple[float, float, float]],
    method: str,
    reference: str,
    metric: str = "share",
    groups: Sequence[tuple[int, int]] = ((1, 4), (5, 8)),
) -> str:
    column = METRICS.index(metric)
    rows = {}
    for name in (method, reference):
        rows[name] = {s: f[column] for (n, s), f in sorted(runs.items()) if n == name}
        if not rows[name]:
            known = sorted({n for n, _ in runs})
            raise ValueError(f"no runs of {name!r} on the page (it has {', '.join(known)})")
    every = sorted(set(rows[method]) | set(rows[reference]))
    lines = [f"{method} minus {reference}, {metric}, on run means (one number per run):"]
    for lo, hi in [*groups, (every[0], every[-1])]:
        label = f"seeds {lo}-{hi}"
        part = [{s: v for s, v in rows[n].items() if lo <= s <= hi} for n in (method, reference)]
        try:
            c = compare(*part)
        except ValueError as e:
            lines.append(f"  {label}: {e}")
            continue
        lines += [
            f"  {label}: {method} {c.method_mean:.5f} (sd {c.method_sd:.5f}, {len(part[0])} runs), "
            f"{reference} {c.ref_mean:.5f} (sd {c.ref_sd:.5f}, {len(part[1])} runs); "
            f"difference of means {c.diff:+.5f}",
            f"    Welch: t {c.welch_t:.2f}, df {c.welch_df:.1f}, p {c.welch_p:.3g}, se {c.welch_se:.5f}",
            f"    paired by seed ({len(c.seeds)} seeds): {c.paired_diff:+.5f} "
            f"[{c.paired_lo:+.5f}, {c.paired_hi:+.5f}], t {c.paired_t:.2f}, df {c.paired_df}, "
            f"p {c.paired_p:.3g}, se {c.paired_se:.5f}; correlation of run means {c.correlation:.2f}",
            f"    detectable at 80% power (two-sided 5%): unpaired {c.mde_unpaired:.5f} "
            f"(t at {min(len(part[0]), len(part[1])) - 1} df; normal {c.mde_normal:.5f}), "
            f"paired {c.mde_paired:.5f}",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("page", nargs="?", type=Path, default=DEFAULT_PAGE, help="a page with per-run lines")
    p.add_argument("--method", default="grpo_fork_rare")
    p.add_argument("--reference", default="grpo")
    p.add_argument("--metric", choices=METRICS, default="share")
    p.add_argument("--groups", default="1-4,5-8", help="seed groups, e.g. 1-4,5-8 (all seeds are added)")
    args = p.parse_args(argv)
    try:
        runs = read_runs(args.page.read_text(encoding="utf-8"))
        if not runs:
            raise ValueError(f"{args.page}: no per-run lines")
        print(report(runs, args.method, args.reference, args.metric, parse_groups(args.groups)))
    except (OSError, ValueError) as e:
        print(f"pilot_replication: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
