"""The methods' tables from their logged metrics: pass@1 and pass@k of each row (Tables 1, 3, 4, 9, also at
each ``--extra-k``), the Branch guide's threshold x ratio grid (Table 6) and the gradient norm by thirds
of training (Table 5)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from analysis import figures, load, tables
from analysis.inputs import Inputs
from analysis.page import Page
from analysis.tables import Table


def add_ablation(page: Page, inputs: Inputs, extra_ks: Sequence[int]) -> None:
    page.table(tables.ablation_table(inputs.meas, inputs.asked, inputs.ks), "Methods (Tables 1, 3, 4, 9)")
    for kx in extra_ks:  # the same table at other k (e.g. Table 1 at k = 8 beside k = 64)
        t = tables.ablation_table(inputs.meas, inputs.asked, {ds: kx for ds in inputs.ks})
        t.name = f"ablation_k{kx}"
        page.table(t, f"Methods at pass@{kx}")


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


def add_grid(page: Page, inputs: Inputs) -> None:
    meas = inputs.meas
    grids = grid_tables(inputs.runs, meas[meas["label"] == "trained"], inputs.asked, inputs.ks)
    for g in grids:
        page.table(g, "Branch threshold x ratio (Table 6)")
    if not grids:
        page.notes.append("no grid table: no Branch method has runs at more than one (threshold, ratio)")


def add_grad_norm(page: Page, inputs: Inputs) -> None:
    trained = inputs.trained
    grad = load.history_frame(inputs.client, list(trained["run_id"]), "train/grad_norm")
    gframe, gnotes = tables.grad_norm_frame(trained, grad)
    page.notes += gnotes
    page.table(
        tables.seed_table(
            gframe,
            inputs.asked,
            tables.THIRDS,
            name="grad_norm_thirds",
            title="mean train/grad_norm over the early / middle / late thirds of the training steps",
            rows=sorted(trained["row"].unique(), key=tables.row_key),
        ),
        "Gradient norm by thirds of training (Table 5)",
    )
