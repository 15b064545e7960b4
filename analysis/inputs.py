"""What every section of a report reads, gathered once and checked before anything is written: the selected
runs, their rows and sources, the pass@k measurements, the reference row and the correctness matrices, with
the notes and warnings so far."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis import load, tables
from analysis.load import ReportError
from analysis.problem_values import ProblemValues, disagreement
from analysis.selection import (
    Selection,
    check_k,
    disagreeing_base_notes,
    few_seeds_warning,
    measurements,
    missing_eval_notes,
    reference_row,
    select,
    sources,
    untrained_notes,
)


@dataclass
class Inputs:
    """The report's runs and rows, and where each row's numbers come from (see ``gather``)."""

    client: object
    sel: Selection
    evals: pd.DataFrame  # every logged pass@k point of every run (load.eval_frame)
    src: pd.DataFrame  # (row, seed, run_id, label): which evaluation gives each row's numbers per seed
    ks: dict[str, int]  # the k of each dataset's pass@k column
    meas: pd.DataFrame  # (row, seed, run_id, label, dataset, k, value)
    trained_rows: list[str]
    ref_row: str
    ref_why: str | None  # why there are no differences against ref_row; None when there are
    pv: ProblemValues
    notes: list[str]
    warnings: list[str]

    @property
    def runs(self) -> pd.DataFrame:
        return self.sel.runs

    @property
    def asked(self) -> list[int]:
        return self.sel.seeds

    @property
    def datasets(self) -> list[str]:
        return sorted(self.ks)

    @property
    def trained(self) -> pd.DataFrame:
        """The runs that trained: every one but method=base's."""
        return self.runs[self.runs["method"] != "base"]

    @property
    def base_rows(self) -> list[str]:
        return sorted(self.src.loc[self.src["label"] == "base", "row"].unique())


def gather(
    client,
    experiment: str,
    run_ids: Sequence[str],
    filter_string: str,
    seeds: Sequence[int] | None,
    k: int | None,
    extra_ks: Sequence[int],
    reference: str | None,
    min_seeds: int,
) -> Inputs:
    """The report's inputs, or a ReportError when they make no report: no pass@k logged, a k above every
    evaluation's samples, a ``--reference`` that names no row, or logged pass@k its matrices contradict."""
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
    return Inputs(client, sel, evals, src, ks, meas, trained_rows, ref_row, ref_why, pv, notes, warnings)
