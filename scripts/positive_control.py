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
  critical value (the seed part on ``bootstrap.seed_df(seeds)`` degrees of freedom, the problem part on
  P - 1).

Both take the pilot's effect and seed SDs as true, which a pilot of a few seeds measures roughly: the script
also prints the power with each arm's seed variance at its one-sided 80% upper chi-square bound.

Options for a study's own comparison (each refusal is one line on stderr, exit code 2, before any completion
is read):

- ``--study-seeds 1-8`` (a comma list of seeds and ranges): only runs of those training seeds count, and an
  arm that lacks one of them, or holds two runs of one, is refused; without it every finished run counts;
- ``--paired``: the interval paired by training seed (``bootstrap.difference(..., paired=True)``), for two
  arms of the same seeds (refused otherwise);
- ``--split pilot=1-4,5-8``: after the whole study's differences, each seed group's own (a seed or a range,
  with an optional label), e.g. a pilot and its replication apart;
- ``--save-data FILE.json`` writes the per-problem counts that everything printed is computed from (the data
  file, ``data_file``), and ``--data FILE.json`` instead of sweep folders prints the same text from it.

With ``--paired`` or ``--split`` each difference also gets the smallest difference its interval would detect
at 80% power. Runs evaluated on other problems than the others (a method rerun on other problems) are
refused, naming the two run folders.

One job, in one file on purpose: a study's primary from its runs (or data file) to the printed analysis, so
that each results page names one script for its numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from scipy import special, stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from analysis import bootstrap  # noqa: E402
from sage.testbed.task import RARE_STRATEGY, classify_strategy  # noqa: E402

DATA_FORMAT = "scripts/positive_control.py data, version 1"


class Refusal(Exception):
    """A one-line reason the script will not compare the runs it was given (exit code 2)."""


@dataclass(frozen=True)
class Run:
    folder: Path
    method: str
    seed: int
    ids: list[str]
    share: np.ndarray  # (problems,) the rare strategy's share of each problem's samples
    correct: np.ndarray  # (problems, samples) bool, the first evaluation seed's


@dataclass(frozen=True)
class Found:
    """A finished run as its config and its cells' ``meta.json`` describe it: the cheap part of reading it
    (its completions, the expensive part, are read by ``count_run``)."""

    folder: Path
    method: str
    seed: int
    ids: list[str]
    cells: list[Path] = field(repr=False)  # the cells' folders, one per evaluation seed, sorted


@dataclass(frozen=True)
class Counts:
    """A run as integers, all that the script prints is computed from: per evaluation cell, each problem's
    samples and how many follow the rare strategy; the first cell's correct samples per problem, of
    ``samples`` (its ``correct.npy``'s columns). ``folder`` is the run folder's path as it was found."""

    folder: str
    method: str
    seed: int
    ids: list[str]
    cell_names: list[str]
    cell_samples: list[list[int]]  # per cell, per problem
    cell_rare: list[list[int]]  # per cell, per problem
    samples: int
    correct: list[int]  # per problem, of the first cell

    def run(self) -> Run:
        """The run's per-problem shares (each cell's rare samples over its samples, averaged over the cells)
        and its first cell's correctness as a matrix (each problem's correct samples first: pass@k and
        the means printed depend on the counts alone)."""
        cells = zip(self.cell_rare, self.cell_samples, strict=True)
        shares = [np.asarray(r, dtype=np.int64) / np.asarray(n, dtype=np.int64) for r, n in cells]
        correct = np.arange(self.samples)[None, :] < np.asarray(self.correct, dtype=np.int64)[:, None]
        return Run(Path(self.folder), self.method, self.seed, self.ids, np.mean(shares, axis=0), correct)


def problem_shares(completions: Sequence[Sequence[str]], strategy: str = RARE_STRATEGY) -> np.ndarray:
    """Each problem's share of samples that follow ``strategy``: the per-problem parts of the logged
    ``rare_share/<tier>`` (which is their mean when every problem has the same number of samples)."""
    return np.array([sum(classify_strategy(t) == strategy for t in c) / len(c) for c in completions])


