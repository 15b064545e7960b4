"""Tables as pure functions of tidy frames: ``(row, seed, column, value)`` in, ``Table`` out.

Every cell is the mean ± std (ddof=1) over the training seeds of one row. The seeds asked for are explicit:
a cell with fewer seeds than asked says so (``0.412 ± 0.010 (2/3 seeds)``), one seed shows ``± —`` (not a
std of 0), and no seed at all shows ``— (0/3 seeds)``: nothing is silently averaged over fewer seeds.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.bootstrap import Interval
from analysis.load import ROW_ORDER

SEED_FRAME = ["row", "seed", "column", "value"]


@dataclass(frozen=True)
class Stat:
    """Mean and std over the seeds present (n) out of those asked."""

    mean: float | None
    std: float | None
    n: int
    asked: int

    def text(self, digits: int = 3, pm: str = "±") -> str:
        if self.n == 0:
            return f"— (0/{self.asked} seeds)"
        std = "—" if self.std is None else f"{self.std:.{digits}f}"
        out = f"{self.mean:.{digits}f} {pm} {std}"
        return out if self.n >= self.asked else f"{out} ({self.n}/{self.asked} seeds)"


def stat(values: Sequence[float], asked: int) -> Stat:
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return Stat(None, None, 0, asked)
    std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
    return Stat(float(np.mean(vals)), std, len(vals), asked)


@dataclass(frozen=True)
class Diff:
    """A difference of means (method minus reference) with its interval, always shown together:
    ``+0.031 [0.012, 0.050] *†``. ``*``: the interval excludes 0; ``†``: the difference also survives Holm's
    correction over its table's family (see ``analysis.bootstrap``). With one training seed on a trained side
    the cell has no interval and says so. ``n``: the method's seeds with data, ``ref_n``: the reference's,
    ``asked``: the seeds asked for."""

    interval: Interval
    n: int
    ref_n: int
    asked: int
    holm: bool = False

    def text(self, digits: int = 3) -> str:
        i = self.interval
        if not i.has_interval:
            return f"{i.diff:+.{digits}f} (1 seed: no interval)"
        out = f"{i.diff:+.{digits}f} [{i.lo:.{digits}f}, {i.hi:.{digits}f}]"
        if i.marked:
            out += " " + MARKER + (HOLM if self.holm else "")
        if min(self.n, self.ref_n) < self.asked:
            out += f" ({self.n}/{self.asked} seeds, reference {self.ref_n}/{self.asked})"
        return out


MARKER, HOLM = "*", "†"
Cell = Stat | Diff | str


@dataclass
class Table:
    name: str  # file stem of its .md/.tex/.csv
    title: str
    columns: list[str]
    rows: list[tuple[str, list[Cell]]]
    notes: list[str] = field(default_factory=list)

    def cell(self, row: str, column: str) -> Cell:
        for name, cells in self.rows:
            if name == row:
                return cells[self.columns.index(column)]
        raise KeyError(f"{self.name}: no row {row!r}")


def row_key(name: str) -> tuple:
    """Paper order (base, GRPO, ..., DAPO + Branch), then other rows alphabetically."""
    label = name.split(" [", 1)[0]
    return (ROW_ORDER.index(label) if label in ROW_ORDER else len(ROW_ORDER), name)


def seed_table(
    frame: pd.DataFrame,
    seeds: Sequence[int],
    columns: Sequence[str],
    *,
    name: str,
    title: str,
    rows: Sequence[str] | None = None,
) -> Table:
    """Mean ± std over ``seeds`` of each (row, column) of a (row, seed, column, value) frame; values of
    seeds not asked for are left out, asked seeds without a value are counted as missing."""
    frame = frame[frame["seed"].isin(seeds)]
    order = list(rows) if rows is not None else sorted(frame["row"].unique(), key=row_key)
    out = []
    for r in order:
        sub = frame[frame["row"] == r]
        out.append((r, [stat(list(sub.loc[sub["column"] == c, "value"]), len(seeds)) for c in columns]))
    return Table(name, title, list(columns), out)


# ------------------------------------------------------------------ rendering
def to_markdown(t: Table, digits: int = 3) -> str:
    lines = ["| " + " | ".join(["method", *t.columns]) + " |", "|" + "---|" * (len(t.columns) + 1)]
    for name, cells in t.rows:
        lines.append("| " + " | ".join([name, *(_text(c, digits) for c in cells)]) + " |")
    return "\n".join(lines)


def to_latex(t: Table, digits: int = 3) -> str:
    def esc(s: str) -> str:
        for char, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_")):
            s = s.replace(char, escaped)
        return s

    lines = [
        r"\begin{tabular}{l" + "c" * len(t.columns) + "}",
        r"\toprule",
        " & ".join(esc(c) for c in ["method", *t.columns]) + r" \\",
        r"\midrule",
    ]
    for name, cells in t.rows:
        texts = [_text(c, digits, pm=r"$\pm$") if not isinstance(c, str) else esc(c) for c in cells]
        lines.append(" & ".join([esc(name), *(x.replace("—", "--") for x in texts)]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)


DIFF_CSV = [
    "row", "column", "diff", "lo", "hi", "excludes_zero", "marked", "p", "holm", "se", "df", "mde_80",
    "seeds", "ref_seeds", "asked",
]  # fmt: skip


def to_csv(t: Table) -> str:
    """Tidy numbers, one line per cell: row, column, mean, std, seeds, asked, text; a table of differences
    (``Diff`` cells): the ``DIFF_CSV`` columns and text (empty numbers where a cell has no interval)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if any(isinstance(c, Diff) for _, cells in t.rows for c in cells):
        w.writerow([*DIFF_CSV, "text"])
        for name, cells in t.rows:
            for col, c in zip(t.columns, cells, strict=True):
                if isinstance(c, Diff):
                    i = c.interval
                    nums = [_num(v) for v in (i.diff, i.lo, i.hi)] + [i.excludes_zero, i.marked]
                    nums += [_num(i.p), c.holm, _num(i.se), _num(i.df), _num(i.mde)]
                    w.writerow([name, col, *nums, c.n, c.ref_n, c.asked, c.text()])
                else:
                    w.writerow([name, col, *[""] * (len(DIFF_CSV) - 2), c])
        return buf.getvalue()
    w.writerow(["row", "column", "mean", "std", "seeds", "asked", "text"])
    for name, cells in t.rows:
        for col, c in zip(t.columns, cells, strict=True):
            if isinstance(c, Stat):
                w.writerow([name, col, _num(c.mean), _num(c.std), c.n, c.asked, c.text()])
            else:
                w.writerow([name, col, "", "", "", "", c])
    return buf.getvalue()


