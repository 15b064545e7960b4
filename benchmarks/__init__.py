"""Development benchmarks (`make bench`: ``python -m benchmarks.bench``): not part of the installed package;
run from a clone."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The clone's root: the sections' own launches of ``python -m benchmarks.bench`` run from it."""
