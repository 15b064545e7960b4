"""The report's curve figures: each row's pass@k curves (Figure 3) with their bootstrap bands over problems
and seeds, and training reward vs held-out pass@1 over the steps (Figure 2)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from analysis import bootstrap, figures, load, tables
from analysis.inputs import Inputs
from analysis.page import Page
from analysis.problem_values import ProblemValues


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


def add_passk(page: Page, inputs: Inputs, draws: int, rng_seed: int) -> None:
    curves = inputs.src.merge(load.curve_frame(inputs.client, inputs.runs), on=["run_id", "label"])
    if curves.empty:
        page.notes.append("no pass@k curve figure: no run logged pass_at_k_curve/<label>/<dataset>")
        return
    rows = sorted(curves["row"].unique(), key=tables.row_key)
    bands = curve_bands(inputs.pv, rows, inputs.datasets, draws, rng_seed) if draws > 0 else None
    band_text = "bands: mean ± std over training seeds"
    if bands is not None and len(bands):
        band_text = f"bands: {bootstrap.LEVEL:.0%} bootstrap interval over problems and training seeds"
        without = [r for r in rows if r not in set(bands["row"])]
        if without:  # no correctness matrices logged for them
            band_text += f" (mean ± std over seeds for {', '.join(without)})"
    for p in figures.passk_curves(curves[["row", "seed", "dataset", "k", "value"]], page.figures_dir, bands):
        caption = f"pass@k curves ({p.stem.removeprefix('passk_')}), Figure 3; {band_text}"
        page.figure(p.stem, p, caption)


def add_reward_vs_heldout(page: Page, inputs: Inputs) -> None:
    src, runs, client = inputs.src, inputs.runs, inputs.client
    tsrc = src[src["label"] == "trained"]
    reward = tsrc.merge(load.history_frame(client, list(tsrc["run_id"]), "train/reward"), on="run_id")
    periodic = tsrc.merge(load.periodic_frame(client, runs), on="run_id")
    if periodic.empty:
        page.notes.append(
            "Figure 2: no run logged pass_at_1/periodic/<dataset> (train with eval.every_steps=N): "
            "only the training reward is shown"
        )
    if reward.empty:
        page.notes.append("no Figure 2: no run logged train/reward")
        return
    trained = inputs.trained
    kl_free = set(trained.loc[trained["divergence"] == "none", "row"])
    path = figures.reward_vs_accuracy(
        reward[["row", "seed", "step", "value"]],
        periodic[["row", "seed", "dataset", "step", "value"]],
        kl_free,
        page.figures_dir,
    )
    page.figure("reward_vs_heldout", path, "training reward vs held-out pass@1, Figure 2")
