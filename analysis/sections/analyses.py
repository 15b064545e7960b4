"""What each evaluation's samples showed (``sage.eval.analyses``): reasoning patterns (Table 2), the
solution-strategy mix, and on the testbed pass@k by tier and the rare strategy's share, each table with its
caption."""

from __future__ import annotations

import pandas as pd

from analysis import load, tables
from analysis.inputs import Inputs
from analysis.page import Page
from analysis.tables import SEED_FRAME

ALWAYS_LOGGED = ("pattern", "strategy")
"""The analyses every evaluation logs; the tier figures exist for testbed problems only."""
# (kind logged by sage.eval.analyses, table name, heading, title, caption)
ANALYSES = [
    (
        "pattern",
        "reasoning_patterns",
        "Reasoning patterns (Table 2)",
        "frequency of reasoning patterns among correct solutions",
        "The paper's formula over problems with a correct sample; see sage/eval/analyses.py.",
    ),
    (
        "strategy",
        "strategy_mix",
        "Solution-strategy mix of samples",
        "fraction of all evaluation samples following each testbed strategy",
        "`other`: not one of the testbed teacher's strategies (sage.testbed.task.classify_strategy).",
    ),
    (
        "tier",
        "tier_pass",
        "pass@k by tier of the testbed",
        "pass@1 and pass@n of each tier's held-out problems",
        "Tiers: sage.testbed.task.problem_tier. In the fork world a tail problem is one that only the rare "
        "strategy (`round`) solves under the teacher's rules; a trained policy can learn to solve some with "
        "`split` (docs/results/archive/fork_beta_pilot.md).",
    ),
    (
        "rare_share",
        "rare_share",
        "The rare strategy's share by tier (fork world)",
        "fraction of each tier's evaluation samples that follow the rare strategy (`round`)",
        "Under the teacher's rules the only strategy that solves tail problems; a trained policy can solve "
        "some without it, so a tail gain need not raise this share.",
    ),
]


def analysis_frames(runs: pd.DataFrame, src: pd.DataFrame, datasets: list[str]) -> dict[str, pd.DataFrame]:
    """Pattern frequencies and strategy mixes per (row, seed, column) from what each source's evaluation
    logged (``sage.eval.analyses``), keyed by kind; a column is prefixed by its dataset when there are
    several."""
    logged = src.merge(load.analysis_frame(runs), on=["run_id", "label"])
    logged = logged[logged["dataset"].isin(datasets)]
    prefix = logged["dataset"] + ": " if len(datasets) > 1 else ""
    logged = logged.assign(column=prefix + logged["name"])
    return {kind: logged.loc[logged["kind"] == kind, SEED_FRAME] for kind, *_ in ANALYSES}


def add(page: Page, inputs: Inputs) -> None:
    frames = analysis_frames(inputs.runs, inputs.src, inputs.datasets)
    rows_all = sorted(inputs.src["row"].unique(), key=tables.row_key)
    for kind, name, heading, title, text in ANALYSES:
        frame = frames[kind]
        if frame.empty:
            if kind in ALWAYS_LOGGED:  # the others exist on the testbed only: their absence says nothing
                page.notes.append(
                    f"no {name} table: no run logged {kind}/<name>/<label>/<dataset> (sage.eval.analyses)"
                )
            continue
        t = tables.seed_table(
            frame, inputs.asked, list(dict.fromkeys(frame["column"])), name=name, rows=rows_all, title=title
        )
        page.table(t, heading, text)