def _text(c: Cell, digits: int, pm: str = "±") -> str:
    if isinstance(c, Stat):
        return c.text(digits, pm)
    return c.text(digits) if isinstance(c, Diff) else c


def _num(v: float | None) -> str:
    return "" if v is None or math.isnan(v) else repr(float(v))


# ------------------------------------------------------------------ the paper's tables
def column_k_per_dataset(evals: pd.DataFrame, k: int | None) -> dict[str, int]:
    """The k of the "pass@k" column per dataset: ``k`` if given, else the largest k logged for it."""
    return {ds: int(k if k is not None else g["k"].max()) for ds, g in evals.groupby("dataset")}


def ablation_frame(meas: pd.DataFrame, ks: dict[str, int]) -> tuple[pd.DataFrame, list[str]]:
    """(row, seed, column, value) of Table 1: per dataset pass@1 and pass@k, and, with several datasets,
    their average per seed (only over seeds that have every dataset, so the average is never over a
    subset of datasets)."""
    parts, columns = [], []
    datasets = list(ks)
    for ds in datasets:
        for k in (1, ks[ds]):
            col = f"{ds} pass@{k}"
            if col in columns:
                continue
            sub = meas[(meas["dataset"] == ds) & (meas["k"] == k)]
            parts.append(sub.assign(column=col)[SEED_FRAME])
            columns.append(col)
    if len(datasets) > 1:
        for which in ("1", "k"):
            k_of = {ds: 1 if which == "1" else ks[ds] for ds in datasets}
            both = pd.concat([meas[(meas["dataset"] == ds) & (meas["k"] == k_of[ds])] for ds in datasets])
            per_seed = both.groupby(["row", "seed"])["value"].agg(["mean", "count"]).reset_index()
            full = per_seed[per_seed["count"] == len(datasets)]
            col = f"avg pass@{which}"
            parts.append(full.rename(columns={"mean": "value"}).assign(column=col)[SEED_FRAME])
            columns.append(col)
    frame = pd.concat(parts) if parts else pd.DataFrame(columns=SEED_FRAME)
    return frame, columns


