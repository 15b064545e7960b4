"""The dose-response test's results (issue 48, docs/results/dose_response.md), from its committed data files.

    .venv/bin/python scripts/dose_response.py docs/results/data/dose_response_grpo_fork_q4.json \\
        docs/results/data/dose_response_grpo_kl_x4.json

Each file is what ``scripts/positive_control.py --save-data`` wrote for one arm against the reference (the
runs' per-problem rare-strategy and correct counts). Prints, as Markdown, the declared analysis and nothing
else: per arm, the primary (the rare strategy's share of the tail's samples) minus the reference's with the
interval paired by training seed (``analysis/bootstrap.difference(..., paired=True)``) and the unpaired
per-pair interval beside it, Holm's adjustment over the arms, and each arm's verdict by the rule the page
declared before the runs:

- *moves the share*: Holm-adjusted p below 0.05;
- *does not move it*: the paired 95% interval lies within (-smallest, +smallest);
- *inconclusive*: neither.

Then the study's decision: if any arm moves the share, the fork world can calibrate k3-Branch's null; if none
does, it cannot test k3-Branch. The output depends on the data files alone, so the page's results rebuild
byte-identically without the runs or their store.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from analysis import bootstrap  # noqa: E402

SMALLEST = 0.003  # the declared smallest effect of interest on the share
ALPHA = 0.05


def _positive_control():
    spec = importlib.util.spec_from_file_location(
        "positive_control", REPO / "scripts" / "positive_control.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["positive_control"] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the smallest family-wise level at which each is rejected."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def verdict(adjusted_p: float, lo: float, hi: float, smallest: float = SMALLEST) -> str:
    """The declared rule's verdict for one arm."""
    if adjusted_p < ALPHA:
        return "moves the share"
    if -smallest < lo and hi < smallest:
        return "does not move it"
    return "inconclusive"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+", type=Path, help="one --save-data file per arm against the reference")
    ap.add_argument("--smallest", type=float, default=SMALLEST, help="the smallest effect of interest")
    args = ap.parse_args(argv)
    pc = _positive_control()
    rows = []
    for path in args.data:
        try:
            settings, counts = pc.read_data_file(path)
        except pc.Refusal as e:
            print(f"dose_response.py: {e}", file=sys.stderr)
            return 2
        runs = [c.run() for c in counts]
        method, reference = settings["method"], settings["reference"]
        seeds_m, m = pc.arm(runs, method, "share")
        seeds_r, r = pc.arm(runs, reference, "share")
        if seeds_m != seeds_r:
            print(
                f"dose_response.py: {path}: {method}'s seeds {seeds_m} are not {reference}'s {seeds_r}; "
                "the declared analysis pairs them",
                file=sys.stderr,
            )
            return 2
        paired = bootstrap.difference(m, r, paired=True)
        unpaired = bootstrap.difference(m, r)
        rows.append((path, method, reference, seeds_m, m, r, paired, unpaired))
    adjusted = holm_adjusted([row[6].p for row in rows])

    print(
        "| arm | seeds | arm's share | reference's share | difference, paired by seed [95%] | p | "
        "Holm p | detectable at 80% | unpaired [95%] | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for (_, method, reference, seeds, m, r, iv, un), p_holm in zip(rows, adjusted, strict=True):
        v = verdict(p_holm, iv.lo, iv.hi, args.smallest)
        verdicts.append((method, v, iv.diff))
        print(
            f"| {method} minus {reference} | {seeds[0]}-{seeds[-1]} ({len(seeds)}) | {m.mean():.4f} | "
            f"{r.mean():.4f} | {iv.diff:+.4f} [{iv.lo:+.4f}, {iv.hi:+.4f}] | {iv.p:.3g} | {p_holm:.3g} | "
            f"{iv.mde:.4f} | [{un.lo:+.4f}, {un.hi:+.4f}] | {v} |"
        )
    print()
    print(
        f"Data: {', '.join(f'`data/{p.name}`' for p in args.data)}. Rule (declared before the runs): "
        f"Holm-adjusted p below {ALPHA} moves the share; a paired interval within "
        f"(-{args.smallest}, +{args.smallest}) does not move it; otherwise inconclusive."
    )
    print()
    moved = [(method, d) for method, v, d in verdicts if v == "moves the share"]
    if moved:
        which = ", ".join(f"{method} ({'up' if d > 0 else 'down'} by {abs(d):.4f})" for method, d in moved)
        print(
            f"**Decision: {which} moved the share.** By the declared rule this world's primary registered "
            "that arm; whether the arm is a pure change of anchor strength, and so whether it calibrates the "
            "fork study's k3-Branch null, the rule does not say (dose_response.md reads it)."
        )
    else:
        open_ = [method for method, v, _ in verdicts if v == "inconclusive"]
        print(
            "**Decision: no arm moved the share.** This world cannot test k3-Branch: a pull 4x the plain "
            "anchor's, at the fork or everywhere, did not move the primary, so Branch's null is no evidence "
            "about SAGE."
            + (
                f" ({', '.join(open_)}: inconclusive, its interval does not exclude an effect of "
                f"{args.smallest} either.)"
                if open_
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