def find_run(folder: Path, dataset: str, methods: Sequence[str] | None = None) -> Found | None:
    """A finished run's final evaluation of ``dataset`` without its completions; None if the folder holds
    none (a run cut short) or its method is not one of ``methods`` (a study's other rows)."""
    cells = sorted((folder / "eval" / "trained" / dataset).glob("*_seed*/completions.json"))
    if not cells or not (folder / "config.yaml").is_file():
        return None
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    if methods is not None and cfg["method"] not in methods:
        return None
    ids = None
    for c in cells:  # one cell per evaluation seed, all on the same problems
        meta = json.loads((c.parent / "meta.json").read_text())
        if ids is not None and meta["ids"] != ids:
            raise Refusal(f"{c.parent}: its {dataset} problems differ from its run's other cells")
        ids = meta["ids"]
    return Found(folder, cfg["method"], int(cfg["seed"]), ids, [c.parent for c in cells])


def count_run(found: Found) -> Counts:
    """The run's counts from its cells' completions (classified one by one: the expensive part) and the
    first cell's ``correct.npy``."""
    samples, rare = [], []
    for cell in found.cells:
        completions = json.loads((cell / "completions.json").read_text())
        samples.append([len(c) for c in completions])
        rare.append([sum(classify_strategy(t) == RARE_STRATEGY for t in c) for c in completions])
    correct = np.asarray(np.load(found.cells[0] / "correct.npy"), dtype=bool)
    return Counts(
        str(found.folder),
        found.method,
        found.seed,
        found.ids,
        [c.name for c in found.cells],
        samples,
        rare,
        int(correct.shape[1]),
        [int(c) for c in correct.sum(axis=1)],
    )


def load_run(folder: Path, dataset: str, methods: Sequence[str] | None = None) -> Run | None:
    """A finished run's final evaluation of ``dataset``; None if the folder holds none (a run cut short) or
    its method is not one of ``methods`` (a study's other rows, whose completions are not read)."""
    found = find_run(folder, dataset, methods)
    return count_run(found).run() if found else None


def parse_seeds(spec: str) -> list[int]:
    """``"1-4,7"`` -> [1, 2, 3, 4, 7]: a comma list of seeds and ranges (both ends included)."""
    seeds: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m[2] is not None and int(m[2]) < int(m[1])):
            raise argparse.ArgumentTypeError(f"not a seed or a range of seeds (such as 1-4): {part!r}")
        seeds.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return sorted(seeds)


@dataclass(frozen=True)
class SeedGroup:
    label: str  # "seeds 1-4 (pilot)"
    seeds: list[int]


def parse_split(spec: str) -> list[SeedGroup]:
    """``"pilot=1-4,5-8"`` -> seed groups, each a seed or a range with an optional ``label=``."""
    groups = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(?:([^=]*\S)\s*=)?\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m[3] is not None and int(m[3]) < int(m[2])):
            raise argparse.ArgumentTypeError(f"not a seed group such as 1-4 or pilot=1-4: {part!r}")
        lo, hi = int(m[2]), int(m[3] or m[2])
        label = f"seed {lo}" if lo == hi else f"seeds {lo}-{hi}"
        groups.append(SeedGroup(label + (f" ({m[1]})" if m[1] else ""), list(range(lo, hi + 1))))
    return groups


