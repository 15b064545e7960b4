"""sage-report: the paper's tables and figures from the MLflow record, as ONE Markdown file.

    sage-report --experiment sage --out docs/results/testbed.md --figures-dir docs/results/figures
    sage-report --run-ids ID1,ID2 --seeds 1,2,3 --k 64 --out report.md
    sage-report --experiment sage --filter "tags.grid = '/path/of/the/sweep'" --out report.md
    sage-report --experiment sage --grid latest --out report.md   # one grid's runs (or --grid <its name>)

Writes the report, every table also as ``<tables-dir>/<name>.{md,tex,csv}``, and the figures as PNGs.
Only finished ``sage-train`` runs count; a row is one method at one config (see ``analysis.load``), its
cells mean ± std over the training seeds asked (``--seeds``, default: every seed present). Differences
between rows (each minus ``--reference`` and minus base) always carry their t interval over problems and
seeds (``analysis.bootstrap``: each side's own seed noise, Cochran-Cox critical value, coverage checked by
simulation at 2-8 seeds with unequal seed noise), from the correctness matrices each evaluation logged; each
table is a family under Holm's correction. ``--paired-seeds``: a method run on the reference's training seeds
gets the interval paired by seed instead (the seed noise of the per-seed differences: rows sharing seeds
share much of their seed noise); the others, and every difference against the start model, stay unpaired.
Which problems each compared pair moved (lost or gained at pass@k, ``--lost-threshold``) and where its
pass@k curves cross, per seed pair, are a section of their own with ``tables/moved.csv`` and one
``tables/problems_<dataset>.csv`` per dataset (``analysis.moved``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import bootstrap, figures, load, moved, snapshot, tables
from analysis.load import BUCKET_TABLES, ReportError
from analysis.tables import SEED_FRAME, Diff, Table
from sage.metrics import metric_name
from sage.parent_runs import DRIVER_TAG, PARENT_KIND, REPORT_TAG, STUDY_TAG, SWEEP_TAG
from sage.tracking import PARENT_TAG, probe_limits, redact, resolve_uri, store_failure
from sage.train.figures import BUCKETS
from sage.train.untrained import UNTRAINED_TAG

SOURCES = ["row", "seed", "run_id", "label"]
# below the tables of the training log's anchor_buckets/<bucket>/<stat> (load.BUCKET_TABLES)
BUCKET_TEXT = (
    "Buckets: each step's token-entropy quintiles (q1 lowest) and the tokens above 1.2 nats (the Branch "
    "guide's default threshold). The anchor's share is the sum of |anchor signal| over the bucket's tokens "
    "over that of |anchor signal| + |policy-gradient signal| (sage.objective.buckets); 0 without an anchor."
)
NOISE_SENTENCE = (
    "A difference whose interval includes 0 is not distinguishable from seed and problem noise: it is not "
    "a result."
)
ALWAYS_LOGGED = ("pattern", "strategy")
"""The analyses every evaluation logs; the tier figures exist for testbed problems only."""
# (kind logged by sage.eval.analyses, table name, heading, title, caption)
ANALYSES = [
    (
        "pattern",
        "reasoning_patterns",
        "Reasoning patterns (Table 2)",
        "frequency of reasoning patterns among correct solutions",
        "The paper's formula over problems with a correct sample; see sage/eval/analyses.py.",
    ),
    (
        "strategy",
        "strategy_mix",
        "Solution-strategy mix of samples",
        "fraction of all evaluation samples following each testbed strategy",
        "`other`: not one of the testbed teacher's strategies (sage.testbed.task.classify_strategy).",
    ),
    (
        "tier",
        "tier_pass",
        "pass@k by tier of the testbed",
        "pass@1 and pass@n of each tier's held-out problems",
        "Tiers: sage.testbed.task.problem_tier. In the fork world a tail problem is one that only the rare "
        "strategy (`round`) solves under the teacher's rules; a trained policy can learn to solve some with "
        "`split` (docs/results/archive/fork_beta_pilot.md).",
    ),
    (
        "rare_share",
        "rare_share",
        "The rare strategy's share by tier (fork world)",
        "fraction of each tier's evaluation samples that follow the rare strategy (`round`)",
        "Under the teacher's rules the only strategy that solves tail problems; a trained policy can solve "
        "some without it, so a tail gain need not raise this share.",
    ),
]


@dataclass
class Selection:
    """The runs a report is about, each with its row name, plus what was left out and why."""

    runs: pd.DataFrame
    seeds: list[int]
    notes: list[str] = field(default_factory=list)
    skipped: int = 0


def select(
    client, experiment: str, run_ids: Sequence[str], filter_string: str, seeds: Sequence[int] | None
) -> Selection:
    where = f"runs {', '.join(run_ids)}" if run_ids else f"experiment {experiment!r}"
    frame = load.runs_frame(load.fetch_runs(client, experiment, run_ids, filter_string))
    if frame.empty:
        raise ReportError(f"{where} has no runs" + (f" matching {filter_string!r}" if filter_string else ""))
    keep = (frame["kind"] == "train") & (frame["status"] == "FINISHED")
    notes = [
        f"left out run {r} ({m}, seed {s}): {'status ' + st if st != 'FINISHED' else 'kind ' + repr(k)}"
        for r, m, s, st, k in frame.loc[~keep, ["run_id", "method", "seed", "status", "kind"]].itertuples(
            index=False
        )
    ]
    runs = frame[keep].copy()
    if runs.empty:
        raise ReportError(
            f"{where} has no finished sage-train runs ({len(frame)} runs left out: not FINISHED or not train)"
        )
    runs["row"] = load.assign_rows(runs)
    param_notes = split_notes(runs)
    runs["row"], eval_notes = load.split_by_evaluation(runs)
    runs, dup_notes = load.one_run_per_seed(runs)
    dup_notes += joined_notes(client, runs) + param_notes + eval_notes
    present = sorted(int(s) for s in runs["seed"].unique())
    asked = sorted(seeds) if seeds else present
    if not set(asked) & set(present):  # a report of no run would be tables of dashes, not a result
        raise ReportError(
            f"--seeds {','.join(map(str, asked))}: no finished sage-train run of {where} has any of these "
            f"seeds (seeds present: {present})"
        )
    return Selection(runs.reset_index(drop=True), asked, notes + dup_notes, int((~keep).sum()))


def joined_notes(client, runs: pd.DataFrame) -> list[str]:
    """Which runs a report over several grids (or grids and single runs) joined: each grid's parent run
    and how many of its runs are used. Nothing when they all come from one place."""
    parents = runs["tags"].map(lambda t: t.get(PARENT_TAG))
    if parents.nunique(dropna=False) < 2:
        return []
    parts = []
    for parent, n in parents.value_counts(dropna=False, sort=False).items():
        if not isinstance(parent, str):
            parts.append(f"{n} outside any grid")
            continue
        try:
            name = repr(client.get_run(parent).info.run_name)
        except Exception:  # a deleted parent: its id still tells the runs apart
            name = "(deleted)"
        parts.append(f"{n} of grid {name} (parent run {parent})")
    return [
        f"joined {len(runs)} runs from {len(parts)} sources: {'; '.join(parts)}; --grid <name|latest> "
        "reports one grid"
    ]


def split_notes(runs: pd.DataFrame) -> list[str]:
    """Why a method has several rows: the keys in which its runs' configs differ, with each row."""
    notes = []
    for label, group in runs.groupby("method", sort=False):
        rows = sorted(group["row"].unique())
        if len(rows) > 1:
            keys = load.varying_params(list(group["params"]))
            notes.append(
                f"{label} is split into {len(rows)} rows because its runs differ in {', '.join(keys)}: "
                f"{'; '.join(rows)} (one grid: --grid; one setting: --filter)"
            )
    return notes


