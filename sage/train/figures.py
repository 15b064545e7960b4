"""The run's own figures drawn from its training log: where the anchor acted, step by step and by
token-entropy bucket (``anchor_buckets/`` of ``sage.objective.buckets``)."""

from __future__ import annotations

import math
from pathlib import Path

from sage.objective.buckets import FIXED, QUINTILES

BUCKETS = (*QUINTILES, f"above_{FIXED:g}")
PANELS = (
    ("anchor_grad_share", "anchor's share of the gradient signal"),
    ("q", "mean guide q"),
    ("share", "share of tokens"),
)


def bucket_grid(log_history: list[dict], stat: str) -> tuple[list[int], list[list[float]]]:
    """(steps, rows): for each bucket of BUCKETS a row of ``stat`` at each logged step (NaN where the bucket
    was empty or the step logged no buckets)."""
    entries = [e for e in log_history if any(k.startswith("anchor_buckets/") for k in e)]
    steps = [int(e["step"]) for e in entries]
    rows = [[e.get(f"anchor_buckets/{b}/{stat}", math.nan) for e in entries] for b in BUCKETS]
    return steps, rows


def anchor_buckets_figure(log_history: list[dict], path: Path) -> Path | None:
    """A step x bucket heat map per statistic of PANELS into ``path`` (PNG); None when the log holds no
    bucket metrics (a run that trained no step)."""
    steps, _ = bucket_grid(log_history, PANELS[0][0])
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(PANELS), 1, figsize=(max(6, 0.12 * len(steps) + 3), 2.2 * len(PANELS)))
    for ax, (stat, title) in zip(axes, PANELS, strict=True):
        _, rows = bucket_grid(log_history, stat)
        image = ax.imshow(np.array(rows, dtype=float), aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(BUCKETS)), BUCKETS)
        ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
        ax.set_xticks(ticks, [steps[i] for i in ticks])
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax)
    axes[-1].set_xlabel("optimiser step (entropy quintiles of each step's tokens, q1 lowest)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