def sage_commit() -> str | None:
    """The commit of the sage checkout this script is in; None where git cannot tell."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _one_or_list(values: list[int]) -> int | list[int]:
    """A per-problem list whose entries are all equal as that one number (samples per problem)."""
    return values[0] if values and all(v == values[0] for v in values) else values


def data_file(counts: Sequence[Counts], settings: dict) -> str:
    """The data file's text: ``settings``, the problem ids once (every run's, which ``check_problems``
    has made equal), and per run in the order found its method, seed, folder, samples and correct samples
    per problem (of its first cell), and per evaluation cell its name, samples per problem (one number
    when every problem has the same) and rare-strategy samples per problem. Sorted keys, integers, no
    time stamps: the same runs and command give the same bytes."""
    runs = [
        {
            "folder": c.folder,
            "method": c.method,
            "seed": c.seed,
            "samples": c.samples,
            "correct": c.correct,
            "cells": [
                {"name": name, "samples": _one_or_list(n), "rare": r}
                for name, n, r in zip(c.cell_names, c.cell_samples, c.cell_rare, strict=True)
            ],
        }
        for c in counts
    ]
    doc = {"format": DATA_FORMAT, "settings": settings, "ids": counts[0].ids if counts else [], "runs": runs}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def read_data_file(path: Path) -> tuple[dict, list[Counts]]:
    """(settings, counts) from a data file ``data_file`` wrote."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != DATA_FORMAT:
            raise Refusal(f"{path}: not a data file of this script ({DATA_FORMAT!r})")
        counts = []
        for r in doc["runs"]:
            cells = r["cells"]
            problems = len(doc["ids"])
            samples = [
                [c["samples"]] * problems if isinstance(c["samples"], int) else c["samples"] for c in cells
            ]
            counts.append(
                Counts(
                    r["folder"],
                    r["method"],
                    int(r["seed"]),
                    doc["ids"],
                    [c["name"] for c in cells],
                    samples,
                    [c["rare"] for c in cells],
                    int(r["samples"]),
                    r["correct"],
                )
            )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise Refusal(f"{path}: cannot read it as a data file ({type(e).__name__}: {e})") from e
    return doc["settings"], counts


def read_data_files(paths: Sequence[Path]) -> tuple[dict, list[Counts]]:
    """(settings, counts) of several data files as one: their runs together, refused in one line where a
    file compares another dataset, method or reference than the first (two runs of one seed in an arm are
    refused with the study's other checks)."""

    def sources_of(path: Path, settings: dict) -> list[dict]:  # a merged file's own sources, kept
        return settings.get("sources") or [{"file": str(path), "sage_commit": settings.get("sage_commit")}]

    settings, counts = read_data_file(paths[0])
    sources = sources_of(paths[0], settings)
    for path in paths[1:]:
        other, more = read_data_file(path)
        for key in ("dataset", "method", "reference"):
            if other[key] != settings[key]:
                raise Refusal(f"{path} has {key} {other[key]!r}, but {paths[0]} has {settings[key]!r}")
        counts += more
        sources += sources_of(path, other)
    return {**settings, "sources": sources}, counts


def saved_argv(argv: Sequence[str]) -> list[str]:
    """The command line as the data file keeps it: without ``--save-data`` and its file, so that two saves
    of the same runs by the same command are the same bytes."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--save-data":
            skip = True
        elif not a.startswith("--save-data="):
            out.append(a)
    return out


def check_study(
    found: Sequence[Found | Counts],
    method: str,
    reference: str,
    dataset: str,
    *,
    study_seeds: list[int] | None,
    paired: bool,
    split: list[SeedGroup] | None,
) -> None:
    """Refuse (one line) what the comparison cannot use: runs on other problems than the first's, an arm
    without a run of a seed the study or a split group lists, two runs of one seed in an arm (with
    ``--study-seeds`` or ``--paired``), and two arms of other seeds under ``--paired``."""
    check_problems(found, dataset)
    seeds = {a: sorted(r.seed for r in found if r.method == a) for a in (method, reference)}
    if study_seeds is not None:
        missing = {a: sorted(set(study_seeds) - set(s)) for a, s in seeds.items()}
        if any(missing.values()):
            said = "; ".join(f"{a} has no run of seed(s) {_seeds(m)}" for a, m in missing.items() if m)
            raise Refusal(f"the study's seeds are {_seeds(study_seeds)}, but {said}")
    if study_seeds is not None or paired:
        for a in (method, reference):
            folders: dict[int, list[str]] = {}
            for r in found:
                if r.method == a:
                    folders.setdefault(r.seed, []).append(str(r.folder))
            for seed, fs in folders.items():
                if len(fs) > 1:
                    raise Refusal(f"{a} has {len(fs)} runs of seed {seed}: {' and '.join(fs)}")
    if paired and seeds[method] != seeds[reference]:
        raise Refusal(
            f"--paired pairs runs by training seed, but {method} has seeds {_seeds(seeds[method])} "
            f"and {reference} {_seeds(seeds[reference])}"
        )
    for group in split or []:
        missing = {a: sorted(set(group.seeds) - set(s)) for a, s in seeds.items()}
        if any(missing.values()):
            said = "; ".join(f"{a} has no run of seed(s) {_seeds(m)}" for a, m in missing.items() if m)
            raise Refusal(f"--split's {group.label}: {said}")


def check_problems(found: Sequence[Found | Counts], dataset: str) -> None:
    """Refuse runs not evaluated on the first run's problems in its order, naming the two run folders."""
    if not found:
        return
    first = found[0]
    for r in found[1:]:
        if r.ids != first.ids:
            where = next((i for i, (a, b) in enumerate(zip(first.ids, r.ids, strict=False)) if a != b), None)
            how = (
                f"{len(first.ids)} and {len(r.ids)} problems"
                if where is None
                else f"problem {where}: {first.ids[where]} and {r.ids[where]}"
            )
            raise Refusal(
                f"{first.folder} and {r.folder} were not evaluated on the same {dataset} problems in the "
                f"same order ({how}): a run evaluated on other problems cannot be compared"
            )