def find_grid(client, experiment: str, grid: str) -> tuple[object, int | None]:
    """The parent run ``--grid`` names, and for ``latest`` when its driver ran (ms; else None): ``latest``
    (``latest_grid``: the grid whose driver ran last, not an Optuna study), else the one whose run name
    (what it compared), sweep dir (absolute, or its last folder), study or run id is ``grid``. A
    ReportError listing the experiment's grids when none is."""
    names = load.experiment_names(experiment)
    ids = [e.experiment_id for e in map(client.get_experiment_by_name, names) if e is not None]
    if not ids:
        raise ReportError(f"--grid {grid}: no experiment {experiment!r} in the store")
    found = client.search_runs(
        ids, f"tags.`sage.kind` = '{PARENT_KIND}'", order_by=["attributes.start_time DESC"], max_results=5000
    )
    parents = [p for p in found if REPORT_TAG not in p.data.tags]  # not sage-report --log-to-mlflow's own
    if not parents:
        raise ReportError(f"--grid {grid}: experiment(s) {experiment!r} hold no grid (sage-train -m)")
    if grid == "latest":
        return latest_grid(client, ids, parents, experiment)

    def known_as(p) -> set[str]:
        sweep = p.data.tags.get(SWEEP_TAG, "")
        study = p.data.tags.get(STUDY_TAG, "")
        return {p.info.run_id, p.info.run_name, sweep, Path(sweep).name, study} - {""}

    match = [p for p in parents if known_as(p) & {grid, str(Path(grid).resolve())}]
    if not match:
        listed = ", ".join(repr(p.info.run_name) for p in parents[:8])
        raise ReportError(
            f"--grid {grid!r}: no grid of that name, sweep dir or run id in {experiment}; its grids, latest "
            f"first: {listed}{' ...' if len(parents) > 8 else ''} (or --grid latest)"
        )
    return match[0], None


def latest_grid(client, ids: Sequence[str], parents: Sequence, experiment: str) -> tuple[object, int]:
    """(parent run, when in ms) of the grid whose driver ran last: ``sage-train -m`` into a sweep dir (an
    Optuna study is not a grid here), at the latest time its driver opened its parent run (``DRIVER_TAG``),
    or its parent run or one of its runs started or ended. An extended grid continues the parent run its
    first launch made, so the parent's start alone would name a grid or study started in between."""
    grids = {p.info.run_id: p for p in parents if SWEEP_TAG in p.data.tags}
    if not grids:
        studies = ", ".join(repr(p.info.run_name) for p in parents[:8])
        raise ReportError(
            f"--grid latest: experiment(s) {experiment!r} hold no grid launched into a sweep dir (sage-train "
            f"-m), only Optuna studies: {studies}; name one with --grid <its name>"
        )
    last = {
        r: max(p.info.start_time or 0, p.info.end_time or 0, int(p.data.tags.get(DRIVER_TAG, 0)))
        for r, p in grids.items()
    }
    for order in ("start_time", "end_time"):  # the newest start and end of any grid's run
        token = None
        while True:
            page = client.search_runs(
                ids,
                f"tags.`{PARENT_TAG}` LIKE '%'",
                order_by=[f"attributes.{order} DESC"],
                max_results=100,
                page_token=token,
            )
            child = next(
                (c for c in page if c.data.tags.get(PARENT_TAG) in grids and getattr(c.info, order)), None
            )
            if child is not None:
                parent = child.data.tags[PARENT_TAG]
                last[parent] = max(last[parent], getattr(child.info, order))
                break
            token = page.token
            if not token:
                break
    chosen = max(last, key=lambda r: (last[r], grids[r].info.start_time or 0))
    return grids[chosen], last[chosen]


def grid_line(parent, when: int | None = None) -> str:
    """The line sage-report --grid prints: which grid it reports (name, sweep dir or study, parent run),
    and for --grid latest why that one."""
    tags = parent.data.tags
    where = f" in sweep dir {tags[SWEEP_TAG]}" if SWEEP_TAG in tags else ""
    where += f", Optuna study {tags[STUDY_TAG]}" if STUDY_TAG in tags else ""
    why = ""
    if when is not None:
        at = datetime.fromtimestamp(when / 1000, UTC)
        why = f" the grid whose driver ran last (at {at:%Y-%m-%d %H:%M:%S} UTC),"
    return f"grid:{why} {parent.info.run_name!r}{where} (parent run {parent.info.run_id}): its runs only"


