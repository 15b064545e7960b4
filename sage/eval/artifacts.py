"""What a person opens of an evaluation in its MLflow run (``sage.tracking.Tracker.log_eval``): the pass@k
table and figure of a dataset, every label evaluated so far, and the completions of one seed as a table."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def passk_table(curves: dict[str, list[dict[int, float]]]):
    """label -> per-seed pass@k curves -> one row per (label, k): mean, std (None with one seed), min and
    max over the seeds, and the number of seeds."""
    import pandas as pd

    rows = []
    for label, per_seed in curves.items():
        for k in per_seed[0]:
            values = np.array([c[k] for c in per_seed])
            std = float(values.std(ddof=1)) if len(values) > 1 else None
            rows.append((label, k, float(values.mean()), std, values.min(), values.max(), len(values)))
    return pd.DataFrame(rows, columns=["label", "k", "mean", "std", "min", "max", "seeds"])


def passk_figure(table, dataset: str, path: Path) -> Path:
    """:func:`passk_plot` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = passk_plot(table, dataset)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def passk_plot(table, dataset: str):
    """pass@k against k on a log axis, a line per label (base, trained) with the seeds' range as a band
    (none with one evaluation seed); the title in two short lines, which fit the figure's width."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a job on a cluster node
    import matplotlib.pyplot as plt

    seeds = int(table["seeds"].max())
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, part in table.groupby("label", sort=False):
        ax.plot(part["k"], part["mean"], marker=".", label=label)
        if seeds > 1:
            ax.fill_between(part["k"], part["min"], part["max"], alpha=0.25)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k")
    band = f"band: range over {seeds} evaluation seeds" if seeds > 1 else "one evaluation seed: no band"
    ax.set_title(f"pass@k on {dataset}\n{band}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def completions_table(completions: list, correct, rows: list[dict] | None, n_problems: int | None):
    """One line per sample of the first ``n_problems`` problems (None: all): problem index, sample,
    prompt and gold (from ``rows``; empty without them), completion, extracted answer, correct."""
    import pandas as pd

    from sage.grading import _completion_text, _safe_extract

    lines = []
    for i, samples in enumerate(completions[:n_problems]):
        row = rows[i] if rows is not None else {}
        for j, completion in enumerate(samples):
            text = _completion_text(completion)
            lines.append(
                {
                    "problem": i,
                    "sample": j,
                    "prompt": str(row.get("problem", "")),
                    "gold": str(row.get("answer", "")),
                    "completion": text,
                    "extracted_answer": _safe_extract(text) or "",
                    "correct": bool(correct[i][j]),
                }
            )
    return pd.DataFrame(lines)
