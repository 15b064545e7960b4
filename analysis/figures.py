"""Figures as PNGs from tidy frames (matplotlib's Agg backend: no display needed).

Lines are means over training seeds; bands span mean ± std over seeds (no band with one seed), except the
pass@k curves, whose bands are bootstrap intervals over problems and seeds when the report has them. The
pass@k curves have one panel per row: stacked in one panel, their bands hid each other's lines.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from analysis.tables import row_key  # noqa: E402


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_")


def _mean_band(frame: pd.DataFrame, x: str) -> pd.DataFrame:
    """Per x: mean and std (ddof=1, NaN with one seed) of value over seeds."""
    g = frame.groupby(x)["value"]
    return pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=1), "n": g.count()}).reset_index()


def _line(
    ax,
    frame: pd.DataFrame,
    x: str,
    label: str,
    dashed: bool = False,
    band: pd.DataFrame | None = None,
    color: str | None = None,
) -> None:
    """Mean over seeds; shaded: ``band`` (x, lo, hi) if given, else mean ± std over seeds."""
    s = _mean_band(frame, x).sort_values(x)
    style = "--" if dashed else "-"
    (line,) = ax.plot(s[x], s["mean"], style, marker=".", markersize=3, label=label, color=color, zorder=3)
    if band is not None and len(band):
        b = band.sort_values(x)
        ax.fill_between(b[x], b["lo"], b["hi"], color=line.get_color(), alpha=0.2, linewidth=0)
        return
    band = s["std"].notna()
    if band.any():
        ax.fill_between(
            s.loc[band, x],
            (s["mean"] - s["std"])[band],
            (s["mean"] + s["std"])[band],
            color=line.get_color(),
            alpha=0.2,
            linewidth=0,
        )


OTHER_ROWS = "0.7"  # the grey of the other rows' lines in a row's pass@k panel


def passk_curves(curves: pd.DataFrame, out_dir: Path, bands: pd.DataFrame | None = None) -> list[Path]:
    """Figure 3: pass@k against k = 1..n (log scale) per dataset (:func:`passk_panels`), one PNG each.
    ``curves``: row, seed, dataset, k, value. ``bands``: row, dataset, k, lo, hi (the bootstrap band of
    ``analysis.sections.curves.curve_bands``); a row without one gets mean ± std over seeds."""
    return [
        _save(passk_panels(sub, str(ds), bands), out_dir / f"passk_{_slug(str(ds))}.png")
        for ds, sub in curves.groupby("dataset")
    ]


def passk_panels(sub: pd.DataFrame, ds: str, bands: pd.DataFrame | None = None):
    """One dataset's pass@k figure: one panel per row, its mean over seeds in colour with its band, and
    every other row's mean as a thin grey line to compare against, so no band hides a line."""
    rows = sorted(sub["row"].unique(), key=row_key)
    ncols = min(len(rows), 3)
    nrows = math.ceil(len(rows) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows), sharex=True, sharey=True, squeeze=False
    )
    means = {row: _mean_band(sub[sub["row"] == row], "k").sort_values("k") for row in rows}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, row) in enumerate(zip(axes.flat, rows, strict=False)):
        for other in rows:
            if other != row:
                ax.plot(means[other]["k"], means[other]["mean"], color=OTHER_ROWS, linewidth=0.8, zorder=2)
        band = None if bands is None else bands[(bands["row"] == row) & (bands["dataset"] == ds)]
        _line(ax, sub[sub["row"] == row], "k", row, band=band, color=colors[i % len(colors)])
        ax.set_title(row, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 1, 2, 4, ... not 2^0
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(rows) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("k (samples)")
    for ax in axes[:, 0]:
        ax.set_ylabel("pass@k")
    fig.suptitle(f"pass@k on {ds} (grey: the other rows)", fontsize=10)
    return fig


def reward_vs_accuracy(
    reward: pd.DataFrame, periodic: pd.DataFrame, kl_free: Collection[str], out_dir: Path
) -> Path:
    """Figure 2: training reward (left) and held-out pass@1 during training (one column per dataset) over
    optimiser steps, one row of panels per method: its mean over seeds in colour with its band, every
    other method's mean as a thin grey line behind it (methods that train alike drew one line over the
    other in a shared panel, and one vanished). Methods without a KL anchor are dashed. ``reward``: row,
    seed, step, value; ``periodic``: row, seed, dataset, step, value (may be empty: the reward alone)."""
    # no periodic evaluation: the reward panels alone (the report's notes say how to get the other)
    datasets = sorted(periodic["dataset"].unique()) if len(periodic) else []
    rows = sorted(reward["row"].unique(), key=row_key)
    ncols = 1 + len(datasets)
    fig, axes = plt.subplots(
        len(rows), ncols, figsize=(5 * ncols, 3 * len(rows)), sharex=True, sharey="col", squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [(reward, "mean reward", "training reward")] + [
        (periodic[periodic["dataset"] == ds], "pass@1", f"held-out pass@1 ({ds})") for ds in datasets
    ]
    for i, row in enumerate(rows):
        for ax, (frame, ylabel, title) in zip(axes[i], panels, strict=True):
            for other in rows:
                if other != row and (frame["row"] == other).any():
                    m = _mean_band(frame[frame["row"] == other], "step").sort_values("step")
                    style = "--" if other in kl_free else "-"
                    ax.plot(m["step"], m["mean"], style, color=OTHER_ROWS, linewidth=0.8, zorder=2)
            if (frame["row"] == row).any():
                own = frame[frame["row"] == row]
                _line(ax, own, "step", row, dashed=row in kl_free, color=colors[i % len(colors)])
            ax.set(ylabel=ylabel, title=f"{row}: {title}")
            ax.title.set_fontsize(9)
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes[-1]:
        ax.set_xlabel("optimiser step")
    return _save(fig, out_dir / "reward_vs_heldout.png")


def perplexity_distributions(ppl: pd.DataFrame, out_dir: Path) -> Path:
    """Figure 7: distribution of each row's sample perplexities under the base model (log scale), pooled
    over seeds. ``ppl``: row, seed, ppl."""
    rows = sorted(ppl["row"].unique(), key=row_key)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows)), 4))
    data = [ppl.loc[ppl["row"] == r, "ppl"].dropna().to_numpy() for r in rows]
    ax.boxplot(data, whis=(5, 95))  # whiskers at the 5th/95th percentiles: the tails are the point
    ax.set_yscale("log")
    ax.set_xticks(range(1, len(rows) + 1), rows, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="perplexity under the base model", title="sample perplexity under the base model")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out_dir / "perplexity_under_base.png")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def anchor_buckets(history: pd.DataFrame, out_dir: Path) -> list[Path]:
    """One step x bucket figure per row (run_id, row, seed, bucket, stat, step, value: each cell the mean
    over the row's seeds), drawn as each run's own ``anchor_buckets.png`` is (sage.train.figures)."""
    from sage.train.figures import anchor_buckets_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in sorted(history["row"].unique(), key=row_key):
        mean = history[history["row"] == row].groupby(["step", "bucket", "stat"])["value"].mean()
        log: dict[int, dict] = {}
        for (step, bucket, stat), value in mean.items():
            log.setdefault(int(step), {"step": int(step)})[f"anchor_buckets/{bucket}/{stat}"] = float(value)
        path = out_dir / f"anchor_buckets_{_slug(row)}.png"
        path = anchor_buckets_figure([log[s] for s in sorted(log)], path)
        if path is not None:
            paths.append(path)
    return paths
