"""scripts/sequence_tilt.py (Stage B of docs/results/sequence_anchor.md): the q(y)-tilted rare share and the
declared stop rule, on constructed data files whose answer is computed by hand, and the committed data file
rebuilding the committed results page byte for byte."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sequence_tilt", REPO / "scripts" / "sequence_tilt.py")
tilt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tilt)


def data(strategy: list[str], log_q: list[float], problems: int) -> dict:
    return {
        "git_commit": "abc",
        "guide": {"ratio": 0.3, "threshold": 0.3, "q_min": 0.6, "q_max": 1.4},
        "problems": problems,
        "k": len(strategy) // problems,
        "sampling_seed": 1000,
        "strategy": strategy,
        "log_q": log_q,
        "fork_q": [1.3] * len(strategy),
    }


def figure(text: str, label: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return float(line.split(":")[1].split()[0])


def test_the_tilted_share_reweights_each_problems_samples_by_q():
    # problem 1: one round sample of 4 with q(y) = 3 against 1 for the others: share 1/4 -> 3/6;
    # problem 2: no round sample: 0 -> 0. Averaged over problems: 0.125 -> 0.25.
    d = data(
        ["round", "direct", "direct", "split", "direct", "split", "cfirst", "direct"],
        [math.log(3), 0, 0, 0, 0.7, 0.1, 0.2, 0.3],
        problems=2,
    )
    text = tilt.report(d)
    assert figure(text, "rare share (round) of the base model's samples") == pytest.approx(0.125)
    assert figure(text, "rare share of the q(y)-tilted target") == pytest.approx(0.25)
    assert "tilted minus base: +0.12500" in text
    assert "goes on to Stage A" in text


def test_a_common_factor_tilts_nothing_and_stops_the_study():
    """Every completion at the same q(y) (the token-blind fork oracle's case): no tilt, below the rule."""
    d = data(["round", "direct", "direct", "direct"] * 2, [0.31] * 8, problems=2)
    text = tilt.report(d)
    assert "tilted minus base: +0.00000" in text
    assert "study stops here" in text


def test_the_committed_data_file_rebuilds_the_committed_results(tmp_path):
    committed = REPO / "docs" / "results" / "sequence_anchor_results.md"
    source = REPO / "docs" / "results" / "data" / "sequence_anchor_tilt.json.gz"
    with gzip.open(source, "rt") as f:
        assert json.load(f)["problems"] == 100
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sequence_tilt.py"), "--data", str(source)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert committed.read_text().split("\n", 2)[2].startswith(r.stdout)  # Stage A's sections follow
