"""Per-pair intervals (analysis/bootstrap.py since issue 42) recomputed from a sage-report's tables when the
store that made them is gone, for tables made while the seed noise was pooled over a table's trained rows.

    .venv/bin/python scripts/per_pair_from_pooled_tables.py docs/results/tables_fork --problems 100 --seeds 8

What the tables hold, and what this does with it:
- ``ablation*.csv``: each row's mean and std over its training seeds, so each side's own seed part
  (std^2 / seeds) is exact, and the pooled one the old interval used (the mean of the trained rows' std^2,
  every row with the same seeds) too;
- ``diff_vs_*.csv``: the old interval's se and df. The problem part is se^2 less the pooled seed part; the
  old Welch-Satterthwaite df recomputed from the two parts must equal the CSV's (checked: a one-line error
  if not, e.g. a wrong --problems or --seeds).
The one term the tables do not hold: the problem part's residual correction, which used the pooled residual
variance where the per-pair interval uses the two sides' own. It is kept at the pooled value, so a cell's
new interval is exact up to (pooled - own residual variance) / (seeds x problems) in its variance. Prints,
per table, every cell whose mark changed, and the median detectable difference per column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis import bootstrap  # noqa: E402


def mark(lo: float, hi: float, holm: bool) -> str:
    return ("*" if lo > 0 or hi < 0 else "") + ("†" if holm else "")


def recompute(tables: Path, problems: int, seeds: int) -> dict[str, pd.DataFrame]:
    ablation = pd.concat([pd.read_csv(f) for f in sorted(tables.glob("ablation*.csv"))])
    trained = ablation[ablation["row"] != "base"].drop_duplicates(["row", "column"])
    bad = trained[trained["seeds"] != seeds]
    if len(bad):
        raise SystemExit(f"{tables}: rows with other than --seeds {seeds} seeds: {sorted(set(bad['row']))}")
    sd = {(r.row, r.column): r.std for r in trained.itertuples()}
    rows = sorted(set(trained["row"]))
    out = {}
    for name in ("diff_vs_reference", "diff_vs_base"):
        t = pd.read_csv(tables / f"{name}.csv")
        ref_is_base = name == "diff_vs_base"
        if ref_is_base:
            ref = None
        else:  # the reference: the trained row that is not a row of the table
            (ref,) = sorted(set(rows) - set(t["row"]))
        cells = []
        for r in t.itertuples():
            pooled = float(np.mean([sd[(x, r.column)] ** 2 for x in rows]))
            inv = 1 / seeds + (0 if ref_is_base else 1 / seeds)
            old_seed = pooled * inv
            problem = r.se**2 - old_seed
            df = r.se**4 / (old_seed**2 / (len(rows) * (seeds - 1)) + problem**2 / (problems - 1))
            if abs(df - r.df) > 1e-6 * r.df:
                raise SystemExit(
                    f"{tables / name}.csv row {r.row!r} {r.column!r}: df {r.df:.4f} but {df:.4f} rebuilt "
                    f"from --problems {problems}, --seeds {seeds} and {len(rows)} trained rows"
                )
            own = sd[(r.row, r.column)] ** 2 / seeds + (
                0 if ref_is_base else sd[(ref, r.column)] ** 2 / seeds
            )
            i = bootstrap.t_interval(r.diff, [own, max(problem, 0.0)], [seeds - 1, problems - 1])
            cells.append({"row": r.row, "column": r.column, "old": r.text, "p_old": r.p, "interval": i})
        frame = pd.DataFrame(cells)
        holm = bootstrap.holm([c.p for c in frame["interval"]])
        frame["new"] = [
            f"{i.diff:+.3f} [{i.lo:.3f}, {i.hi:.3f}] {mark(i.lo, i.hi, h)}".rstrip()
            for i, h in zip(frame["interval"], holm, strict=True)
        ]
        frame["p_new"] = [i.p for i in frame["interval"]]
        frame["mde_new"] = [i.mde for i in frame["interval"]]
        frame["mark_old"] = [o.split("]")[-1].strip() for o in frame["old"]]
        frame["mark_new"] = [n.split("]")[-1].strip() for n in frame["new"]]
        out[name] = frame
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", type=Path)
    ap.add_argument("--problems", type=int, required=True, help="problems per dataset the runs evaluated")
    ap.add_argument("--seeds", type=int, required=True, help="training seeds of every trained row")
    args = ap.parse_args(argv)
    for name, frame in recompute(args.tables, args.problems, args.seeds).items():
        changed = frame[frame["mark_old"] != frame["mark_new"]]
        print(f"## {name}: {len(changed)} of {len(frame)} marks changed\n")
        print("| row | column | pooled (before) | p | per pair | p |\n|---|---|---|---|---|---|")
        for r in changed.itertuples():
            print(f"| {r.row} | {r.column} | {r.old} | {r.p_old:.4f} | {r.new} | {r.p_new:.4f} |")
        mdes = frame.groupby("column", sort=False)["mde_new"].median()
        print("\nSmallest difference detectable with 80% power, median over rows: ", end="")
        print("; ".join(f"{c} {m:.3f}" for c, m in mdes.items()) + "\n")
        if name == "diff_vs_reference":
            print(frame[["row", "column", "new", "p_new", "mde_new"]].to_string(index=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
