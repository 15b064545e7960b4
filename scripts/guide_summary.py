"""The summary tables of a guide-diagnostics run, rebuilt from its ``diagnostics.json`` alone (what
``python -m sage.eval.guide_diagnostics`` wrote beside its ``summary.md``, which this prints again byte for
byte): ``python scripts/guide_summary.py docs/results/data/guide_diagnostics_<model>.json``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("diagnostics", type=Path, help="a diagnostics.json of sage.eval.guide_diagnostics")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.diagnostics.read_text())
    except (OSError, ValueError) as e:
        print(f"error: {args.diagnostics}: {e}", file=sys.stderr)
        return 2
    from sage.eval.guide_rendering import markdown

    sys.stdout.write(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
