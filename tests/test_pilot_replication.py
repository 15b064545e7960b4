"""scripts/pilot_replication.py: the fork study's run means per seed group, against hand-computed values on
a constructed page, and on the committed page (docs/results/testbed_fork_primary.md)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from scipy import special

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pilot_replication", REPO / "scripts" / "pilot_replication.py")
pr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pr  # dataclasses look their module up there
_spec.loader.exec_module(pr)


def line(method: str, seed: int, share: float) -> str:
    """A per-run line as scripts/positive_control.py prints it."""
    return f"  {method:<16} {seed}  {share:.4f}  0.0100  0.500  (outputs/x/{method}-{seed})"


# seeds 1-4: reference 0, 1, 2, 3 and method 1, 3, 3, 5 (x 0.001); seeds 5-8: reference 2, 0, 4, 2 and
# method 1, 3, 3, 5 (x 0.001). The reference is printed twice, as on the real page (once per block).
REF = {1: 0, 2: 1, 3: 2, 4: 3, 5: 2, 6: 0, 7: 4, 8: 2}
METHOD = {1: 1, 2: 3, 3: 3, 4: 5, 5: 1, 6: 3, 7: 3, 8: 5}
PAGE = "\n".join(
    ["per run: method, seed, rare share, pass@1, pass@n (folder)"]
    + [line("ref", s, v / 1000) for s, v in REF.items()]
    + ["", "ref minus nothing:", "  share   0.0300 (sd 0.0017, seeds [1]) - ..."]
    + [line("ref", s, v / 1000) for s, v in REF.items()]
    + [line("meth", s, v / 1000) for s, v in METHOD.items()]
)


def t3_cdf(t: float) -> float:
    """Student's t with 3 df, in closed form: 1/2 + (x / (1 + x^2) + atan x) / pi, x = t / sqrt 3."""
    x = t / math.sqrt(3)
    return 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi


