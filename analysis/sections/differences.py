"""Differences between rows with their intervals: each method minus the reference row and minus the start
model at every (dataset, k) column, each table a family under Holm's correction (``analysis.bootstrap``),
and the comparison declared before the run (``--primary``), alone and placed first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from analysis import bootstrap, load, tables
from analysis.inputs import Inputs
from analysis.load import ReportError
from analysis.page import Page
from analysis.problem_values import ProblemValues
from analysis.tables import Diff, Table

NOISE_SENTENCE = (
    "A difference whose interval includes 0 is not distinguishable from seed and problem noise: it is not "
    "a result."
)


def captions(paired_seeds: bool) -> tuple[str, str]:
    """The captions of the tables against the reference and against the start model: which interval."""
    how = (
        f"Cells: mean difference over problems and training seeds with its {bootstrap.LEVEL:.0%} t "
        "interval (problem noise, and each side's own seed noise, not pooled over the table: see "
        "analysis/bootstrap.py); a side with one training seed gets none. "
        f"`{tables.MARKER}`: the interval excludes 0; `{tables.HOLM}`: it survives Holm's correction "
        "over the table's family. " + NOISE_SENTENCE
    )
    if not paired_seeds:
        return how, how
    # --paired-seeds: the reference table says which interval each row got; against the start model,
    # which has no training seed, the interval stays the unpaired one and its caption says so
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
    return how_ref, how_base


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


def add(
    page: Page,
    inputs: Inputs,
    extra_ks: Sequence[int],
    primary: tuple[str, str, int] | None,
    paired_seeds: bool,
) -> None:
    pv, ks, asked = inputs.pv, inputs.ks, inputs.asked
    trained_rows, ref_row, base_rows = inputs.trained_rows, inputs.ref_row, inputs.base_rows
    columns = [(ds, kk) for ds in inputs.datasets for kk in sorted({1, ks[ds], *extra_ks})]
    how_ref, how_base = captions(paired_seeds)
    if inputs.ref_why is None:
        others = [r for r in trained_rows if r != ref_row]
        t = difference_table(
            pv, others, ref_row, columns, asked,
            name="diff_vs_reference", title=f"each method minus {ref_row}: pass@1 and pass@k",
            paired=paired_seeds,
        )  # fmt: skip
        page.table(t, f"Differences against {ref_row}", how_ref)
    else:
        page.notes.append(f"no differences against {ref_row!r}: {inputs.ref_why}")
    if primary is not None:
        page.sections.insert(0, primary_section(pv, primary, ref_row, trained_rows, asked, paired_seeds))
    if len(base_rows) == 1:
        t = difference_table(
            pv, trained_rows, base_rows[0], columns, asked,
            name="diff_vs_base", title="each method minus the start model (base): pass@1 and pass@k",
        )  # fmt: skip
        page.table(t, "Differences against the start model", how_base)
    else:
        page.notes.append(
            f"no differences against base: {len(base_rows)} base rows (one start model, evaluated under "
            "one setting, needed; --filter or --grid picks one)"
        )