def _seeds(seeds: Sequence[int]) -> str:
    return ", ".join(map(str, seeds))


def arm(
    runs: list[Run], method: str, figure: str, seeds: Sequence[int] | None = None
) -> tuple[list[int], np.ndarray]:
    """(seeds, (seeds, problems) values) of one arm, sorted by seed; ``figure``: share, pass@1 or pass@n;
    ``seeds``: only the runs of those training seeds (default: all)."""
    chosen = sorted(
        (r for r in runs if r.method == method and (seeds is None or r.seed in seeds)), key=lambda r: r.seed
    )
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
    effect: float | None = None,
) -> float:
    """Share of simulated studies (``seeds`` per arm) whose per-pair interval excludes 0 on the side of
    the pilot's effect (of ``effect`` when given: the arms' true difference, method minus reference, set to
    it about their pooled mean). True per-problem shares: the two arms' pooled seed-averaged profile, plus
    each arm's own mean offset, plus for the method a gain that varies over problems (normal, variance
    ``interaction_var``), plus a normal seed effect per run of SD ``seed_sds`` (default: each pilot arm's
    own, ``seed_sd``), clipped to [0, 1]; each problem's observed share binomial over ``samples``
    samples, as an evaluation draws it. (Each arm's own profile would carry its pilot's sampling noise
    into the difference as a spurious gain that varies over problems.)"""
    sds = seed_sds or (seed_sd(method), seed_sd(reference))
    pooled = (method.mean(axis=0) + reference.mean(axis=0)) / 2  # (problems,)
    centre = pooled.mean()
    offsets = (method.mean() - centre, reference.mean() - centre)  # +-(the pilot's difference) / 2
    if effect is not None:
        offsets = (effect / 2, -effect / 2)
    alpha_sd = math.sqrt(interaction_var(method, reference))
    sign = np.sign(offsets[0] - offsets[1])
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


def detectable_effect(
    method: np.ndarray,
    reference: np.ndarray,
    *,
    seeds: int,
    samples: int,
    sims: int,
    rng_seed: int,
    seed_sds: tuple[float, float],
    power: float = 0.8,
) -> float:
    """The smallest true difference (method minus reference, the pilot's sign) whose simulated power
    (``simulate_power`` at ``effect``) reaches ``power``, by bisection to 1/1000 of the normal
    approximation's standard error; inf where no difference of two shares reaches it. Every probe draws
    the same random numbers (``rng_seed``), so the bisection does not chase simulation noise."""
    sign = 1.0 if method.mean() >= reference.mean() else -1.0

    def reaches(d: float) -> bool:
        rng = np.random.default_rng(rng_seed)
        got = simulate_power(
            method, reference, seeds=seeds, samples=samples, sims=sims, rng=rng, seed_sds=seed_sds,
            effect=sign * d,
        )  # fmt: skip
        return got >= power

    _, se, _ = normal_power(method, reference, seeds=seeds)
    lo, hi = 0.0, 4 * se
    while not reaches(hi):
        if hi >= 1.0:  # no difference of two shares reaches that power
            return math.inf
        lo, hi = hi, min(1.0, 2 * hi)
    while hi - lo > se / 1000:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


