"""Which runs and rows a report is about: the finished ``sage-train`` runs selected, the row each joins, the
(run, evaluation) that gives each row's numbers per seed, its pass@k measurements, the reference row, and
the notes and warnings saying what was left out or is thin."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from analysis import load, tables
from analysis.load import ReportError
from sage.metrics import metric_name
from sage.tracking import PARENT_TAG
from sage.train.untrained import UNTRAINED_TAG

SOURCES = ["row", "seed", "run_id", "label"]


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