def ablation_table(meas: pd.DataFrame, seeds: Sequence[int], ks: dict[str, int]) -> Table:
    """Table 1 / 3 / 4 / 9: rows = methods, columns = datasets x {pass@1, pass@k} (+ average)."""
    frame, columns = ablation_frame(meas, ks)
    t = seed_table(
        frame,
        seeds,
        columns,
        name="ablation",
        title="pass@1 / pass@k on held-out data (mean ± std over training seeds)",
        rows=sorted(meas["row"].unique(), key=row_key),
    )
    return t


def grid_table(
    meas: pd.DataFrame, seeds: Sequence[int], dataset: str, k: int, name: str, title: str
) -> Table:
    """Table 6: rows = guide.threshold, columns = guide.ratio x {pass@1, pass@k}. ``meas`` holds one
    row per (threshold, ratio, seed, dataset, k) with columns threshold, ratio."""
    sub = meas[meas["dataset"] == dataset]
    ratios = sorted(sub["ratio"].unique(), key=float)
    parts, columns = [], []
    for ratio in ratios:
        for kk in (1, k):
            col = f"ratio={ratio} pass@{kk}"
            cell = sub[(sub["ratio"] == ratio) & (sub["k"] == kk)]
            parts.append(cell.assign(row="threshold=" + cell["threshold"], column=col)[SEED_FRAME])
            columns.append(col)
    frame = pd.concat(parts) if parts else pd.DataFrame(columns=SEED_FRAME)
    rows = [f"threshold={t}" for t in sorted(sub["threshold"].unique(), key=float)]
    return seed_table(frame, seeds, columns, name=name, title=title, rows=rows)


def thirds(values: Sequence[float]) -> tuple[float, float, float] | None:
    """Means of the early / middle / late thirds of a step-ordered series (numpy's array_split: the first
    thirds take the extra steps); None with fewer than 3 steps, where a third would be empty."""
    if len(values) < 3:
        return None
    return tuple(float(np.mean(p)) for p in np.array_split(np.asarray(values, dtype=float), 3))  # type: ignore[return-value]


THIRDS = ("early", "middle", "late")


def grad_norm_frame(runs: pd.DataFrame, hist: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """(row, seed, column, value) of Table 5 from the ``train/grad_norm`` history of each run."""
    out, notes = [], []
    for run_id, row, seed in zip(runs["run_id"], runs["row"], runs["seed"], strict=True):
        series = hist.loc[hist["run_id"] == run_id].sort_values("step")["value"]
        parts = thirds(list(series))
        if parts is None:
            notes.append(
                f"{row} seed {seed} (run {run_id}): {len(series)} train/grad_norm steps, fewer than 3"
            )
            continue
        out += [
            {"row": row, "seed": seed, "column": c, "value": v} for c, v in zip(THIRDS, parts, strict=True)
        ]
    return pd.DataFrame(out, columns=SEED_FRAME), notes
