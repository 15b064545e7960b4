"""'Which problems moved': the problems each compared pair (each method against the reference, and against
the start model) lost and gained at pass@k and where its curves cross, per seed pair, from the correctness
matrices (``analysis.moved``); with ``tables/moved.csv`` and one ``tables/problems_<dataset>.csv`` per
dataset."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis import bootstrap, moved, tables
from analysis.inputs import Inputs
from analysis.page import Page
from analysis.problem_values import ProblemValues
from analysis.tables import Table

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


def add(page: Page, inputs: Inputs, lost_threshold: float) -> None:
    pv, ks, datasets, base_rows = inputs.pv, inputs.ks, inputs.datasets, inputs.base_rows
    pairs = moved_pairs(inputs.ref_row, inputs.trained_rows, base_rows)
    if not pairs:
        page.notes.append("no 'Which problems moved' section: no reference nor base row to compare against")
        return
    labels = {ds: dataset_labels(inputs.runs, inputs.src, ds, pv.ids.get(ds)) for ds in datasets}
    ids = {ds: v[0] for ds, v in labels.items() if not isinstance(v, str)}
    t, numbers, by_ds = moved_table(pv, pairs, ks, lost_threshold, ids)
    caption = MOVED_CAPTION.format(threshold=lost_threshold, level=bootstrap.LEVEL)
    page.table(t, "Which problems moved", caption)
    # the table's cells are texts: its CSV holds their numbers instead
    numbers.to_csv(page.tables_dir / "moved.csv", index=False)
    for ds in datasets:
        frame, pnotes = problems_csv(
            pv, ds, ks[ds], [*base_rows, *inputs.trained_rows], by_ds.get(ds, {}), labels[ds]
        )
        page.notes += pnotes
        if frame is not None:
            frame.to_csv(page.tables_dir / f"problems_{ds}.csv", index=False)
