"""Perplexity of the evaluation samples under the base model (Figure 7): a table pooled over seeds and the
distributions' figure, from the per-sample perplexities each evaluation logged."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import figures, load, tables
from analysis.inputs import Inputs
from analysis.page import Page
from analysis.selection import SOURCES
from analysis.tables import Table
from sage.metrics import metric_name


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


def perplexity_table(ppl: pd.DataFrame) -> Table:
    rows = []
    for row in sorted(ppl["row"].unique(), key=tables.row_key):
        v = ppl.loc[ppl["row"] == row, "ppl"].to_numpy()
        values = (np.median(v), v.mean(), np.percentile(v, 90))
        rows.append((row, [str(len(v)), *(f"{x:.3f}" for x in values)]))
    columns = ["samples", "median", "mean", "90th percentile"]
    title = "perplexity of samples under the base model (pooled over seeds)"
    return Table("perplexity", title, columns, rows)


def add(page: Page, inputs: Inputs, cap: int) -> None:
    runs = inputs.runs
    with tempfile.TemporaryDirectory() as tmp_name:
        tags_of = dict(zip(runs["run_id"], runs["tags"], strict=True))
        ppl, pnotes = perplexity_frame(inputs.client, inputs.src, inputs.datasets, Path(tmp_name), tags_of)
    page.notes += pnotes
    ppl = cap_per_source(ppl, cap)
    if not len(ppl):
        page.notes.append("no perplexity figure: no run logged perplexities under its base model")
        return
    page.table(
        perplexity_table(ppl),
        "Perplexity under the base model (Figure 7)",
        f"At most {cap} samples per run, as the evaluation logged (eval.perplexity_cap).",
    )
    path = figures.perplexity_distributions(ppl, page.figures_dir)
    page.figure("perplexity", path, "perplexity under the base model")
