"""docs/results/real_entropy.md's tables rebuild from the committed data files alone (issue 48: every figure
traceable): ``make reproduce-real-entropy-report`` prints each model's guide-diagnostics summary from its
``diagnostics.json`` byte for byte as the run wrote it, with no model, engine or store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")


@pytest.mark.parametrize("model", MODELS)
def test_the_committed_tables_rebuild_byte_for_byte_from_the_data_file(model):
    data = REPO / "docs" / "results" / "data" / f"guide_diagnostics_{model}.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "guide_summary.py"), str(data)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert r.stdout == (REPO / "docs" / "results" / f"real_entropy_{model}.md").read_text()
    # what the page's Branch-Archer comparison and intervals rest on is in the file
    assert "## Branch against Archer on the same tokens" in r.stdout and "lift > paper" in r.stdout
    assert (
        "| approach_word | " in r.stdout and " [" in r.stdout.split("| approach_word | ")[1].splitlines()[0]
    )
    # the committed runs predate issue 58: their intervals resampled solutions, 2 per problem, and say so
    assert "bootstrap over solutions" in r.stdout and "each problem has 2" in r.stdout
    assert "may be too narrow" in r.stdout


def test_a_run_that_resampled_problems_says_so(tmp_path):
    """A diagnostics.json of the current code (its intervals over problems, `interval_clusters`) is printed
    as such, without the warning the committed solution-level files carry."""
    data = json.loads(
        (REPO / "docs" / "results" / "data" / f"guide_diagnostics_{MODELS[0]}.json").read_text()
    )
    data["settings"]["interval_clusters"] = "problem"
    path = tmp_path / "diagnostics.json"
    path.write_text(json.dumps(data))
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "guide_summary.py"), str(path)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert "interval (bootstrap over problems, 2000 resamples" in r.stdout
    assert "bootstrap over solutions" not in r.stdout and "too narrow" not in r.stdout


def test_a_file_that_is_not_a_diagnostics_json_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "guide_summary.py"), str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"error: {bad}: ")