def normal_power(method: np.ndarray, reference: np.ndarray, *, seeds: int) -> tuple[float, float, float]:
    """(power, se, critical value) at ``seeds`` seeds per arm by the normal approximation: the pilot's
    variance parts of ``bootstrap.difference`` with each side's seed part over ``seeds`` seeds."""
    sides = [bootstrap.seed_noise(method), bootstrap.seed_noise(reference)]
    problems = method.shape[1]
    # the problem part is the true gain's spread over problems: difference() removes the sampling noise
    # from the per-problem spread, so in expectation that is what it keeps, whatever the seeds
    parts = [sum(n.run_var for n in sides) / seeds, interaction_var(method, reference) / problems]
    crit = bootstrap.critical(parts, [bootstrap.seed_df(seeds), problems - 1], 1 - bootstrap.LEVEL)
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
    ap.add_argument("sweeps", nargs="*", type=Path, help="sweep folders holding the pilot's run folders")
    ap.add_argument(
        "--data",
        type=Path,
        action="append",
        help="a data file (--save-data) to read instead of sweep folders: the same output; repeated, the "
        "runs of several (a study's batches, each from its own sweep) as one study",
    )
    ap.add_argument("--method", help="default grpo_fork_rare (with --data: the data file's)")
    ap.add_argument("--reference", help="default grpo (with --data: the data file's)")
    ap.add_argument("--dataset", help="default arith_tail (with --data: the data file's)")
    ap.add_argument(
        "--seeds",
        type=int,
        default=8,
        help="seeds per arm of the study whose power is estimated; 0 for the differences alone (a "
        "study's own comparison, which estimates no power)",
    )
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--rng-seed", type=int, default=0)
    ap.add_argument(
        "--study-seeds",
        type=parse_seeds,
        metavar="1-4,7",
        help="the training seeds the study declares: only their runs count; an arm missing one is refused",
    )
    ap.add_argument(
        "--paired", action="store_true", help="the interval paired by training seed (both arms' seeds equal)"
    )
    ap.add_argument(
        "--split",
        type=parse_split,
        metavar="pilot=1-4,5-8",
        help="also each seed group's differences apart (a seed or a range each, optionally label=)",
    )
    ap.add_argument(
        "--save-data", type=Path, metavar="FILE.json", help="write the data file of what is printed"
    )
    ap.add_argument(
        "--detectable",
        action="store_true",
        help="also the smallest difference a study of --seeds seeds per arm detects with 80%% power (the "
        "simulation, seed SDs at their 80%% upper bounds): a study's smallest effect of interest",
    )
    args = ap.parse_args(argv)
    try:
        return _main(args, list(sys.argv[1:] if argv is None else argv))
    except Refusal as e:
        print(f"positive_control.py: {e}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    if (args.data is None) == (not args.sweeps):
        raise Refusal("give sweep folders or --data FILE.json (a data file --save-data wrote), not both")
    if args.detectable and args.seeds < 2:  # the simulation needs a study of seeds to size
        raise Refusal(f"--detectable needs --seeds 2 or more (the study's seeds per arm), not {args.seeds}")
    if args.data is not None:  # the counts as saved: nothing else is read
        read_settings, found = read_data_files(args.data)
        if args.dataset not in (None, read_settings["dataset"]):
            raise Refusal(f"{args.data[0]} holds {read_settings['dataset']}, not {args.dataset}")
        args.dataset = read_settings["dataset"]
        args.method = args.method or read_settings["method"]
        args.reference = args.reference or read_settings["reference"]
        found = [c for c in found if c.method in (args.method, args.reference)]
        where = ", ".join(map(str, args.data))
    else:  # configs and the cells' problem ids only: completions are read once the study is checked
        args.dataset = args.dataset or "arith_tail"
        args.method = args.method or "grpo_fork_rare"
        args.reference = args.reference or "grpo"
        found = [
            r
            for s in args.sweeps
            for f in sorted(s.rglob("config.yaml"))
            if (r := find_run(f.parent, args.dataset, (args.method, args.reference)))
        ]
        where = f"{args.sweeps}"
    if not found:
        print(f"no finished run of {args.method} or {args.reference} under {where}", file=sys.stderr)
        return 1
    if args.study_seeds is not None:
        found = [r for r in found if r.seed in args.study_seeds]
    check_study(
        found,
        args.method,
        args.reference,
        args.dataset,
        study_seeds=args.study_seeds,
        paired=args.paired,
        split=args.split,
    )
    for a in (args.method, args.reference):
        if not any(r.method == a for r in found):
            print(f"no finished run of {a} under {where}", file=sys.stderr)
            return 1
    counts = found if args.data is not None else [count_run(f) for f in found]
    if args.save_data is not None:
        settings = {
            "argv": saved_argv(argv),
            "dataset": args.dataset,
            "method": args.method,
            "reference": args.reference,
        }
        if commit := sage_commit():
            settings["sage_commit"] = commit
        if args.data is not None and len(read_settings["sources"]) > 1:  # each batch's commit, kept
            settings["sources"] = read_settings["sources"]
        args.save_data.write_text(data_file(counts, settings))
    runs = [c.run() for c in counts]

    print(
        f"{len(runs)} runs, {len(runs[0].ids)} {args.dataset} problems x {runs[0].correct.shape[1]} samples"
    )
    print("\nper run: method, seed, rare share, pass@1, pass@n (folder)")
    for r in sorted(runs, key=lambda r: (r.method, r.seed)):
        pass1 = r.correct.mean()
        passn = r.correct.any(axis=1).mean()
        print(f"  {r.method:16s} {r.seed:2d}  {r.share.mean():.4f}  {pass1:.4f}  {passn:.3f}  ({r.folder})")

    interval = (
        "paired-by-seed interval (analysis/bootstrap.py difference, paired=True)"
        if args.paired
        else "per-pair interval (analysis/bootstrap.py difference)"
    )
    mde = args.paired or args.split is not None  # the committed pages' plain form has none
    for group in [None, *(args.split or [])]:  # the whole study, then each seed group apart
        which = "" if group is None else f", {group.label}"
        print(f"\n{args.method} minus {args.reference}{which}, {interval}:")
        for figure in ("share", "pass@1", "pass@n"):
            seeds_m, m = arm(runs, args.method, figure, group and group.seeds)
            seeds_r, ref = arm(runs, args.reference, figure, group and group.seeds)
            iv = bootstrap.difference(m, ref, paired=True) if args.paired else bootstrap.difference(m, ref)
            print(
                f"  {figure:7s} {m.mean():.4f} (sd {m.mean(axis=1).std(ddof=1):.4f}, seeds {seeds_m}) - "
                f"{ref.mean():.4f} (sd {ref.mean(axis=1).std(ddof=1):.4f}, seeds {seeds_r}) = {iv.diff:+.4f} "
                f"[{iv.lo:.4f}, {iv.hi:.4f}], p = {iv.p:.3g}"
                + (f", detectable at 80% power {iv.mde:.4f}" if mde else "")
            )
    print(f"\n{bootstrap.METHOD}")

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
    if args.detectable:
        mde = detectable_effect(
            m, ref, seeds=args.seeds, samples=samples, sims=args.sims, rng_seed=args.rng_seed, seed_sds=upper
        )
        print(f"  detectable at 80% power (that simulation, {args.sims} studies per probe): {mde:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
