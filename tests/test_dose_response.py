"""scripts/dose_response.py: the dose-response test's declared analysis from its data files (Holm over the
arms, the paired interval, the declared verdicts), on constructed counts whose answer is known."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import rebuild_results

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


dose = load("dose_response")
pc = load("positive_control")

PROBLEMS, SAMPLES, SEEDS = 200, 256, list(range(9, 17))


def write(path: Path, method: str, effect: float, seed_sd: float, rng: np.random.Generator) -> Path:
    """A data file of ``method`` against grpo: per seed a shared seed effect (rows share seeds), per
    problem a base rate, the arm's rare counts shifted by ``effect``."""
    base = rng.uniform(0.02, 0.05, PROBLEMS)
    counts = []
    for seed in SEEDS:
        shared = rng.normal(0, seed_sd)
        for arm, shift in (("grpo", 0.0), (method, effect)):
            p = np.clip(base + shared + shift + rng.normal(0, seed_sd / 4), 0, 1)
            rare = rng.binomial(SAMPLES, p).tolist()
            counts.append(
                pc.Counts(
                    f"runs/{arm}/{seed}",
                    arm,
                    seed,
                    [f"t{i}" for i in range(PROBLEMS)],
                    ["c"],
                    [[SAMPLES] * PROBLEMS],
                    [rare],
                    SAMPLES,
                    [1] * PROBLEMS,
                )
            )
    path.write_text(pc.data_file(counts, {"dataset": "arith_tail", "method": method, "reference": "grpo"}))
    return path


def test_holm_adjusted_p_values_by_hand():
    # sorted 0.01, 0.03, 0.04 over 3: 0.03, max(0.03, 2 * 0.03) = 0.06, max(0.06, 0.04) = 0.06
    assert dose.holm_adjusted([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert dose.holm_adjusted([0.6, 0.9]) == [1.0, 1.0]


def test_the_declared_verdicts():
    assert dose.verdict(0.049, -0.01, 0.02) == "moves the share"
    assert dose.verdict(0.2, -0.0029, 0.0029) == "does not move it"
    assert dose.verdict(0.2, -0.0029, 0.0031) == "inconclusive"
    assert dose.verdict(0.06, 0.0001, 0.004) == "inconclusive"  # excludes 0 unadjusted, not after Holm


def test_an_arm_that_moves_the_share_and_one_that_does_not(tmp_path):
    rng = np.random.default_rng(0)
    moved = write(tmp_path / "q4.json", "grpo_fork_q4", 0.01, 0.003, rng)
    still = write(tmp_path / "kl.json", "grpo_kl_x4", 0.0, 0.0005, rng)
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dose_response.py"), str(moved), str(still)],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line for line in r.stdout.splitlines() if line.startswith("| grpo_")]
    assert rows[0].startswith("| grpo_fork_q4 minus grpo | 9-16 (8) |") and rows[0].endswith(
        "| moves the share |"
    )
    assert rows[1].endswith("| does not move it |"), rows[1]
    assert re.search(r"\*\*Decision: grpo_fork_q4 \(up by 0\.0\d{3}\) moved the share\.\*\*", r.stdout), (
        r.stdout
    )
    # the printed paired interval is bootstrap's on the same arrays
    runs = [c.run() for c in pc.read_data_file(moved)[1]]
    iv = dose.bootstrap.difference(
        pc.arm(runs, "grpo_fork_q4", "share")[1], pc.arm(runs, "grpo", "share")[1], paired=True
    )
    assert f"{iv.diff:+.4f} [{iv.lo:+.4f}, {iv.hi:+.4f}]" in rows[0]
    # the same files give the same bytes
    again = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dose_response.py"), str(moved), str(still)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout == r.stdout


def test_no_arm_moving_it_withdraws_the_null(tmp_path, capsys):
    rng = np.random.default_rng(1)
    files = [write(tmp_path / f"{m}.json", m, 0.0, 0.0005, rng) for m in ("grpo_fork_q4", "grpo_kl_x4")]
    assert dose.main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert "**Decision: no arm moved the share.** This world cannot test k3-Branch" in out
    assert out.count("| does not move it |") == 2


def test_arms_on_other_seeds_are_refused_in_one_line(tmp_path, capsys):
    rng = np.random.default_rng(2)
    path = write(tmp_path / "q4.json", "grpo_fork_q4", 0.0, 0.001, rng)
    text = path.read_text().replace('"seed":16', '"seed":17', 1)  # one arm's run of seed 16 becomes 17
    path.write_text(text)
    assert dose.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the declared analysis pairs them" in err


def test_the_committed_results_rebuild_from_the_committed_data_alone(tmp_path):
    """`make reproduce-dose-response-report` on a copy of the committed data files (no runs, no store)
    writes the committed results page byte for byte: what a fresh clone rebuilds."""
    import shutil

    results = REPO / "docs" / "results"
    shutil.copytree(results / "data", tmp_path / "data")
    rebuild_results("reproduce-dose-response-report", tmp_path)
    rebuilt = (tmp_path / "dose_response_results.md").read_text()
    assert rebuilt == (results / "dose_response_results.md").read_text()