def t_two_sided_p(t: float, df: float) -> float:
    """The two-sided p of Student's t by the incomplete beta: I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    return float(special.betainc(df / 2, 0.5, df / (df + t * t)))


def test_reads_each_run_once():
    runs = pr.read_runs(PAGE)
    assert len(runs) == 16
    assert runs[("ref", 7)] == (0.004, 0.01, 0.5)
    assert runs[("meth", 4)] == (0.005, 0.01, 0.5)


def test_a_run_printed_twice_with_other_figures_is_refused():
    with pytest.raises(ValueError, match="ref seed 1 reads"):
        pr.read_runs(line("ref", 1, 0.001) + "\n" + line("ref", 1, 0.002))


def test_seeds_1_to_4_by_hand():
    """m = 1, 3, 3, 5; r = 0, 1, 2, 3 (x 0.001). Means 3 and 1.5; var 8/3 and 5/3; Welch se^2 = 13/12,
    t = 1.5 / sqrt(13/12), df = (13/12)^2 / ((2/3)^2 / 3 + (5/12)^2 / 3) = 507/89. Paired d = 1, 2, 1, 2:
    mean 1.5, sd sqrt(1/3), se sqrt(1/12), t = 3 sqrt 3, df 3, p = 2 (1 - F3(3 sqrt 3)) = 0.0138468; interval
    1.5 -+ 3.182446 x sqrt(1/12). Correlation 6 / sqrt(8 x 5)."""
    runs = pr.read_runs(PAGE)
    c = pr.compare(*[{s: runs[(n, s)][0] for s in (1, 2, 3, 4)} for n in ("meth", "ref")])
    k = 1e-3
    assert c.method_mean == pytest.approx(3 * k) and c.ref_mean == pytest.approx(1.5 * k)
    assert c.method_sd == pytest.approx(math.sqrt(8 / 3) * k)
    assert c.ref_sd == pytest.approx(math.sqrt(5 / 3) * k)
    assert c.diff == pytest.approx(1.5 * k)
    t = 1.5 / math.sqrt(13 / 12)
    assert c.welch_t == pytest.approx(t)
    assert c.welch_df == pytest.approx(507 / 89)
    assert c.welch_se == pytest.approx(math.sqrt(13 / 12) * k)
    assert c.paired_se == pytest.approx(math.sqrt(1 / 12) * k)
    assert c.welch_p == pytest.approx(t_two_sided_p(t, 507 / 89))
    assert c.paired_diff == pytest.approx(1.5 * k)
    assert c.paired_t == pytest.approx(3 * math.sqrt(3))
    assert c.paired_df == 3
    assert c.paired_p == pytest.approx(2 * (1 - t3_cdf(3 * math.sqrt(3))), rel=1e-6)
    assert c.paired_p == pytest.approx(0.0138468, abs=1e-7)
    half = 3.182446305 * math.sqrt(1 / 12)
    assert (c.paired_lo, c.paired_hi) == pytest.approx(((1.5 - half) * k, (1.5 + half) * k))
    assert c.correlation == pytest.approx(6 / math.sqrt(40))
    # 80% power: (t_.975 + t_.80) at 3 df = 3.182446 + 0.978472; normal 1.959964 + 0.841621
    assert c.mde_unpaired == pytest.approx((3.182446305 + 0.978472312) * math.sqrt(13 / 12) * k)
    assert c.mde_normal == pytest.approx((1.959963985 + 0.841621234) * math.sqrt(13 / 12) * k)
    assert c.mde_paired == pytest.approx((3.182446305 + 0.978472312) * math.sqrt(1 / 12) * k)


def test_seeds_5_to_8_by_hand():
    """m = 1, 3, 3, 5; r = 2, 0, 4, 2 (x 0.001). Both variances 8/3, so Welch's df is 2 (n - 1) = 6; diff 1,
    se sqrt(4/3), t = sqrt(3)/2. Paired d = -1, 3, -1, 3: mean 1, sd 4 / sqrt 3, se 2 / sqrt 3, t = sqrt(3)/2,
    p = 2 (1 - F3(sqrt(3)/2)) = 0.4501849. The rows are uncorrelated."""
    runs = pr.read_runs(PAGE)
    c = pr.compare(*[{s: runs[(n, s)][0] for s in (5, 6, 7, 8)} for n in ("meth", "ref")])
    k = 1e-3
    assert c.diff == pytest.approx(k)
    assert c.welch_t == pytest.approx(math.sqrt(3) / 2)
    assert c.welch_df == pytest.approx(6)
    assert c.welch_p == pytest.approx(t_two_sided_p(math.sqrt(3) / 2, 6))
    assert c.paired_t == pytest.approx(math.sqrt(3) / 2)
    assert c.paired_p == pytest.approx(0.4501849, abs=1e-7)
    assert c.paired_p == pytest.approx(2 * (1 - t3_cdf(math.sqrt(3) / 2)), rel=1e-6)
    assert c.correlation == pytest.approx(0, abs=1e-12)


def test_the_report_prints_each_group_and_all_seeds():
    out = pr.report(pr.read_runs(PAGE), "meth", "ref")
    assert "seeds 1-4: meth 0.00300" in out
    assert "seeds 5-8: meth 0.00300" in out
    assert "seeds 1-8: meth 0.00300 (sd" in out
    assert "paired by seed (4 seeds): +0.00150" in out
    with pytest.raises(ValueError, match="no runs of 'other'"):
        pr.report(pr.read_runs(PAGE), "other", "ref")


def test_a_missing_page_is_one_line(tmp_path, capsys):
    assert pr.main([str(tmp_path / "absent.md")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_committed_page():
    """The fork study's page: 24 runs (grpo, grpo_branch, grpo_fork_rare x seeds 1-8); the figures the
    results pages quote (positive_control.md, fork_reading.md)."""
    runs = pr.read_runs((REPO / "docs" / "results" / "testbed_fork_primary.md").read_text(encoding="utf-8"))
    assert sorted({m for m, _ in runs}) == ["grpo", "grpo_branch", "grpo_fork_rare"]
    assert len(runs) == 24
    row = {n: {s: runs[(n, s)][0] for s in range(1, 9)} for n in ("grpo", "grpo_branch", "grpo_fork_rare")}
    pilot = pr.compare(*[{s: row[n][s] for s in range(1, 5)} for n in ("grpo_fork_rare", "grpo")])
    replication = pr.compare(*[{s: row[n][s] for s in range(5, 9)} for n in ("grpo_fork_rare", "grpo")])
    assert pilot.diff == pytest.approx(0.0201, abs=5e-5)  # the pilot's own +0.0201
    assert pilot.ref_sd == pytest.approx(0.0014, abs=5e-5)
    assert pilot.method_sd == pytest.approx(0.0014, abs=5e-5)
    assert replication.diff == pytest.approx(0.0190, abs=5e-5)
    assert replication.welch_t == pytest.approx(9.30, abs=0.005)
    assert replication.welch_p == pytest.approx(9.6e-5, abs=1e-6)
    assert replication.ref_sd == pytest.approx(0.0027, abs=5e-5)
    branch = pr.compare(row["grpo_branch"], row["grpo"])
    assert branch.paired_diff == pytest.approx(-0.00105, abs=5e-6)
    assert (branch.paired_lo, branch.paired_hi) == pytest.approx((-0.00188, -0.00022), abs=5e-6)
    assert branch.paired_p == pytest.approx(0.0199, abs=5e-5)
    assert branch.correlation == pytest.approx(0.90, abs=0.005)
    assert branch.mde_unpaired == pytest.approx(0.00318, abs=5e-6)
    assert branch.welch_se == pytest.approx(0.00097, abs=5e-6)
