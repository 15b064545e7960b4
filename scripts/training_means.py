"""Training metrics of a study, per row: each run's mean over its logged steps, then the mean and SD over the
row's seeds. What a guide did during training (``train/guide/q_fork``: its mean q on the fork's strategy
tokens; ``train/guide/active_frac``: the share of tokens where it acted), read from a committed snapshot
(``sage-report --export``) or a store:

    .venv/bin/python scripts/training_means.py docs/results/data/fork_study.json.gz \\
        --experiment testbed-fork --key train/guide/q_fork --key train/guide/active_frac

A key no run logged is one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analysis import load  # noqa: E402
from analysis.load import ReportError  # noqa: E402


def means(client, experiment: str, keys: Sequence[str], by_seed: bool = False) -> list[str]:
    runs = load.runs_frame(load.fetch_runs(client, experiment))
    runs = runs[(runs["kind"] == "train") & (runs["status"] == "FINISHED")]
    # the report's rows: a method split by what its runs differ in
    runs = runs.assign(row=load.assign_rows(runs))
    lines = []
    for key in keys:
        history = load.history_frame(client, list(runs["run_id"]), key)
        if history.empty:
            raise ReportError(f"--key {key}: no finished sage-train run of {experiment!r} logged it")
        per_run = history.groupby("run_id")["value"].agg(["mean", "count"]).join(runs.set_index("run_id"))
        lines.append(f"{key}: each run's mean over its logged steps, then mean (SD) over the row's seeds")
        for row, group in per_run.groupby("row", sort=False):
            seeds = ",".join(str(int(s)) for s in sorted(group["seed"]))
            steps = "/".join(str(c) for c in sorted(set(group["count"])))
            sd = group["mean"].std(ddof=1) if len(group) > 1 else float("nan")
            lines.append(
                f"  {row}: {group['mean'].mean():.4f} (SD {sd:.4f}), {len(group)} runs (seeds {seeds}), "
                f"{steps} steps each"
            )
            if by_seed:
                ordered = group.sort_values("seed")
                pairs = zip(ordered["seed"], ordered["mean"], strict=True)
                lines.append("    by seed: " + ", ".join(f"{int(seed)}: {m:.4f}" for seed, m in pairs))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "source", help="a snapshot file (.json.gz, sage-report --export) or an MLflow tracking URI"
    )
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--key", action="append", required=True, help="a training metric (repeatable)")
    ap.add_argument("--by-seed", action="store_true", help="also each run's mean, by seed")
    args = ap.parse_args(argv)
    try:
        if args.source.endswith(".json.gz"):
            from analysis.snapshot import SnapshotClient

            client = SnapshotClient(Path(args.source))
        else:
            client, _ = load.open_existing_store(args.source)
        print("\n".join(means(client, args.experiment, args.key, args.by_seed)))
    except ReportError as e:
        print(f"training_means: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
