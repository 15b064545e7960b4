"""Paired bootstrap intervals of sage-report (analysis.bootstrap): hand-computable cases, the per-problem
pass@k against sage.metrics, the marker, the few-seeds warning, and a whole report on an MLflow store
filled in the test through sage.tracking's own Tracker.log_eval (the path sage-train logs by)."""

import csv
import io

import numpy as np
import pandas as pd
import pytest

from analysis import bootstrap, figures, report, tables
from analysis.bootstrap import Interval, paired_difference
from analysis.tables import Diff
from sage.metrics import pass_at_k, pass_at_k_over_seeds


# ------------------------------------------------------------------ per-problem pass@k
def test_per_problem_pass_at_k_agrees_with_sage_metrics():
    rng = np.random.default_rng(3)
    mats = [rng.random((7, 10)) < rng.random((7, 1)) for _ in range(3)]  # 3 eval seeds, 7 problems
    ks = [1, 2, 5, 10]
    per_problem = bootstrap.per_problem_pass_at_k(mats, ks)
    assert per_problem.shape == (4, 7)
    summary = pass_at_k_over_seeds(mats, ks)  # what log_eval logs as pass_at_<k>/<label>/<ds>
    for i, k in enumerate(ks):
        assert per_problem[i].mean() == pytest.approx(summary[f"pass@{k}"], abs=1e-12)
        for p in range(7):
            expected = np.mean([pass_at_k(10, int(m[p].sum()), k) for m in mats])
            assert per_problem[i, p] == pytest.approx(expected, abs=1e-12)
    # by hand: n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6; no correct sample: 0; k=n with one correct: 1
    hand = np.array([[True, False, False, False], [False] * 4, [False, False, False, True]])
    assert bootstrap.per_problem_pass_at_k([hand], [2, 4]).tolist() == [[0.5, 0.0, 0.5], [1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="share one"):
        bootstrap.per_problem_pass_at_k([hand, hand[:2]], [1])


# ------------------------------------------------------------------ the bootstrap
def test_identical_methods_paired_give_exactly_zero():
    values = np.random.default_rng(0).random((5, 40))
    # the reference lists the same seeds in another order: rows are matched by seed number
    i = paired_difference(values, [1, 2, 3, 4, 5], values[::-1].copy(), [5, 4, 3, 2, 1])
    assert i.paired_by_seed and (i.diff, i.lo, i.hi) == (0.0, 0.0, 0.0)
    assert not i.excludes_zero and not i.marked


def test_same_distribution_contains_zero_and_is_roughly_symmetric():
    rng = np.random.default_rng(1)
    difficulty = rng.random(60)  # shared by both methods: pairing by problem removes it
    a = difficulty + rng.normal(0, 0.05, (5, 60))
    b = difficulty + rng.normal(0, 0.05, (5, 60))
    i = paired_difference(a, [1, 2, 3, 4, 5], b, [6, 7, 8, 9, 10])  # different seed sets: not paired
    assert not i.paired_by_seed
    assert i.lo < 0 < i.hi and not i.marked
    assert abs((i.hi - i.diff) - (i.diff - i.lo)) < 0.3 * (i.hi - i.lo)
    # paired by problem: the shared difficulty (std ~0.29 over problems) does not widen the interval
    assert i.hi - i.lo < 0.05


def test_constant_shift_is_found_and_excludes_zero():
    rng = np.random.default_rng(2)
    ref = rng.random((5, 50))
    paired = paired_difference(ref + 0.2, [1, 2, 3, 4, 5], ref, [1, 2, 3, 4, 5])
    assert paired.diff == pytest.approx(0.2)
    assert (paired.lo, paired.hi) == pytest.approx((0.2, 0.2), abs=1e-12)  # every draw sees the same shift
    assert paired.marked
    shifted = ref[[1, 0, 3, 2, 4]] + 0.2 + rng.normal(0, 0.02, (5, 50))  # other seeds: not paired by seed
    unpaired = paired_difference(shifted, [6, 7, 8, 9, 10], ref, [1, 2, 3, 4, 5])
    assert 0 < unpaired.lo < 0.2 < unpaired.hi and unpaired.marked


def test_a_difference_from_one_seed_has_a_wide_interval_that_reaches_zero():
    rng = np.random.default_rng(4)
    ref = rng.random((5, 50))
    one = ref.copy()
    one[2] += 0.5  # only seed 3 differs: mean difference 0.1
    i = paired_difference(one, [1, 2, 3, 4, 5], ref, [1, 2, 3, 4, 5])
    assert i.diff == pytest.approx(0.1)
    # a draw misses seed 3 with probability (4/5)^5 = 0.33 > 2.5%: the lower end is 0, the upper well above
    assert i.lo == pytest.approx(0.0, abs=1e-12) and i.hi > 0.2
    assert not i.excludes_zero and not i.marked
    spread = ref + 0.1  # the same mean difference on every seed
    j = paired_difference(spread, [1, 2, 3, 4, 5], ref, [1, 2, 3, 4, 5])
    assert j.marked and j.hi - j.lo < 1e-9


def test_two_problems_by_hand():
    """Per-problem differences 0 and 1, one seed: a draw's mean is 0 (p 1/4), 0.5 (1/2) or 1 (1/4), so the
    2.5 / 97.5 percentiles are 0 and 1."""
    i = paired_difference(np.array([[0.0, 1.0]]), [1], np.zeros((1, 2)), [1], draws=4000)
    assert (i.diff, i.lo, i.hi) == (0.5, 0.0, 1.0)


def test_one_seed_is_never_marked_except_against_the_start_model():
    ones, zeros = np.ones((1, 20)), np.zeros((1, 20))
    i = paired_difference(ones, [1], zeros, [1])
    assert i.excludes_zero and not i.seeds_resampled and not i.marked
    assert not paired_difference(ones, [1], zeros, [1], ref_is_base=True).marked  # the method has one seed
    two = np.ones((2, 20))
    assert paired_difference(two, [1, 2], zeros, [1], ref_is_base=True).marked  # base: no training seed
    assert not paired_difference(two, [1, 2], zeros, [1]).marked  # a trained reference with one seed


def test_reproducible_and_checked():
    rng = np.random.default_rng(5)
    a, b = rng.random((3, 30)), rng.random((4, 30))
    first = paired_difference(a, [1, 2, 3], b, [1, 2, 3, 4], rng_seed=7)
    assert first == paired_difference(a, [1, 2, 3], b, [1, 2, 3, 4], rng_seed=7)
    assert first != paired_difference(a, [1, 2, 3], b, [1, 2, 3, 4], rng_seed=8)
    with pytest.raises(ValueError, match="not paired by problem"):
        paired_difference(a, [1, 2, 3], b[:, :20], [1, 2, 3, 4])


def test_curve_band_and_its_ks():
    rng = np.random.default_rng(6)
    values = rng.random((3, 40, 2))
    mean, lo, hi = bootstrap.mean_band(values)
    assert mean == pytest.approx(values.mean(axis=(0, 1)))
    assert np.all(lo < mean) and np.all(mean < hi)
    const = np.full((3, 40, 1), 0.25)
    _, lo, hi = bootstrap.mean_band(const)
    assert (lo[0], hi[0]) == pytest.approx((0.25, 0.25))
    ks = bootstrap.band_ks(256)
    assert ks[0] == 1 and ks[-1] == 256 and ks == sorted(set(ks)) and 20 <= len(ks) <= 26
    assert bootstrap.band_ks(1) == [1]


def test_figure_band_is_the_given_interval():
    import matplotlib.pyplot as plt

    frame = pd.DataFrame({"seed": [1, 2, 1, 2], "k": [1, 1, 4, 4], "value": [0.2, 0.4, 0.5, 0.7]})
    band = pd.DataFrame({"k": [1, 4], "lo": [0.1, 0.45], "hi": [0.5, 0.8]})
    fig, ax = plt.subplots()
    figures._line(ax, frame, "k", "A", band=band)
    (poly,) = ax.collections
    ys = poly.get_paths()[0].vertices[:, 1]
    assert (ys.min(), ys.max()) == pytest.approx((0.1, 0.8))  # the bootstrap band, not mean ± std
    plt.close(fig)


# ------------------------------------------------------------------ marker and rendering
def test_marker_and_cells():
    marked = Diff(Interval(0.031, 0.012, 0.050, True, True), 5, 5, 5)
    assert marked.text() == "+0.031 [0.012, 0.050] *"
    assert Diff(Interval(-0.01, -0.03, 0.01, True, True), 5, 5, 5).text() == "-0.010 [-0.030, 0.010]"
    assert Diff(Interval(0.3, 0.2, 0.4, False, False), 1, 5, 5).text() == (
        "+0.300 [0.200, 0.400] (1 seed: problem noise only)"
    )
    assert Diff(Interval(-0.2, -0.3, -0.1, False, True), 4, 5, 5).text() == (
        "-0.200 [-0.300, -0.100] * (4/5 seeds, reference 5/5)"
    )
    t = tables.Table("d", "d", ["x pass@1"], [("A", [marked]), ("B", ["— (no correctness matrices)"])])
    assert "| A | +0.031 [0.012, 0.050] * |" in tables.to_markdown(t)
    assert r"A & +0.031 [0.012, 0.050] * \\" in tables.to_latex(t)
    rows = list(csv.DictReader(io.StringIO(tables.to_csv(t))))
    assert rows[0] == {
        "row": "A", "column": "x pass@1", "diff": "0.031", "lo": "0.012", "hi": "0.05",
        "excludes_zero": "True", "marked": "True", "seeds": "5", "ref_seeds": "5", "asked": "5",
        "paired_by_seed": "True", "text": "+0.031 [0.012, 0.050] *",
    }  # fmt: skip
    assert rows[1]["text"] == "— (no correctness matrices)" and rows[1]["diff"] == ""


def test_few_seeds_warning_names_trained_rows_only():
    meas = pd.DataFrame(
        [("base", s, "base") for s in (1,)]
        + [("GRPO", s, "trained") for s in (1, 2, 3, 4, 5)]
        + [("GRPO + Branch", s, "trained") for s in (1, 2, 3)],
        columns=["row", "seed", "label"],
    )
    w = report.few_seeds_warning(meas, [1, 2, 3, 4, 5], 5)
    assert w is not None and "\n" not in w
    assert w.startswith("fewer than 5 training seeds for Table 1 methods: GRPO + Branch (3);")
    assert "GRPO (" not in w and "base" not in w
    assert report.few_seeds_warning(meas, [1, 2, 3, 4, 5], 3) is None
    assert "GRPO (2), GRPO + Branch (2)" in report.few_seeds_warning(meas, [1, 2], 5)  # asked seeds only


# ------------------------------------------------------------------ a whole report
DS = "arith_heldout"
PROBLEMS, SAMPLES, KS = 60, 16, [1, 16]


def success(method: str, seed: int) -> np.ndarray:
    """Per-problem success probability: half easy problems, half hard ones that only rare paths solve.
    GRPO sharpens (easy up, hard down a little); GRPO w/o KL loses the hard ones; forward KL (one seed)
    loses them too."""
    rng = np.random.default_rng(seed)
    easy, hard = np.full(PROBLEMS // 2, 0.5), np.full(PROBLEMS // 2, 0.06)
    if method == "base":
        return np.concatenate([easy, hard])
    jitter = rng.normal(0, 0.02)
    if method in ("grpo", "grpo_branch"):
        return np.concatenate([easy + 0.3 + jitter, hard - 0.02])
    return np.concatenate([easy + 0.4 + jitter, hard * 0])  # grpo_nokl, grpo_fkl


def matrices(method: str, seed: int) -> list[np.ndarray]:
    """Two evaluation seeds of (problems x samples) correctness. GRPO + Branch samples exactly what GRPO
    does (the same generator), so its difference is exactly 0."""
    name = "grpo" if method == "grpo_branch" else method
    p = success(name, seed)
    rng = np.random.default_rng([seed, len(name), sum(map(ord, name))])
    return [rng.random((PROBLEMS, SAMPLES)) < p[:, None] for _ in range(2)]


SYNTH = {"grpo": (1, 2, 3), "grpo_nokl": (1, 2, 3), "grpo_branch": (1, 2, 3), "grpo_fkl": (1,)}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A store of finished sage-train-like runs whose evaluations are logged by sage.tracking.Tracker."""
    from sage.tracking import Tracker, open_store

    root = tmp_path_factory.mktemp("boot_store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client, exp = open_store(uri, "boot")
    ids = {}
    for method, seeds in SYNTH.items():
        for seed in seeds:
            tags = {"sage.kind": "train", "seed": str(seed), "method": method, "base_model": "tb"}
            run = client.create_run(exp, tags=tags)
            client.log_param(run.info.run_id, "seed", str(seed))
            tracker = Tracker(client, run.info.run_id, resumed=False)
            for label, name in (("base", "base"), ("trained", method)):
                mats = matrices(name, 0 if label == "base" else seed)
                completions = [[["x"] * SAMPLES for _ in range(PROBLEMS)] for _ in mats]
                result = {
                    "summary": pass_at_k_over_seeds(mats, KS),
                    "correct": mats,
                    "completions": completions,
                }
                tracker.log_eval(label, DS, result, KS, None)
            client.set_terminated(run.info.run_id)
            ids[(method, seed)] = run.info.run_id
    # a run whose evaluation logged metrics but no correctness matrices (an older sage-train)
    tags = {"sage.kind": "train", "seed": "1", "method": "dapo", "base_model": "tb"}
    first = min(client.get_run(r).info.start_time for r in ids.values())
    run = client.create_run(exp, start_time=first - 1000, tags=tags)  # older: not the base row's source
    for k in KS:
        client.log_metric(run.info.run_id, f"pass_at_{k}/trained/{DS}", 0.5)
    for k in range(1, SAMPLES + 1):
        client.log_metric(run.info.run_id, f"pass_at_k_curve/trained/{DS}", 0.5, step=k)
    client.set_terminated(run.info.run_id)
    return {"uri": uri, "client": client, "root": root, "ids": ids}


def make(synth, name, **kw):
    out = synth["root"] / name / "r.md"
    return report.make_report(
        synth["client"],
        synth["uri"],
        experiment="boot",
        out=out,
        figures_dir=out.parent / "figures",
        tables_dir=out.parent / "tables",
        **kw,
    )


def metric(synth, method, seed, key):
    return synth["client"].get_run(synth["ids"][(method, seed)]).data.metrics[key]


def test_report_intervals_from_the_logged_matrices(synth):
    rep = make(synth, "default")
    vs_grpo, vs_base = rep.tables["diff_vs_reference"], rep.tables["diff_vs_base"]
    assert vs_grpo.title == "each method minus GRPO: pass@1 and pass@k"
    assert vs_grpo.columns == [f"{DS} pass@1", f"{DS} pass@16"]
    assert [r for r, _ in vs_grpo.rows] == [
        "GRPO w/o KL",
        "GRPO + forward KL",
        "GRPO + Branch",
        "DAPO w/o KL",
    ]
    # the point estimate is the difference of the logged pass@k means, for every k
    for k in KS:
        key = f"pass_at_{k}/trained/{DS}"
        mean = {m: np.mean([metric(synth, m, s, key) for s in SYNTH[m]]) for m in ("grpo", "grpo_nokl")}
        cell = vs_grpo.cell("GRPO w/o KL", f"{DS} pass@{k}")
        assert cell.interval.diff == pytest.approx(mean["grpo_nokl"] - mean["grpo"], abs=1e-12)
        assert cell.interval.lo <= cell.interval.diff <= cell.interval.hi
        assert cell.interval.paired_by_seed and (cell.n, cell.ref_n, cell.asked) == (3, 3, 3)
    # losing the hard problems: pass@16 falls against GRPO and against the start model, beyond the noise
    nokl = vs_base.cell("GRPO w/o KL", f"{DS} pass@16")
    base16 = metric(synth, "grpo", 1, f"pass_at_16/base/{DS}")
    assert nokl.interval.diff == pytest.approx(
        np.mean([metric(synth, "grpo_nokl", s, f"pass_at_16/trained/{DS}") for s in (1, 2, 3)]) - base16
    )
    assert nokl.interval.hi < 0 and nokl.interval.marked and nokl.text().endswith(" *")
    assert nokl.interval.paired_by_seed  # the base row comes from the runs of seeds 1, 2, 3
    assert vs_grpo.cell("GRPO w/o KL", f"{DS} pass@16").interval.marked
    assert vs_base.cell("GRPO", f"{DS} pass@1").interval.lo > 0  # sharpening raises pass@1
    # GRPO + Branch sampled exactly what GRPO did: exactly 0, no marker
    same = vs_grpo.cell("GRPO + Branch", f"{DS} pass@16")
    assert same.text() == "+0.000 [0.000, 0.000]"
    # one seed: its interval excludes 0 but covers problem noise only, so it is not marked
    fkl = vs_grpo.cell("GRPO + forward KL", f"{DS} pass@16")
    assert fkl.interval.hi < 0 and not fkl.interval.marked and "(1 seed: problem noise only)" in fkl.text()
    assert not fkl.interval.paired_by_seed
    assert vs_grpo.cell("DAPO w/o KL", f"{DS} pass@1") == "— (DAPO w/o KL: no correctness matrices)"
    assert any("DAPO w/o KL seed 1" in n and "no correctness matrices" in n for n in rep.notes)

    md = rep.markdown
    assert "## Differences against GRPO" in md and "## Differences against the start model" in md
    assert md.count(report.NOISE_SENTENCE) == 3  # the head and both sections
    assert f"| GRPO w/o KL | {vs_grpo.cell('GRPO w/o KL', f'{DS} pass@1').text()} |" in md
    assert "(2000 draws of problems and of seeds, RNG seed 0;" in md
    tables_dir = synth["root"] / "default" / "tables"
    rows = list(csv.DictReader(io.StringIO((tables_dir / "diff_vs_base.csv").read_text())))
    row = next(r for r in rows if r["row"] == "GRPO w/o KL" and r["column"] == f"{DS} pass@16")
    assert float(row["diff"]) == nokl.interval.diff and row["marked"] == "True"
    assert nokl.text() in (tables_dir / "diff_vs_base.tex").read_text()

    # fewer than 5 seeds: one warning line, in the report and in Report.warnings
    assert rep.warnings == [
        "fewer than 5 training seeds for Table 1 methods: GRPO (3), GRPO w/o KL (3), GRPO + forward KL (1), "
        "GRPO + Branch (3), DAPO w/o KL (1); their intervals rest on few seeds (--min-seeds 5)"
    ]
    assert f"**Warning:** {rep.warnings[0]}\n" in md

    # Figure 3: the curve with the bootstrap band
    assert rep.figures[f"passk_{DS}"].stat().st_size > 1000
    band = "bands: 95% bootstrap interval over problems and training seeds"
    band += " (mean ± std over seeds for DAPO w/o KL)"  # its run logged a curve but no matrices
    assert band in md


def test_report_options_reference_seed_and_no_bootstrap(synth, capsys):
    first = make(synth, "a", rng_seed=3, extra_ks=[4])
    assert first.tables["diff_vs_reference"].columns == [f"{DS} pass@1", f"{DS} pass@4", f"{DS} pass@16"]
    again = make(synth, "b", rng_seed=3, extra_ks=[4])
    other = make(synth, "c", rng_seed=4, extra_ks=[4])
    read = lambda r: (synth["root"] / r / "tables" / "diff_vs_reference.csv").read_text()  # noqa: E731
    assert read("a") == read("b") != read("c")
    assert first.tables["diff_vs_base"].cell("GRPO", f"{DS} pass@1").interval == (
        again.tables["diff_vs_base"].cell("GRPO", f"{DS} pass@1").interval
    )
    assert other.tables["diff_vs_base"].cell("GRPO", f"{DS} pass@1").interval.diff == (
        first.tables["diff_vs_base"].cell("GRPO", f"{DS} pass@1").interval.diff
    )  # the RNG moves the interval, never the difference

    out = synth["root"] / "cli" / "r.md"
    argv = [
        "--tracking-uri",
        synth["uri"],
        "--experiment",
        "boot",
        "--out",
        str(out),
        "--perplexity-max",
        "0",
    ]
    assert report.main([*argv, "--reference", "grpo_nokl", "--min-seeds", "1", "--bootstrap", "500"]) == 0
    err = capsys.readouterr().err
    assert "warning:" not in err
    md = out.read_text()
    assert "## Differences against GRPO w/o KL" in md and "(500 draws of problems and of seeds" in md
    assert "**Warning:**" not in md
    assert report.main([*argv, "--reference", "nope", "--seeds", "1,2"]) == 0
    err = capsys.readouterr().err
    assert "note: no differences against 'nope': no trained row of that name (--reference)" in err
    assert "warning: fewer than 5 training seeds for Table 1 methods: GRPO (2)," in err
    assert report.main([*argv, "--bootstrap", "0"]) == 0
    md = out.read_text()
    assert "Differences" not in md and report.NOISE_SENTENCE not in md
    assert "bands: mean ± std over training seeds" in md