def sources(runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Which (run, eval label) gives each row's numbers for each seed: trained runs their ``trained``
    evaluation; the base row the ``base`` evaluation of method=base runs if any, else of the trained runs
    (one per seed; they share the start model: the ``base_model`` tag must agree, else one base row per
    start model; and their evaluations' settings must agree, else one base row per setting, named by it:
    ``base [eval.n_samples=4]``)."""
    notes = []
    is_base = runs["method"] == "base"
    trained = runs[~is_base].assign(label="trained")[SOURCES]
    if is_base.any():
        base = runs[is_base].assign(label="base")[SOURCES]
    else:
        models = runs["base_model"].dropna().unique()
        if len(models) == 0:
            return trained, ["no base row: the runs have no base_model tag and there is no method=base run"]
        if len(models) > 1:
            notes.append(f"the runs start from {len(models)} different base models: one base row per model")
        rows = runs.dropna(subset=["base_model"]).sort_values("start_time", ascending=False)
        name = rows["base_model"].map(lambda m: "base" if len(models) == 1 else f"base [{m}]")
        for _, group in rows.groupby("base_model", sort=False):  # the start model's evaluation settings
            keys = load.evaluation_params(list(group["params"]))
            for i, p in group["params"].items():
                name[i] = load.with_settings(name[i], [f"{k}={p.get(k)}" for k in keys])
        named = rows.assign(row=name)
        named["row"], _ = load.split_by_evaluation(named, "base")  # its notes: base_split_notes
        notes += base_split_notes(named)
        rows = named.drop_duplicates(["row", "seed"])
        base = rows.assign(label="base")[SOURCES]
        notes.append(
            "base row: the */base/* metrics of the trained runs (no method=base run), one run per seed; "
            "they evaluate the same start model with the same eval seeds, so they should agree exactly"
        )
    return pd.concat([base, trained], ignore_index=True), notes


def base_split_notes(named: pd.DataFrame) -> list[str]:
    """One line per start model whose base row is split by evaluation settings: each row and its runs."""
    notes = []
    for model, group in named.groupby("base_model", sort=False):
        rows = list(dict.fromkeys(group["row"]))
        if len(rows) > 1:
            parts = [f"{r} (runs {', '.join(group.loc[group['row'] == r, 'run_id'])})" for r in rows]
            notes.append(
                f"the start model {model} is split into {len(rows)} base rows: the runs that supply it "
                f"evaluated it under different settings, never averaged: {'; '.join(parts)}"
            )
    return notes


def disagreeing_base_notes(meas: pd.DataFrame, src: pd.DataFrame) -> list[str]:
    """Base numbers taken from several trained runs must be identical (same model, same eval seeds)."""
    base_runs = src.loc[src["label"] == "base", "run_id"]
    sub = meas[meas["run_id"].isin(base_runs) & meas["row"].str.startswith("base")]
    spread = sub.groupby(["row", "dataset", "k"])["value"].agg(lambda v: v.max() - v.min())
    return [
        f"{row}: pass_at_{k}/base/{ds} differs between runs by {d:.3g} (different eval settings?)"
        for (row, ds, k), d in spread.items()
        if d > 1e-12
    ]


def check_k(k: int | None, runs: pd.DataFrame, evals: pd.DataFrame, flag: str = "--k") -> None:
    """``--k`` (or one of ``--extra-k``: ``flag``) above n, the samples per problem, of every evaluation: a
    pass@k no run has (the estimator needs k <= n), so a table of dashes; one line instead. Each
    evaluation's n is what its tag records (``sage.eval.<label>.<dataset>``), else the largest k it logged."""
    if k is None:
        return
    n = 0
    tags_of = dict(zip(runs["run_id"], runs["tags"], strict=True))
    for (run_id, label, ds), g in evals.groupby(["run_id", "label", "dataset"]):
        latest = load.latest_evaluation(tags_of.get(run_id, {}), label, ds) or {}
        n = max(n, int(latest.get("n_samples") or g["k"].max()))
    if k > n:
        raise ReportError(
            f"{flag} {k} is above n, the samples per problem, of every evaluation here (at most {n}): "
            f"pass@k needs k <= n; choose {flag} {n} or less"
        )


def reference_row(reference: str | None, trained_rows: Sequence[str]) -> tuple[str, str | None]:
    """The row the differences are taken against (``--reference``, a preset or a row name; GRPO when not
    given), and why there is no such trained row (None when there is)."""
    ref_row = load.METHOD_NAMES.get(reference or "grpo", reference or "grpo")
    if ref_row in trained_rows:
        return ref_row, None
    split = [r for r in trained_rows if r.startswith(f"{ref_row} [")]
    if split:
        return ref_row, (
            f"its runs are split into rows {', '.join(split)} (see the note on the split): report one grid "
            "with --grid, or one setting with --filter"
        )
    return ref_row, f"no trained row of that name (rows: {', '.join(trained_rows)}; --reference picks one)"


def untrained_notes(runs: pd.DataFrame) -> list[str]:
    """One line per run whose final/ is its start model (tag ``untrained=true``, set by sage-train): its
    "trained" numbers are the start model's, and its row's mean and intervals include them."""
    flagged = runs[runs["tags"].map(lambda tags: tags.get(UNTRAINED_TAG) == "true")]
    return [
        f"untrained: {row} seed {seed} (run {run_id}): final/ equals the start model, so its trained numbers "
        "are the start model's (learning rate 0 throughout?)"
        for row, seed, run_id in flagged[["row", "seed", "run_id"]].itertuples(index=False)
    ]


def measurements(src: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """(row, seed, run_id, label, dataset, k, value): every logged pass@k point of every source."""
    return src.merge(evals, on=["run_id", "label"])[
        ["row", "seed", "run_id", "label", "dataset", "k", "value"]
    ]


def missing_eval_notes(src: pd.DataFrame, evals: pd.DataFrame, ks: dict[str, int]) -> list[str]:
    """One line per source that lacks a pass@1 / pass@k metric the ablation table shows."""
    have = set(zip(evals["run_id"], evals["label"], evals["dataset"], evals["k"], strict=True))
    notes = []
    for row, seed, run_id, label in src[SOURCES].itertuples(index=False):
        lacking = [
            metric_name(label, ds, f"pass@{k}")
            for ds, kk in ks.items()
            for k in sorted({1, kk})
            if (run_id, label, ds, k) not in have
        ]
        if lacking:
            notes.append(f"{row} seed {seed} (run {run_id}) lacks {', '.join(lacking)}")
    return notes


def grid_tables(runs: pd.DataFrame, meas: pd.DataFrame, seeds: list[int], ks: dict[str, int]) -> list[Table]:
    """Table 6 for every method with a Branch guide whose runs span more than one (threshold, ratio)."""
    out = []
    branch = runs[(runs["guide"] == "branch") & (runs["method"] != "base")]
    for label, group in branch.groupby("method"):
        grid = group.assign(
            threshold=group["params"].map(lambda p: p.get("guide.threshold")),
            ratio=group["params"].map(lambda p: p.get("guide.ratio")),
        ).dropna(subset=["threshold", "ratio"])
        others = load.varying_params(list(grid["params"]), ignore=("guide.threshold", "guide.ratio"))
        rest = grid["params"].map(lambda p, keys=tuple(others): tuple((k, p.get(k)) for k in keys))
        for signature, part in grid.groupby(rest):
            if part[["threshold", "ratio"]].drop_duplicates().shape[0] < 2:
                continue
            sub = meas.merge(part[["run_id", "threshold", "ratio"]], on="run_id")
            extra = "" if not signature else " [" + ", ".join(f"{k}={v}" for k, v in signature) + "]"
            for ds, k in ks.items():
                slug = figures._slug(f"grid {label}{extra} {ds}").lower()
                title = f"{label}{extra}: guide.threshold x guide.ratio on {ds}, pass@1 and pass@{k}"
                out.append(tables.grid_table(sub, seeds, ds, k, name=slug, title=title))
    return out


def analysis_frames(runs: pd.DataFrame, src: pd.DataFrame, datasets: list[str]) -> dict[str, pd.DataFrame]:
    """Pattern frequencies and strategy mixes per (row, seed, column) from what each source's evaluation
    logged (``sage.eval.analyses``), keyed by kind; a column is prefixed by its dataset when there are
    several."""
    logged = src.merge(load.analysis_frame(runs), on=["run_id", "label"])
    logged = logged[logged["dataset"].isin(datasets)]
    prefix = logged["dataset"] + ": " if len(datasets) > 1 else ""
    logged = logged.assign(column=prefix + logged["name"])
    return {kind: logged.loc[logged["kind"] == kind, SEED_FRAME] for kind, *_ in ANALYSES}


def perplexity_frame(
    client, src: pd.DataFrame, datasets: list[str], tmp: Path, tags_of: Mapping[str, dict] | None = None
) -> tuple[pd.DataFrame, list[str]]:
    """(row, seed, run_id, ppl): each source's per-sample perplexities under its base model, as its
    evaluation logged them; not those of an earlier evaluation (its ``perplexity_median`` named stale by
    the run's tag ``sage.eval.<label>.<dataset>``, from ``tags_of``: run id -> tags)."""
    out, notes = [], []
    for row, seed, run_id, label in src[SOURCES].itertuples(index=False):
        for ds in datasets:
            latest = load.latest_evaluation((tags_of or {}).get(run_id, {}), label, ds) or {}
            if metric_name(label, ds, "perplexity_median") in latest.get("stale", ()):
                notes.append(
                    f"perplexity: {row} seed {seed} (run {run_id}): its {label}/{ds} perplexities are of an "
                    "earlier evaluation (not scored again when it was re-evaluated): left out"
                )
                continue
            ppl = load.perplexities(client, run_id, label, ds, tmp)
            if ppl is None:
                notes.append(f"perplexity: {row} seed {seed} (run {run_id}) logged none for {label}/{ds}")
                continue
            out += [{"row": row, "seed": seed, "run_id": run_id, "ppl": v} for v in ppl]
    return pd.DataFrame(out, columns=["row", "seed", "run_id", "ppl"]), notes


def cap_per_source(ppl: pd.DataFrame, cap: int) -> pd.DataFrame:
    """The first ``cap`` perplexities of each source, a (row, run) pair: a run that also supplies the base
    row keeps ``cap`` of its trained samples, not what the base samples before them leave of one cap."""
    return ppl.groupby(["row", "run_id"], group_keys=False, sort=False).head(cap)


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


def difference_table(
    pv: ProblemValues,
    rows: Sequence[str],
    reference: str,
    columns: Sequence[tuple[str, int]],
    asked: Sequence[int],
    *,
    name: str,
    title: str,
    paired: bool = False,
) -> Table:
    """Each of ``rows`` minus ``reference`` at each (dataset, k) column: a ``Diff`` cell (the difference
    with its interval, see ``analysis.bootstrap``), or why there is none. The table's cells with an
    interval are one family of comparisons: Holm's correction marks the ones that survive it, and the notes
    say so, with the smallest difference each column could detect. ``paired``: a row run on the same
    training seeds as a trained reference gets the interval paired by seed; the notes name the rows whose
    seeds differ, which keep the unpaired one."""
    base = reference.startswith("base")
    unpaired: dict[tuple[str, str], str] = {}  # (row, dataset) whose seed set is not the reference's
    out = []
    for row in rows:
        cells: list[tables.Cell] = []
        for ds, k in columns:
            paired_by = pv.paired(row, reference, ds)
            why = paired_by if isinstance(paired_by, str) else None
            if why is None and min(paired_by[0][1], paired_by[1][1]) < k:
                why = f"k={k} exceeds the samples per problem ({min(paired_by[0][1], paired_by[1][1])})"
            if why is not None:
                cells.append(f"— ({why})")
                continue
            a, seeds = pv.values(row, ds, [k])
            b, ref_seeds = pv.values(reference, ds, [k])
            if paired_by[2] is not None:  # the problems both evaluated
                a, b = a[:, paired_by[2][0]], b[:, paired_by[2][1]]
            pair = paired and not base and seeds == ref_seeds
            if paired and not base and not pair:
                unpaired[(row, ds)] = f"{row} on {ds} (seeds {seeds} vs {ref_seeds})"
            interval = bootstrap.difference(a[..., 0], b[..., 0], ref_is_base=base, paired=pair)
            cells.append(Diff(interval, len(seeds), len(ref_seeds), len(asked)))
        out.append((row, cells))
    diffs = [
        (r, j, c) for r, (_, cells) in enumerate(out) for j, c in enumerate(cells) if isinstance(c, Diff)
    ]
    survives = bootstrap.holm([c.interval.p for _, _, c in diffs])
    for (r, j, c), kept in zip(diffs, survives, strict=True):
        out[r][1][j] = replace(c, holm=kept)
    columns_text = [f"{ds} pass@{k}" for ds, k in columns]
    table = Table(name, title, columns_text, out)
    family = sum(c.interval.has_interval for _, _, c in diffs)
    table.notes.append(
        f"Family: {family} comparisons with an interval (t, {bootstrap.LEVEL:.0%}); "
        f"{tables.MARKER} its interval excludes 0; {tables.HOLM} it also survives Holm's correction for the "
        f"{family} at {1 - bootstrap.LEVEL:.0%} family-wise"
    )
    table.notes.append(bootstrap.METHOD)  # which interval: every report names it (issue 58)
    mdes = [
        f"{col} {np.median(m):.3f}"
        for j, col in enumerate(columns_text)
        if (m := [c.interval.mde for r, jj, c in diffs if jj == j and c.interval.has_interval])
    ]
    if mdes:
        table.notes.append(
            "Smallest difference detectable with 80% power (two-sided 5%), median over rows: "
            + "; ".join(mdes)
        )
    if paired and not base:
        table.notes.append(
            f"Intervals paired by training seed (--paired-seeds), each row against {reference} on the same "
            "seeds: the seed noise is that of the per-seed differences"
        )
    if unpaired:
        table.notes.append(
            "Unpaired (each side's own seed noise), the seed sets differing from the reference's: "
            + "; ".join(unpaired.values())
        )
    return table


def primary_section(
    pv: ProblemValues,
    primary: tuple[str, str, int],
    ref_row: str,
    trained_rows: Sequence[str],
    asked,
    paired: bool = False,
) -> str:
    """The comparison declared before the run (``--primary``), alone: a family of one, so no correction,
    with its p-value and the smallest difference the study could detect at 80% power."""
    method, ds, k = primary
    row = load.METHOD_NAMES.get(method, method)
    missing = [r for r in (row, ref_row) if r not in trained_rows]
    if missing:
        raise ReportError(
            f"--primary {method}|{ds}|{k}: no trained row {missing[0]!r} (rows: {list(trained_rows)})"
        )
    # computed as in the table against the reference (the pair's own seed noise), then taken out of its
    # family
    others = [r for r in trained_rows if r != ref_row]
    t = difference_table(
        pv, others, ref_row, [(ds, k)], asked, name="primary", title="primary comparison", paired=paired
    )
    cell = dict(t.rows)[row][0]
    if isinstance(cell, Diff):
        cell = replace(cell, holm=False)
    else:
        raise ReportError(f"--primary {method}|{ds}|{k}: no difference to report {cell}")
    i = cell.interval
    how = "Cochran-Cox t"
    if paired:
        seeds, ref_seeds = pv.values(row, ds, [k])[1], pv.values(ref_row, ds, [k])[1]
        how += (
            ", paired by training seed"
            if seeds == ref_seeds
            else f", unpaired: seeds {seeds} vs the reference's {ref_seeds}"
        )
    power = (
        f"p = {i.p:.3f} (two-sided, {how}, {i.df:.0f} effective df); the smallest difference this "
        f"study could detect at {bootstrap.POWER:.0%} power: {i.mde:.3f}"
        if i.has_interval
        else "no interval: one training seed"
    )
    return (
        "## Primary comparison (declared before the run)\n\n"
        f"{row} minus {ref_row} on {ds} at pass@{k}: **{cell.text()}**; {power}. The one comparison "
        "declared before the runs (the Makefile's `--primary`): it is not part of a table's family, and "
        "every other difference in this report is secondary.\n"
    )


MOVED_CAPTION = (
    "From the logged correctness matrices, nothing sampled. Lost: a problem whose pass@k under the method "
    "is below {threshold} x the other row's (`--lost-threshold`), so one the other row solves at k; gained: "
    "the rows swapped. Counted per seed pair (the same training seed on both sides; a side with one seed, "
    "such as the start model's one evaluation, is paired with every seed of the other), shown as the mean "
    "over seed pairs with its {level:.0%} t interval over them. Curves cross: the smallest k at which the "
    "other row's pass@k (mean over problems, unbiased, k = 1..n) is at least the method's (1: the method "
    "is not ahead at k = 1), per seed pair, mean with its interval. Per problem: "
    "`tables/problems_<dataset>.csv`."
)


def moved_pairs(ref_row: str, trained_rows: Sequence[str], base_rows: Sequence[str]) -> list[tuple[str, str]]:
    """The compared pairs of the report: each method against the reference row, and against the start
    model when there is one base row."""
    pairs = [(r, ref_row) for r in trained_rows if r != ref_row] if ref_row in trained_rows else []
    return pairs + ([(r, base_rows[0]) for r in trained_rows] if len(base_rows) == 1 else [])


def moved_table(
    pv: ProblemValues,
    pairs: Sequence[tuple[str, str]],
    ks: dict[str, int],
    threshold: float,
    ids: Mapping[str, Sequence[str]],
) -> tuple[Table, pd.DataFrame, dict[str, dict[str, moved.Moved]]]:
    """Which problems each pair moved at each dataset's pass@k, and where its curves cross: the table,
    its numbers (one line per pair and dataset) and the comparisons by dataset and pair name. ``ids``: the
    problems' ids by dataset, where known, to name those moved in every seed pair."""
    out: list[tuple[str, list[tables.Cell]]] = []
    lines, by_ds, everywhere = [], {}, []
    for ds, k in ks.items():
        for row, ref in pairs:
            name = f"{row} vs {ref}"
            paired_by = pv.paired(row, ref, ds)
            why = paired_by if isinstance(paired_by, str) else None
            n = min(paired_by[0][1], paired_by[1][1]) if why is None else 0
            if why is None and n < k:
                why = f"k={k} exceeds the samples per problem ({n})"
            if why is None:
                common = paired_by[2]
                mine, theirs = (slice(None), slice(None)) if common is None else common[:2]
                values, seeds = pv.values(row, ds, [k])
                ref_values, ref_seeds = pv.values(ref, ds, [k])
                values, ref_values = values[:, mine], ref_values[:, theirs]
                if not moved.seed_pairs(seeds, ref_seeds):
                    why = f"no training seed in common ({seeds} vs {ref_seeds})"
            if why is not None:
                out.append((name, [ds, str(k), "", *[f"— ({why})"] * 3]))
                continue
            curves = moved.mean_curve(pv.values(row, ds, list(range(1, n + 1)))[0][:, mine])
            ref_curves = moved.mean_curve(pv.values(ref, ds, list(range(1, n + 1)))[0][:, theirs])
            m = moved.compare(
                values[..., 0], ref_values[..., 0], curves, ref_curves, seeds, ref_seeds,
                k=k, threshold=threshold, ref_is_base=ref.startswith("base"),
            )  # fmt: skip
            by_ds.setdefault(ds, {})[name] = m
            texts = [m.count_text("lost"), m.count_text("gained"), m.crossing_text()]
            out.append((name, [ds, str(k), str(m.problems), *texts]))
            lines.append({"row": row, "reference": ref, "dataset": ds, "threshold": threshold, **m.summary()})
            known = ids.get(ds) if common is None else common[2]
            named_ids = known if known is not None and len(known) == m.problems else None
            parts = []
            for which in ("lost", "gained"):
                idx = m.everywhere(which)
                if len(idx) and named_ids is not None:
                    listed = ", ".join(f"`{named_ids[i]}`" for i in idx[:5])
                    listed += " ..." if len(idx) > 5 else ""
                    parts.append(f"{which} {len(idx)} ({listed})")
                elif len(idx):
                    parts.append(f"{which} {len(idx)}")
            if parts:
                everywhere.append(f"{name} on {ds}, in every seed pair: {', '.join(parts)}")
    columns = ["dataset", "k", "problems", "lost", "gained", "curves cross at k"]
    title = (
        f"problems lost and gained at pass@k (below {threshold:g} x the other row's), and where the curves "
        "cross"
    )
    t = Table("moved", title, columns, out)
    t.notes += everywhere
    return t, pd.DataFrame(lines, columns=moved.SUMMARY), by_ds


def dataset_labels(
    runs: pd.DataFrame, src: pd.DataFrame, ds: str, logged: set[tuple[str, ...] | None] | None = None
) -> tuple[list[str], list[str]] | str:
    """(ids, tiers) of the problems the report's runs evaluated on ``ds``, or why there are none. The
    testbed's problems are rebuilt from the runs' params (``analysis.moved.problem_labels``, which must
    agree), with their tiers; a benchmark's ids are those its evaluations logged (``logged``: every source's,
    None for a source that logged none), without tiers."""
    keys = (f"eval.datasets.{ds}.", "eval.limit", "model.source.world")
    used = runs.loc[runs["run_id"].isin(src["run_id"]), "params"]
    settings = {tuple(sorted((a, v) for a, v in p.items() if a.startswith(keys))) for p in used}
    if len(settings) != 1:
        return f"the runs evaluated {ds} under {len(settings)} different params"
    rebuilt = moved.problem_labels(dict(settings.pop()), ds)
    if not isinstance(rebuilt, str) or not logged:
        return rebuilt
    if None in logged:
        return f"{rebuilt}, and some of its evaluations logged no problem ids"
    if len(logged) > 1:
        return f"{rebuilt}, and its evaluations logged {len(logged)} different lists of problem ids"
    ids = list(next(iter(logged)))
    return ids, [""] * len(ids)


def problems_csv(
    pv: ProblemValues,
    ds: str,
    k: int,
    rows: Sequence[str],
    compared: dict[str, moved.Moved],
    labels: tuple[list[str], list[str]] | str,
) -> tuple[pd.DataFrame | None, list[str]]:
    """The per-problem frame of ``ds`` (``analysis.moved.problems_frame``): every row with correctness
    matrices of the dataset's problems, the compared pairs' lost and gained shares, and the problems' ids
    and tiers where ``labels`` (``dataset_labels``) has them; the notes say what is missing."""
    notes = []
    shapes = {r: s for r in rows if not isinstance(s := pv.shape(r, ds), str)}
    if not shapes:
        return None, []
    problems = next(iter(shapes.values()))[0]
    passes, first_ids = {}, None
    for r, (p, n) in shapes.items():
        if p != problems:
            notes.append(f"problems_{ds}.csv: {r} left out ({p} problems, not {problems})")
            continue
        listed = set(pv.row_ids.get((r, ds), {}).values())
        if len(listed) == 1 and None not in listed:  # one line per problem: never two problems on one
            first_ids = first_ids or next(iter(listed))
            if next(iter(listed)) != first_ids:
                notes.append(f"problems_{ds}.csv: {r} left out (it evaluated other problems)")
                continue
        values, _ = pv.values(r, ds, [1, k] if n >= k else [1])
        mean = values.mean(axis=0)
        passes[r] = (mean[:, 0], mean[:, 1] if n >= k else np.full(problems, np.nan))
    ids = tiers = None
    if isinstance(labels, str):
        notes.append(f"problems_{ds}.csv: no ids nor tiers ({labels}): `problem` is the row's position")
    elif len(labels[0]) != problems:
        notes.append(
            f"problems_{ds}.csv: no ids nor tiers, the params rebuild {len(labels[0])} problems and the "
            f"matrices hold {problems}"
        )
    else:
        ids, tiers = labels
    same = {name: m for name, m in compared.items() if m.problems == problems}
    return moved.problems_frame(problems, passes, k, same, ids, tiers), notes


def curve_bands(pv: ProblemValues, rows: Sequence[str], datasets: Sequence[str], draws: int, rng_seed: int):
    """(row, dataset, k, lo, hi): the bootstrap band (over problems and seeds) of each row's pass@k curve,
    at ``bootstrap.band_ks`` of its samples per problem."""
    parts = []
    for row in rows:
        for ds in datasets:
            shape = pv.shape(row, ds)
            if isinstance(shape, str):
                continue
            ks = bootstrap.band_ks(shape[1])
            values, _ = pv.values(row, ds, ks)
            _, lo, hi = bootstrap.mean_band(values, draws=draws, rng_seed=rng_seed)
            parts.append(pd.DataFrame({"row": row, "dataset": ds, "k": ks, "lo": lo, "hi": hi}))
    columns = ["row", "dataset", "k", "lo", "hi"]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)


def few_seeds_warning(meas: pd.DataFrame, asked: Sequence[int], min_seeds: int) -> str | None:
    """One line naming the Table 1 methods (trained rows) with fewer than ``min_seeds`` training seeds."""
    trained = meas[(meas["label"] == "trained") & meas["seed"].isin(asked)]
    counts = trained.groupby("row")["seed"].nunique()
    few = [(r, int(counts[r])) for r in sorted(counts.index, key=tables.row_key) if counts[r] < min_seeds]
    if not few:
        return None
    listed = ", ".join(f"{r} ({n})" for r, n in few)
    return (
        f"fewer than {min_seeds} training seeds for Table 1 methods: {listed}; their intervals rest on few "
        f"seeds (--min-seeds {min_seeds})"
    )


def perplexity_table(ppl: pd.DataFrame) -> Table:
    rows = []
    for row in sorted(ppl["row"].unique(), key=tables.row_key):
        v = ppl.loc[ppl["row"] == row, "ppl"].to_numpy()
        values = (np.median(v), v.mean(), np.percentile(v, 90))
        rows.append((row, [str(len(v)), *(f"{x:.3f}" for x in values)]))
    columns = ["samples", "median", "mean", "90th percentile"]
    title = "perplexity of samples under the base model (pooled over seeds)"
    return Table("perplexity", title, columns, rows)


def portable_uri(uri: str) -> str:
    """The store as a report may record it: credentials redacted, and a SQLite file relative to the folder
    sage-report ran from (a machine's absolute paths do not belong in committed results)."""
    uri = redact(uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and os.path.isabs(uri[len(prefix) :]):
        return prefix + os.path.relpath(uri[len(prefix) :])
    return uri


def cwd_relative_path(path: Path) -> str:
    """A file as a committed report names it: relative to the folder sage-report ran from."""
    return os.path.relpath(path) if Path(path).is_absolute() else str(path)


def provenance(uri: str, experiment: str, run_ids: Sequence[str], sel: Selection) -> str:
    commits = sel.runs["git_commit"].value_counts()
    commit_text = ", ".join(f"`{c[:12]}` ({n} runs)" for c, n in commits.items())
    names = [] if run_ids else load.experiment_names(experiment)
    label = "experiment" if len(names) == 1 else "experiments"
    what = f"runs {', '.join(run_ids)}" if run_ids else f"{label} " + ", ".join(f"`{n}`" for n in names)
    return (
        f"Provenance: {what} in `{portable_uri(uri)}`; {len(sel.runs)} finished sage-train runs used"
        f" ({sel.skipped} left out); seeds asked {sel.seeds}; git commits: {commit_text};"
        f" generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by sage-report."
    )


def write_table(t: Table, tables_dir: Path, digits: int) -> None:
    tables_dir.mkdir(parents=True, exist_ok=True)
    (tables_dir / f"{t.name}.md").write_text(tables.to_markdown(t, digits) + "\n")
    (tables_dir / f"{t.name}.tex").write_text(tables.to_latex(t, digits) + "\n")
    (tables_dir / f"{t.name}.csv").write_text(tables.to_csv(t))


@dataclass
class Report:
    markdown: str
    tables: dict[str, Table]
    figures: dict[str, Path]
    notes: list[str]
    warnings: list[str] = field(default_factory=list)


def make_report(
    client,
    uri: str,
    *,
    experiment: str = "sage",
    run_ids: Sequence[str] = (),
    filter_string: str = "",
    seeds: Sequence[int] | None = None,
    k: int | None = None,
    out: Path,
    figures_dir: Path,
    tables_dir: Path,
    perplexity_cap: int = 2000,
    digits: int = 3,
    extra_ks: Sequence[int] = (),
    includes: Sequence[Path] = (),
    reference: str | None = None,
    draws: int = 2000,
    rng_seed: int = 0,
    min_seeds: int = 5,
    primary: tuple[str, str, int] | None = None,
    lost_threshold: float = moved.LOST_THRESHOLD,
    paired_seeds: bool = False,
) -> Report:
    if not 0 < lost_threshold <= 1:
        raise ReportError(f"--lost-threshold must be in (0, 1], not {lost_threshold}")
    if primary is not None and draws <= 0:
        raise ReportError("--primary needs the intervals that --bootstrap 0 turns off")
    if draws < 0:
        raise ReportError(f"--bootstrap {draws}: the bootstrap draws are 0 (no intervals nor bands) or more")
    sel = select(client, experiment, run_ids, filter_string, seeds)
    runs, asked = sel.runs, sel.seeds
    notes = list(sel.notes)
    evals = load.eval_frame(runs)
    if evals.empty:
        raise ReportError(
            f"none of the {len(runs)} runs logged pass_at_<k>/<base|trained>/<dataset> metrics "
            "(trained with eval.at_end=false?): nothing to tabulate"
        )
    for kk, flag in [(k, "--k"), *((x, "--extra-k") for x in extra_ks)]:
        check_k(kk, runs, evals, flag)
    src, src_notes = sources(runs)
    notes += src_notes
    ks = tables.column_k_per_dataset(evals, k)
    notes += missing_eval_notes(src, evals, ks)
    notes += untrained_notes(runs)
    meas = measurements(src, evals)
    if not (runs["method"] == "base").any():
        notes += disagreeing_base_notes(meas, src)
    datasets = sorted(ks)
    warnings = [w for w in [few_seeds_warning(meas, asked, min_seeds)] if w]
    trained_rows = sorted(src.loc[src["label"] == "trained", "row"].unique(), key=tables.row_key)
    ref_row, ref_why = reference_row(reference, trained_rows)
    # a name that is no row at all is a typo: refused; a row split by its settings keeps the report, whose
    # note on the split says why there are no differences against it
    split = any(r.startswith(f"{ref_row} [") for r in trained_rows)
    if ref_why is not None and reference is not None and not split:
        raise ReportError(f"--reference {reference}: {ref_why}")
    with tempfile.TemporaryDirectory() as tmp_name:
        pv = ProblemValues(client, src, datasets, asked, Path(tmp_name))
    notes += pv.notes
    # the tables' pass@k are the logged metrics, the differences' and 'Which problems moved' the matrices:
    # checked against each other on every report, before anything is written
    wrong = disagreement(pv, meas)
    if wrong:
        raise ReportError(wrong)
    made: dict[str, Table] = {}
    figs: dict[str, Path] = {}
    sections: list[str] = []

    def add(t: Table, heading: str | None, text: str = "") -> None:
        made[t.name] = t
        write_table(t, tables_dir, digits)
        caption = t.title + "." + (" " + text if text else "")
        below = "".join(f"\n- {n}" for n in t.notes)  # a table's own notes (its family, its power)
        below = "\n" + below + "\n" if below else ""
        head = f"## {heading}\n\n" if heading else ""  # None: under the table before it
        sections.append(f"{head}{caption}\n\n{tables.to_markdown(t, digits)}\n{below}")

    add(tables.ablation_table(meas, asked, ks), "Methods (Tables 1, 3, 4, 9)")
    for kx in extra_ks:  # the same table at other k (e.g. Table 1 at k = 8 beside k = 64)
        t = tables.ablation_table(meas, asked, {ds: kx for ds in ks})
        t.name = f"ablation_k{kx}"
        add(t, f"Methods at pass@{kx}")
    if draws > 0:
        base_rows = sorted(src.loc[src["label"] == "base", "row"].unique())
        columns = [(ds, kk) for ds in datasets for kk in sorted({1, ks[ds], *extra_ks})]
        how = (
            f"Cells: mean difference over problems and training seeds with its {bootstrap.LEVEL:.0%} t "
            "interval (problem noise, and each side's own seed noise, not pooled over the table: see "
            "analysis/bootstrap.py); a side with one training seed gets none. "
            f"`{tables.MARKER}`: the interval excludes 0; `{tables.HOLM}`: it survives Holm's correction "
            "over the table's family. " + NOISE_SENTENCE
        )
        # --paired-seeds: the reference table says which interval each row got; against the start model,
        # which has no training seed, the interval stays the unpaired one and its caption says so
        how_ref, how_base = how, how
        if paired_seeds:
            how_ref = (
                f"Cells: mean difference over problems and training seeds with its {bootstrap.LEVEL:.0%} t "
                "interval paired by training seed (--paired-seeds: problem noise, and the seed noise of the "
                "per-seed differences of the two rows' runs, see analysis/bootstrap.py), for a row run on "
                "the reference's seeds; a row whose seeds differ keeps the unpaired interval (each side's "
                "own seed noise), named below the table; a side with one training seed gets none. "
                f"`{tables.MARKER}`: the interval excludes 0; `{tables.HOLM}`: it survives Holm's "
                "correction over the table's family. " + NOISE_SENTENCE
            )
            how_base = how.replace(
                "not pooled over the table:",
                "not pooled over the table; unpaired, the start model has no training seed:",
            )
        if ref_why is None:
            others = [r for r in trained_rows if r != ref_row]
            t = difference_table(
                pv, others, ref_row, columns, asked,
                name="diff_vs_reference", title=f"each method minus {ref_row}: pass@1 and pass@k",
                paired=paired_seeds,
            )  # fmt: skip
            add(t, f"Differences against {ref_row}", how_ref)
        else:
            notes.append(f"no differences against {ref_row!r}: {ref_why}")
        if primary is not None:
            sections.insert(0, primary_section(pv, primary, ref_row, trained_rows, asked, paired_seeds))
        if len(base_rows) == 1:
            t = difference_table(
                pv, trained_rows, base_rows[0], columns, asked,
                name="diff_vs_base", title="each method minus the start model (base): pass@1 and pass@k",
            )  # fmt: skip
            add(t, "Differences against the start model", how_base)
        else:
            notes.append(
                f"no differences against base: {len(base_rows)} base rows (one start model, evaluated under "
                "one setting, needed; --filter or --grid picks one)"
            )
        pairs = moved_pairs(ref_row, trained_rows, base_rows)
        if pairs:
            labels = {ds: dataset_labels(runs, src, ds, pv.ids.get(ds)) for ds in datasets}
            ids = {ds: v[0] for ds, v in labels.items() if not isinstance(v, str)}
            t, numbers, by_ds = moved_table(pv, pairs, ks, lost_threshold, ids)
            caption = MOVED_CAPTION.format(threshold=lost_threshold, level=bootstrap.LEVEL)
            add(t, "Which problems moved", caption)
            # the table's cells are texts: its CSV holds their numbers instead
            numbers.to_csv(tables_dir / "moved.csv", index=False)
            for ds in datasets:
                frame, pnotes = problems_csv(
                    pv, ds, ks[ds], [*base_rows, *trained_rows], by_ds.get(ds, {}), labels[ds]
                )
                notes += pnotes
                if frame is not None:
                    frame.to_csv(tables_dir / f"problems_{ds}.csv", index=False)
        else:
            notes.append("no 'Which problems moved' section: no reference nor base row to compare against")
        notes += list(pv.compared_on.values())
    else:
        notes.append("no differences nor 'Which problems moved' section: --bootstrap 0 computes no intervals")

    grids = grid_tables(runs, meas[meas["label"] == "trained"], asked, ks)
    for g in grids:
        add(g, "Branch threshold x ratio (Table 6)")
    if not grids:
        notes.append("no grid table: no Branch method has runs at more than one (threshold, ratio)")

    trained = runs[runs["method"] != "base"]
    grad = load.history_frame(client, list(trained["run_id"]), "train/grad_norm")
    gframe, gnotes = tables.grad_norm_frame(trained, grad)
    notes += gnotes
    add(
        tables.seed_table(
            gframe,
            asked,
            tables.THIRDS,
            name="grad_norm_thirds",
            title="mean train/grad_norm over the early / middle / late thirds of the training steps",
            rows=sorted(trained["row"].unique(), key=tables.row_key),
        ),
        "Gradient norm by thirds of training (Table 5)",
    )

    buckets = trained[["run_id", "row", "seed"]].merge(
        load.bucket_frame(client, trained, [stat for stat, _ in BUCKET_TABLES]), on="run_id"
    )
    if buckets.empty:
        notes.append(
            "no 'Where the anchor acted' section: no run logged train/anchor_buckets/<bucket>/<stat> "
            "(sage.objective.buckets)"
        )
    else:
        heading = "Where the anchor acted, by token entropy"
        trained_rows = sorted(trained["row"].unique(), key=tables.row_key)
        for stat, title in BUCKET_TABLES:
            per_run = buckets[buckets["stat"] == stat].groupby(["row", "seed", "bucket"], as_index=False)
            frame = per_run["value"].mean().rename(columns={"bucket": "column"})
            columns = [b for b in BUCKETS if b in set(frame["column"])]
            t = tables.seed_table(
                frame, asked, columns, name=f"anchor_buckets_{stat}", title=title, rows=trained_rows
            )
            add(t, heading, BUCKET_TEXT if stat == BUCKET_TABLES[0][0] else "")
            heading = None
        for p in figures.anchor_buckets(buckets, figures_dir):
            figs[p.stem] = p
            caption = f"where the anchor acted, {p.stem.removeprefix('anchor_buckets_')}: step x bucket"
            sections.append(_figure(p, out, caption + ", each cell the mean over the row's seeds"))

    frames = analysis_frames(runs, src, datasets)
    rows_all = sorted(src["row"].unique(), key=tables.row_key)
    for kind, name, heading, title, text in ANALYSES:
        frame = frames[kind]
        if frame.empty:
            if kind in ALWAYS_LOGGED:  # the others exist on the testbed only: their absence says nothing
                notes.append(
                    f"no {name} table: no run logged {kind}/<name>/<label>/<dataset> (sage.eval.analyses)"
                )
            continue
        t = tables.seed_table(
            frame, asked, list(dict.fromkeys(frame["column"])), name=name, rows=rows_all, title=title
        )
        add(t, heading, text)
    if perplexity_cap > 0:
        with tempfile.TemporaryDirectory() as tmp_name:
            tags_of = dict(zip(runs["run_id"], runs["tags"], strict=True))
            ppl, pnotes = perplexity_frame(client, src, datasets, Path(tmp_name), tags_of)
        notes += pnotes
        ppl = cap_per_source(ppl, perplexity_cap)
        if len(ppl):
            add(
                perplexity_table(ppl),
                "Perplexity under the base model (Figure 7)",
                f"At most {perplexity_cap} samples per run, as the evaluation logged (eval.perplexity_cap).",
            )
            figs["perplexity"] = figures.perplexity_distributions(ppl, figures_dir)
            sections.append(_figure(figs["perplexity"], out, "perplexity under the base model"))
        else:
            notes.append("no perplexity figure: no run logged perplexities under its base model")

    curves = src.merge(load.curve_frame(client, runs), on=["run_id", "label"])
    if curves.empty:
        notes.append("no pass@k curve figure: no run logged pass_at_k_curve/<label>/<dataset>")
    else:
        rows = sorted(curves["row"].unique(), key=tables.row_key)
        bands = curve_bands(pv, rows, datasets, draws, rng_seed) if draws > 0 else None
        band_text = "bands: mean ± std over training seeds"
        if bands is not None and len(bands):
            band_text = f"bands: {bootstrap.LEVEL:.0%} bootstrap interval over problems and training seeds"
            without = [r for r in rows if r not in set(bands["row"])]
            if without:  # no correctness matrices logged for them
                band_text += f" (mean ± std over seeds for {', '.join(without)})"
        for p in figures.passk_curves(curves[["row", "seed", "dataset", "k", "value"]], figures_dir, bands):
            figs[p.stem] = p
            caption = f"pass@k curves ({p.stem.removeprefix('passk_')}), Figure 3; {band_text}"
            sections.append(_figure(p, out, caption))

    tsrc = src[src["label"] == "trained"]
    reward = tsrc.merge(load.history_frame(client, list(tsrc["run_id"]), "train/reward"), on="run_id")
    periodic = tsrc.merge(load.periodic_frame(client, runs), on="run_id")
    if periodic.empty:
        notes.append(
            "Figure 2: no run logged pass_at_1/periodic/<dataset> (train with eval.every_steps=N): "
            "only the training reward is shown"
        )
    if reward.empty:
        notes.append("no Figure 2: no run logged train/reward")
    else:
        kl_free = set(trained.loc[trained["divergence"] == "none", "row"])
        figs["reward_vs_heldout"] = figures.reward_vs_accuracy(
            reward[["row", "seed", "step", "value"]],
            periodic[["row", "seed", "dataset", "step", "value"]],
            kl_free,
            figures_dir,
        )
        caption = "training reward vs held-out pass@1, Figure 2"
        sections.append(_figure(figs["reward_vs_heldout"], out, caption))

    head = f"# Results: {'selected runs' if run_ids else 'experiment ' + experiment}\n\n"
    head += provenance(uri, experiment, run_ids, sel) + "\n\n"
    head += "".join(f"**Warning:** {w}\n\n" for w in warnings)
    head += (
        "Cells: mean ± std (ddof=1) over training seeds; `± —`: one seed; `(n/m seeds)`: fewer seeds than "
        "asked, the mean is over those present.\n"
    )
    if {"diff_vs_reference", "diff_vs_base"} & set(made):
        head += (
            f"Differences between methods are shown with {bootstrap.LEVEL:.0%} t intervals over problems "
            f"and seeds, `{tables.MARKER}` where the interval excludes 0, `{tables.HOLM}` where the "
            f"difference also survives Holm's correction over its table. {NOISE_SENTENCE}\n"
        )
        if paired_seeds and "diff_vs_reference" in made:
            head += (
                f"Differences against {ref_row} are paired by training seed (--paired-seeds) for the rows "
                "run on its seeds; the other rows, and the differences against the start model, are not.\n"
            )
    note_text = "\n## Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n" if notes else ""
    # Included files (another sage-report, a measurement, a written reading) follow verbatim.
    included = "".join("\n" + Path(f).read_text() for f in includes)
    markdown = head + "\n" + "\n".join(sections) + note_text + included
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    return Report(markdown, made, figs, notes, warnings)


def _figure(path: Path, out: Path, caption: str) -> str:
    return f"![{caption}]({os.path.relpath(path, out.parent)})\n"


def primary_comparison(text: str) -> tuple[str, str, int]:
    """``--primary 'METHOD|DATASET|K'`` as (method, dataset, k)."""
    parts = text.split("|")
    if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected METHOD|DATASET|K, e.g. 'grpo_branch|arith_tail|256'"
        )
    return parts[0], parts[1], int(parts[2])


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line, as sage-report's own are (its usage is what --help prints)."""

    def error(self, message: str):
        self.exit(2, f"sage-report: {message} (sage-report --help lists the flags)\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = Parser(prog="sage-report", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--experiment",
        default="sage",
        help="MLflow experiment name, or several separated by commas (default: sage)",
    )
    p.add_argument("--run-ids", default="", help="comma-separated run ids instead of a whole experiment")
    p.add_argument("--filter", default="", help="MLflow filter string, e.g. \"tags.grid = '/sweep/dir'\"")
    p.add_argument(
        "--grid",
        default=None,
        help="only the runs of one grid (sage-train -m): latest (the grid whose driver ran last, not an "
        "Optuna study; the line printed names it), or its parent run's name (what it compared, e.g. "
        "'experiment=grpo,grpo_branch x seed=1,2'), its sweep dir, study or run id",
    )
    p.add_argument(
        "--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else outputs/mlflow.db"
    )
    p.add_argument("--seeds", default="", help="training seeds asked, e.g. 1,2,3 (default: all present)")
    p.add_argument("--k", type=int, default=None, help="k of the pass@k columns (default: largest logged)")
    p.add_argument("--out", type=Path, default=Path("docs/results/report.md"), help="the Markdown report")
    p.add_argument("--figures-dir", type=Path, default=None, help="default: <out dir>/figures")
    p.add_argument("--tables-dir", type=Path, default=None, help="default: <out dir>/tables")
    p.add_argument(
        "--perplexity-max", type=int, default=2000, help="logged perplexities shown per run; 0: no section"
    )
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--extra-k", default="", help="also tabulate methods at these k, e.g. 8 (comma-separated)")
    p.add_argument(
        "--include", type=Path, action="append", default=[], help="Markdown file appended verbatim"
    )
    p.add_argument(
        "--reference",
        default=None,
        help="method the differences are taken against: a conf/experiment preset or a row name, refused "
        "when no trained row is that (default: grpo, when there is a GRPO row)",
    )
    p.add_argument(
        "--primary",
        type=primary_comparison,
        help="the one comparison declared before the run, 'METHOD|DATASET|K' (a preset or row name, minus "
        "--reference, at pass@K): reported first, with its own interval and p-value, outside the tables' "
        "families",
    )
    p.add_argument(
        "--paired-seeds",
        action="store_true",
        help="differences between trained rows run on the same training seeds get the interval paired by "
        "seed (analysis/bootstrap.py: rows sharing seeds share much of their seed noise); rows whose seeds "
        "differ, and differences against the start model, keep the unpaired one (the report says which)",
    )
    p.add_argument(
        "--lost-threshold",
        type=float,
        default=moved.LOST_THRESHOLD,
        help="a problem is lost by a method when its pass@k is below this times the other row's (and gained "
        "the other way round): the 'Which problems moved' section (default: 0.5)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=2000,
        help="bootstrap draws of the curves' bands; 0: no bands nor intervals",
    )
    p.add_argument("--bootstrap-seed", type=int, default=0, help="RNG seed of the bootstrap (reproducible)")
    p.add_argument(
        "--min-seeds", type=int, default=5, help="warn when a Table 1 method has fewer training seeds"
    )
    p.add_argument(
        "--log-to-mlflow",
        action="store_true",
        help="also log the report (markdown, figures, tables) as artifacts of a parent run for these "
        "experiment(s), filter and run ids: made on the first call, reused by the next ones",
    )
    p.add_argument(
        "--export",
        type=Path,
        metavar="FILE",
        help="write the store's runs of --experiment (what this report reads of them: tags, params, latest "
        "metrics, the curves' histories, correctness matrices packed to bits) to FILE (.json.gz) and nothing "
        "else, for --snapshot to rebuild the report without the store (analysis/snapshot.py)",
    )
    p.add_argument(
        "--snapshot",
        type=Path,
        metavar="FILE",
        help="read the runs from a file --export wrote instead of an MLflow store: the same tables",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only check that the store holds runs of the experiment(s) and filter; writes nothing "
        "(a grid whose report reuses another grid's runs checks for them before it trains)",
    )
    return p.parse_args(argv)


# integer flags and their smallest value, with what it means
AT_LEAST = {
    "k": (1, "pass@k needs k >= 1"),
    "bootstrap": (0, "the bootstrap draws are 0 (no intervals nor bands) or more"),
    "bootstrap_seed": (0, "an RNG seed is 0 or more"),
    "perplexity_max": (0, "the perplexities shown per run are 0 (no section) or more"),
    "digits": (0, "the digits shown are 0 or more"),
}


def checked_flags(args: argparse.Namespace) -> list[int]:
    """A ReportError naming the first flag whose value sage-report cannot use, before any store is opened
    or file written; else ``--extra-k`` as integers."""
    for name, (least, why) in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ReportError(f"--{name.replace('_', '-')} {value}: {why}")
    parts = [x.strip() for x in args.extra_k.split(",") if x.strip()]
    if not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise ReportError(
            f"--extra-k takes integers >= 1 separated by commas (e.g. 8,64), not {args.extra_k!r}"
        )
    return [int(x) for x in parts]


def readable_store(uri: str | None):
    """``load.open_existing_store`` and one query, under sage-train's probe limits: a corrupt SQLite file or
    a dead or hung server is one line, not MLflow's traceback from the first table read."""
    try:
        with probe_limits():
            client, resolved = load.open_existing_store(uri)
            client.search_experiments(max_results=1)
    except ReportError:
        raise
    except Exception as e:
        raise ReportError(
            f"the MLflow store {redact(resolve_uri(uri))} cannot be read: {store_failure(e)}"
        ) from e
    return client, resolved


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per download otherwise
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or None
    except ValueError:
        print(f"sage-report: --seeds takes integers separated by commas, not {args.seeds!r}", file=sys.stderr)
        return 2
    try:
        extra_ks = checked_flags(args)
    except ReportError as e:
        print(f"sage-report: {e}", file=sys.stderr)
        return 2
    missing = [str(f) for f in args.include if not Path(f).is_file()]
    if missing:
        print(f"sage-report: --include file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    clash = [
        flag
        for flag, given in (("--tracking-uri", args.tracking_uri), ("--export", args.export),
                            ("--log-to-mlflow", args.log_to_mlflow), ("--check", args.check))
        if given
    ]  # fmt: skip
    if args.snapshot and clash:
        print(f"sage-report: --snapshot reads a file, not a store: drop {', '.join(clash)}", file=sys.stderr)
        return 2
    try:
        if args.snapshot:
            client = snapshot.SnapshotClient(args.snapshot)
            uri = f"{cwd_relative_path(args.snapshot)} (snapshot of {client.source})"
        else:
            client, uri = readable_store(args.tracking_uri)
        if args.export:
            n = snapshot.export(client, portable_uri(uri), args.experiment, args.export)
            size = args.export.stat().st_size
            print(
                f"snapshot: {args.export} ({n['runs']} runs, {n['points']} curve points, {n['artifacts']} "
                f"artifacts, {size / 1e6:.2f} MB) of {args.experiment} in {portable_uri(uri)}"
            )
            return 0
        if args.check:
            n = len(load.fetch_runs(client, args.experiment, [], args.filter))
            if n == 0:
                raise ReportError(f"experiment(s) {args.experiment!r} hold no runs matching {args.filter!r}")
            matching = f" matching {args.filter!r}" if args.filter else ""
            print(f"ok: {n} runs in {args.experiment}{matching}")
            return 0
        filter_string = args.filter
        if args.grid:
            parent, when = find_grid(client, args.experiment, args.grid)
            children = f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
            filter_string = f"{children} and {args.filter}" if args.filter else children
            print(grid_line(parent, when))
        rep = make_report(
            client,
            uri,
            experiment=args.experiment,
            run_ids=[r for r in args.run_ids.split(",") if r.strip()],
            filter_string=filter_string,
            seeds=seeds,
            k=args.k,
            out=args.out,
            figures_dir=args.figures_dir or args.out.parent / "figures",
            tables_dir=args.tables_dir or args.out.parent / "tables",
            perplexity_cap=args.perplexity_max,
            digits=args.digits,
            extra_ks=extra_ks,
            includes=args.include,
            reference=args.reference,
            draws=args.bootstrap,
            rng_seed=args.bootstrap_seed,
            min_seeds=args.min_seeds,
            primary=args.primary,
            lost_threshold=args.lost_threshold,
            paired_seeds=args.paired_seeds,
        )
    except ReportError as e:
        print(f"sage-report: {e}", file=sys.stderr)
        return 2
    for n in rep.notes:
        print(f"note: {n}", file=sys.stderr)
    for w in rep.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"report: {args.out} ({len(rep.tables)} tables, {len(rep.figures)} figures)")
    if args.log_to_mlflow:
        from sage.parent_runs import log_report_files, report_parent

        key = f"experiment={args.experiment} filter={args.filter} run_ids={args.run_ids}"
        run_id = report_parent(client, args.experiment, key)
        figures = args.figures_dir or args.out.parent / "figures"
        log_report_files(client, run_id, args.out, figures, args.tables_dir or args.out.parent / "tables")
        client.set_terminated(run_id, status="FINISHED")
        print(f"logged into MLflow run {run_id} (artifacts under report/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
