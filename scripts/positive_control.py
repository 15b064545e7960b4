"""The positive control of issue 42: does an oracle move the declared primary, and with what power at 8 seeds?

    .venv/bin/python scripts/positive_control.py outputs/positive_control/pilot \\
        --method grpo_fork_rare --reference grpo --seeds 8

Reads every finished run folder under the given sweep folders (``config.yaml`` for its method and seed, the
final evaluation's cells ``eval/trained/<dataset>/<key>_seed<k>/`` for its samples), and prints, per run and
per arm, the primary, the rare strategy's (``round``'s) share of the samples on tail prompts
(``rare_share/tail`` of ``arith_tail``, computed per problem from the cell's completions with
``classify_strategy``, as ``sage.eval.analyses.tier_figures`` computes the logged figure), and as secondaries
tail pass@1 and pass@n. Each difference (method minus reference) gets the per-pair interval of
``analysis/bootstrap.py`` (``difference``) over the pilot's seeds. The power at ``--seeds`` seeds per arm is
estimated two ways from the pilot:

- by simulation: ``--sims`` studies of ``--seeds`` seeds per arm, each problem's share drawn binomially from
  the arm's per-problem pilot profile (seed-averaged) shifted by a normal seed effect whose SD is the pilot
  arm's own between-seed SD less its sampling part, each study's interval by ``bootstrap.difference``; the
  power is the share of studies whose interval excludes 0 on the side of the pilot's effect;
- by the normal approximation: Phi(|d| / se - c), with se^2 the pilot's variance parts rescaled to ``--seeds``
  seeds (seed parts divided by the seeds, the problem part as is) and c the interval's own Cochran-Cox
  critical value at 7 and P - 1 degrees of freedom.

Both take the pilot's effect and seed SDs as true, which a pilot of a few seeds measures roughly: the script
also prints the power with each arm's seed variance at its one-sided 80% upper chi-square bound.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from scipy import special, stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis import bootstrap  # noqa: E402
from sage.testbed.task import RARE_STRATEGY, classify_strategy  # noqa: E402


@dataclass(frozen=True)
class Run:
    folder: Path
    method: str
    seed: int
    ids: list[str]
    share: np.ndarray  # (problems,) the rare strategy's share of each problem's samples
    correct: np.ndarray  # (problems, samples) bool, the first evaluation seed's


def problem_shares(completions: Sequence[Sequence[str]], strategy: str = RARE_STRATEGY) -> np.ndarray:
    """Each problem's share of samples that follow ``strategy``: the per-problem parts of the logged
    ``rare_share/<tier>`` (which is their mean when every problem has the same number of samples)."""
    return np.array([sum(classify_strategy(t) == strategy for t in c) / len(c) for c in completions])


def load_run(folder: Path, dataset: str, methods: Sequence[str] | None = None) -> Run | None:
    """A finished run's final evaluation of ``dataset``; None if the folder holds none (a run cut short) or
    its method is not one of ``methods`` (a study's other rows, whose completions are not read)."""
    cells = sorted((folder / "eval" / "trained" / dataset).glob("*_seed*/completions.json"))
    if not cells or not (folder / "config.yaml").is_file():
        return None
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    if methods is not None and cfg["method"] not in methods:
        return None
    shares, correct, ids = [], [], None
    for c in cells:  # one cell per evaluation seed: their per-problem shares are averaged
        meta = json.loads((c.parent / "meta.json").read_text())
        if ids is not None and meta["ids"] != ids:
            raise ValueError(f"{c.parent}: its problems differ from the run's other cells")
        ids = meta["ids"]
        shares.append(problem_shares(json.loads(c.read_text())))
        correct.append(np.load(c.parent / "correct.npy"))
    return Run(folder, cfg["method"], int(cfg["seed"]), ids, np.mean(shares, axis=0), correct[0])


def arm(runs: list[Run], method: str, figure: str) -> tuple[list[int], np.ndarray]:
    """(seeds, (seeds, problems) values) of one arm, sorted by seed; ``figure``: share, pass@1 or pass@n."""
    chosen = sorted((r for r in runs if r.method == method), key=lambda r: r.seed)
    if len({tuple(r.ids) for r in runs}) != 1:
        raise ValueError("the runs were not evaluated on the same problems in the same order")
    if figure == "share":
        values = [r.share for r in chosen]
    else:
        k = 1 if figure == "pass@1" else chosen[0].correct.shape[1]
        values = [bootstrap.per_problem_pass_at_k([r.correct], [k])[0] for r in chosen]
    return [r.seed for r in chosen], np.array(values)


def seed_sd(values: np.ndarray) -> float:
    """The SD of a run's true mean between training seeds: the run means' variance less the sampling
    part each holds (the residual variance over the problems), floored at 0."""
    noise = bootstrap.seed_noise(values)
    return math.sqrt(max(0.0, noise.run_var - noise.resid_var / values.shape[1]))


def interaction_var(method: np.ndarray, reference: np.ndarray) -> float:
    """The variance over problems of the method's true gain (sigma_alpha^2 of ``analysis/bootstrap.py``):
    the spread of the seed-averaged per-problem difference less the sampling noise it holds, floored at 0,
    as ``bootstrap.difference`` estimates its problem part (times the problems)."""
    sides = [(bootstrap.seed_noise(v), len(v)) for v in (method, reference)]
    resid = sum(n.resid_var / s for n, s in sides)
    spread = float((method.mean(axis=0) - reference.mean(axis=0)).var(ddof=1))
    return max(0.0, spread - resid)


def simulate_power(
    method: np.ndarray,
    reference: np.ndarray,
    *,
    seeds: int,
    samples: int,
    sims: int,
    rng: np.random.Generator,
    seed_sds: tuple[float, float] | None = None,
) -> float:
    """Share of simulated studies (``seeds`` per arm) whose per-pair interval excludes 0 on the side of
    the pilot's effect. True per-problem shares: the two arms' pooled seed-averaged profile, plus each
    arm's own mean offset, plus for the method a gain that varies over problems (normal, variance
    ``interaction_var``), plus a normal seed effect per run of SD ``seed_sds`` (default: each pilot arm's
    own, ``seed_sd``), clipped to [0, 1]; each problem's observed share binomial over ``samples``
    samples, as an evaluation draws it. (Each arm's own profile would carry its pilot's sampling noise
    into the difference as a spurious gain that varies over problems.)"""
    sds = seed_sds or (seed_sd(method), seed_sd(reference))
    pooled = (method.mean(axis=0) + reference.mean(axis=0)) / 2  # (problems,)
    centre = pooled.mean()
    offsets = (method.mean() - centre, reference.mean() - centre)
    alpha_sd = math.sqrt(interaction_var(method, reference))
    sign = np.sign(method.mean() - reference.mean())
    hits = 0
    for _ in range(sims):
        gain = rng.normal(0.0, alpha_sd, pooled.shape)  # the method's gain by problem, about its mean
        drawn = []
        for offset, extra, sd in zip(offsets, (gain, 0.0), sds, strict=True):
            true = pooled + offset + extra + rng.normal(0.0, sd, (seeds, 1))  # (seeds, problems)
            drawn.append(rng.binomial(samples, np.clip(true, 0.0, 1.0)) / samples)
        iv = bootstrap.difference(drawn[0], drawn[1])
        hits += bool((iv.lo > 0) if sign > 0 else (iv.hi < 0))
    return hits / sims


def normal_power(method: np.ndarray, reference: np.ndarray, *, seeds: int) -> tuple[float, float, float]:
    """(power, se, critical value) at ``seeds`` seeds per arm by the normal approximation: the pilot's
    variance parts of ``bootstrap.difference`` with each side's seed part over ``seeds`` seeds."""
    sides = [bootstrap.seed_noise(method), bootstrap.seed_noise(reference)]
    problems = method.shape[1]
    # the problem part is the true gain's spread over problems: difference() removes the sampling noise
    # from the per-problem spread, so in expectation that is what it keeps, whatever the seeds
    parts = [sum(n.run_var for n in sides) / seeds, interaction_var(method, reference) / problems]
    crit = bootstrap.critical(parts, [seeds - 1, problems - 1], 1 - bootstrap.LEVEL)
    se = math.sqrt(sum(parts))
    d = abs(float(method.mean() - reference.mean()))
    return float(special.ndtr(d / se - crit) + special.ndtr(-d / se - crit)), se, crit


def upper_seed_sd(values: np.ndarray, confidence: float = 0.8) -> float:
    """The arm's seed SD (``seed_sd``) at the one-sided ``confidence`` upper bound of its run variance
    (chi-square on seeds - 1 degrees of freedom), less the sampling part as in ``seed_sd``."""
    noise = bootstrap.seed_noise(values)
    upper = noise.run_var * noise.df / stats.chi2.ppf(1 - confidence, noise.df)
    return math.sqrt(max(0.0, upper - noise.resid_var / values.shape[1]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="sweep folders holding the pilot's run folders")
    ap.add_argument("--method", default="grpo_fork_rare")
    ap.add_argument("--reference", default="grpo")
    ap.add_argument("--dataset", default="arith_tail")
    ap.add_argument(
        "--seeds",
        type=int,
        default=8,
        help="seeds per arm of the study whose power is estimated; 0 for the differences alone (a "
        "study's own comparison, which estimates no power)",
    )
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--rng-seed", type=int, default=0)
    args = ap.parse_args(argv)

    runs = [
        r
        for s in args.sweeps
        for f in sorted(s.rglob("config.yaml"))
        if (r := load_run(f.parent, args.dataset, (args.method, args.reference)))
    ]
    if not runs:
        print(f"no finished run of {args.method} or {args.reference} under {args.sweeps}", file=sys.stderr)
        return 1
    print(
        f"{len(runs)} runs, {len(runs[0].ids)} {args.dataset} problems x {runs[0].correct.shape[1]} samples"
    )
    print("\nper run: method, seed, rare share, pass@1, pass@n (folder)")
    for r in sorted(runs, key=lambda r: (r.method, r.seed)):
        pass1 = r.correct.mean()
        passn = r.correct.any(axis=1).mean()
        print(f"  {r.method:16s} {r.seed:2d}  {r.share.mean():.4f}  {pass1:.4f}  {passn:.3f}  ({r.folder})")

    print(f"\n{args.method} minus {args.reference}, per-pair interval (analysis/bootstrap.py difference):")
    for figure in ("share", "pass@1", "pass@n"):
        seeds_m, m = arm(runs, args.method, figure)
        seeds_r, ref = arm(runs, args.reference, figure)
        iv = bootstrap.difference(m, ref)
        print(
            f"  {figure:7s} {m.mean():.4f} (sd {m.mean(axis=1).std(ddof=1):.4f}, seeds {seeds_m}) - "
            f"{ref.mean():.4f} (sd {ref.mean(axis=1).std(ddof=1):.4f}, seeds {seeds_r}) = {iv.diff:+.4f} "
            f"[{iv.lo:.4f}, {iv.hi:.4f}], p = {iv.p:.3g}"
        )

    if args.seeds == 0:
        return 0
    _, m = arm(runs, args.method, "share")
    _, ref = arm(runs, args.reference, "share")
    if min(len(m), len(ref)) < 2:  # nothing measures an arm's seed noise: no interval, no power
        print(
            f"\nno power estimate: {args.method} has {len(m)} seed(s), {args.reference} {len(ref)}; "
            "each arm needs 2"
        )
        return 1
    samples = runs[0].correct.shape[1]
    rng = np.random.default_rng(args.rng_seed)
    sds = (seed_sd(m), seed_sd(ref))
    power, se, crit = normal_power(m, ref, seeds=args.seeds)
    print(f"\nprimary (rare share), power at {args.seeds} seeds per arm:")
    print(f"  seed SD beyond sampling: {args.method} {sds[0]:.4f}, {args.reference} {sds[1]:.4f}")
    print(f"  normal approximation: power {power:.3f} (se {se:.4f}, critical value {crit:.3f})")
    sim = simulate_power(m, ref, seeds=args.seeds, samples=samples, sims=args.sims, rng=rng)
    print(f"  simulation ({args.sims} studies): power {sim:.3f}")
    upper = (upper_seed_sd(m), upper_seed_sd(ref))
    sim_upper = simulate_power(
        m, ref, seeds=args.seeds, samples=samples, sims=args.sims, rng=rng, seed_sds=upper
    )
    print(
        f"  simulation, seed SDs at their 80% upper bounds ({upper[0]:.4f}, {upper[1]:.4f}): "
        f"power {sim_upper:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
