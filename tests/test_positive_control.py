"""scripts/positive_control.py, which computes the fork study's declared primary (the rare strategy's share of
the tail's samples) and the positive control's power: shares from constructed run folders by hand, the
per-pair interval it quotes, and the power estimates' size under no effect and reach under a large one."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from analysis import bootstrap
from sage.testbed.task import FORK_STRATEGIES, teacher_completion

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("positive_control", REPO / "scripts" / "positive_control.py")
pc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pc  # dataclasses look their module up there
_spec.loader.exec_module(pc)


def completion(strategy: str, rng: random.Random) -> str:
    """A fork-world trace that follows ``strategy`` (the teacher's, all its probability on that one)."""
    probs = tuple(float(s == strategy) for s in FORK_STRATEGIES)
    text, used = teacher_completion(23, 4, 5, rng, strategy_probs=probs, slip_rate=0.0, world="fork")
    assert used == strategy
    return text


def write_run(folder: Path, method: str, seed: int, rounds: list[int], samples: int = 4) -> None:
    """A finished run whose final tail cell has ``rounds[i]`` `round` samples of ``samples`` on problem i
    (the rest `direct`), the first sample of each problem correct."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "seed": seed}))
    cell = folder / "eval" / "trained" / "arith_tail" / "key_seed0"
    cell.mkdir(parents=True)
    texts = [[completion("round" if j < n else "direct", rng) for j in range(samples)] for n in rounds]
    (cell / "completions.json").write_text(json.dumps(texts))
    (cell / "meta.json").write_text(json.dumps({"ids": [f"p{i}" for i in range(len(rounds))]}))
    correct = np.zeros((len(rounds), samples), dtype=bool)
    correct[:, 0] = True
    np.save(cell / "correct.npy", correct)


def test_the_share_is_each_problems_round_samples_and_other_rows_are_not_read(tmp_path, capsys):
    sweep = tmp_path / "fork"
    write_run(sweep / "a", "grpo", 1, [1, 0, 2])  # shares 1/4, 0, 2/4
    write_run(sweep / "b", "grpo", 2, [0, 0, 2])
    write_run(sweep / "c", "grpo_fork_rare", 1, [4, 2, 2])
    write_run(sweep / "d", "grpo_fork_rare", 2, [3, 1, 4])
    write_run(sweep / "e", "grpo_nokl", 1, [4, 4, 4])  # another row of the study
    (sweep / "f").mkdir()  # a run cut short: no config, no cell
    run = pc.load_run(sweep / "a", "arith_tail")
    np.testing.assert_allclose(run.share, [0.25, 0.0, 0.5])
    assert (run.method, run.seed, run.ids) == ("grpo", 1, ["p0", "p1", "p2"])
    assert pc.load_run(sweep / "e", "arith_tail", ("grpo", "grpo_fork_rare")) is None
    assert pc.load_run(sweep / "f", "arith_tail") is None

    assert pc.main([str(sweep), "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 runs, 3 arith_tail problems x 4 samples" in out and "grpo_nokl" not in out
    # by hand: oracle per-problem means (3.5/4, 1.5/4, 3/4), GRPO (0.5/4, 0, 2/4); run means 2/3, 2/3 and
    # 1/4, 1/6; the interval is bootstrap.difference's on those arrays
    oracle = np.array([[1.0, 0.5, 0.5], [0.75, 0.25, 1.0]])
    grpo = np.array([[0.25, 0.0, 0.5], [0.0, 0.0, 0.5]])
    iv = bootstrap.difference(oracle, grpo)
    assert iv.diff == pytest.approx(2 / 3 - 5 / 24)
    assert f"= {iv.diff:+.4f} [{iv.lo:.4f}, {iv.hi:.4f}]" in out
    assert "power" not in out  # --seeds 0: the study's comparison estimates no power


def test_one_seed_on_a_side_gets_no_power_estimate(tmp_path, capsys):
    write_run(tmp_path / "a", "grpo", 1, [1, 0])
    write_run(tmp_path / "b", "grpo", 2, [0, 1])
    write_run(tmp_path / "c", "grpo_fork_rare", 1, [2, 2])
    assert pc.main([str(tmp_path)]) == 1
    assert (
        "no power estimate: grpo_fork_rare has 1 seed(s), grpo 2; each arm needs 2" in capsys.readouterr().out
    )


def pilot(rng: np.random.Generator, effect: float, seeds: int = 4, problems: int = 60, samples: int = 256):
    """Two arms' per-problem shares: problem profiles around 0.05, seed SD 0.002, binomial sampling."""
    profile = rng.uniform(0.02, 0.08, problems)
    arms = []
    for shift in (effect, 0.0):
        true = profile + shift + rng.normal(0, 0.002, (seeds, 1))
        arms.append(rng.binomial(samples, np.clip(true, 0, 1)) / samples)
    return arms


def test_power_is_the_level_without_an_effect_and_near_one_with_a_large_one():
    rng = np.random.default_rng(0)
    null_m, null_r = pilot(rng, 0.0)
    # a null pilot's own observed difference is noise; force it to exactly none so the power is the size
    null_m = null_m - null_m.mean() + null_r.mean()
    size = pc.simulate_power(null_m, null_r, seeds=8, samples=256, sims=400, rng=rng)
    assert size <= 0.10  # the interval's two-sided 5% and one side of it
    power_n, _, crit = pc.normal_power(null_m, null_r, seeds=8)
    # the interval's critical value, its seed part on seed_df(8) = 2.5 df (issue 58): below 5% under normal
    # seed effects, the price of holding its level under skewed ones
    assert crit > 2.36 and 0 < power_n <= 0.05
    big_m, big_r = pilot(rng, 0.02)
    assert pc.simulate_power(big_m, big_r, seeds=8, samples=256, sims=200, rng=rng) >= 0.95
    assert pc.normal_power(big_m, big_r, seeds=8)[0] >= 0.95


def test_the_detectable_effect_is_where_the_simulated_power_reaches_80_percent():
    """A study's smallest effect of interest (issue 58's Stage C): the bisection stops where the simulated
    power, on the same random numbers, crosses 0.8; and it agrees with the normal approximation's
    (critical value + z_0.8) x se, which the same variance parts give."""
    from scipy import stats

    m, r = pilot(np.random.default_rng(3), 0.004)
    sds = (pc.seed_sd(m), pc.seed_sd(r))
    for seeds in (8, 16):
        mde = pc.detectable_effect(m, r, seeds=seeds, samples=256, sims=300, rng_seed=1, seed_sds=sds)
        _, se, crit = pc.normal_power(m, r, seeds=seeds)
        assert mde == pytest.approx((crit + stats.norm.ppf(0.8)) * se, rel=0.15)

        def power(effect, seeds=seeds):
            rng = np.random.default_rng(1)
            return pc.simulate_power(
                m, r, seeds=seeds, samples=256, sims=300, rng=rng, seed_sds=sds, effect=effect
            )

        assert power(mde) >= 0.8 > power(mde - se / 500)
    # the pilot's sign sets the side: a method below its reference gets the same size
    at_16 = pc.detectable_effect(m, r, seeds=16, samples=256, sims=300, rng_seed=1, seed_sds=sds)
    flipped = pc.detectable_effect(r, m, seeds=16, samples=256, sims=300, rng_seed=1, seed_sds=sds[::-1])
    assert flipped == pytest.approx(at_16, rel=0.15)


def study(root: Path, seeds=(1, 2, 3, 4), methods=("grpo", "grpo_fork_rare"), problems: int = 3) -> Path:
    """A sweep folder of ``methods`` x ``seeds`` finished runs (and a run of another row), 4 samples per
    problem, their `round` counts drawn from a fixed RNG (more for the oracle)."""
    rng = np.random.default_rng(7)
    sweep = root / "sweep"
    for method in methods:
        for seed in seeds:
            high = 5 if method == "grpo_fork_rare" else 3
            write_run(sweep / f"{method}-{seed}", method, seed, rng.integers(0, high, problems).tolist())
    write_run(sweep / "nokl-1", "grpo_nokl", 1, [4] * problems)
    return sweep


def refused(capsys, argv: list[str]) -> str:
    """main's one-line refusal: exit code 2, one line on stderr, nothing on stdout."""
    assert pc.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    return captured.err


@pytest.fixture
def no_completions(monkeypatch):
    """Fails a test that reads a completion: refusals come before the expensive part."""

    def boom(found):
        raise AssertionError(f"{found.folder}: completions read before the refusal")

    monkeypatch.setattr(pc, "count_run", boom)


def test_seed_lists_and_groups_parse():
    assert pc.parse_seeds("5-8") == [5, 6, 7, 8]
    assert pc.parse_seeds("1,3-4, 2") == [1, 2, 3, 4]
    for bad in ("", "1-", "4-2", "a", "1;2"):
        with pytest.raises(Exception, match="seed"):
            pc.parse_seeds(bad)
    groups = pc.parse_split("pilot=1-4,5-8,9")
    assert [(g.label, g.seeds) for g in groups] == [
        ("seeds 1-4 (pilot)", [1, 2, 3, 4]),
        ("seeds 5-8", [5, 6, 7, 8]),
        ("seed 9", [9]),
    ]


def test_study_seeds_count_only_the_declared_runs(tmp_path, capsys):
    sweep = study(tmp_path, seeds=(1, 2, 3))
    assert pc.main([str(sweep), "--seeds", "0", "--study-seeds", "1-2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 runs, 3 arith_tail problems x 4 samples")
    assert "grpo-3" not in out and "grpo_fork_rare-3" not in out and out.count("seeds [1, 2])") == 6
    assert pc.main([str(sweep), "--seeds", "0"]) == 0  # without it, every finished run counts
    assert capsys.readouterr().out.startswith("6 runs,")


def test_a_declared_seed_an_arm_lacks_is_refused_before_completions_are_read(
    tmp_path, capsys, no_completions
):
    sweep = study(tmp_path, seeds=(1, 2, 3))
    (sweep / "grpo-2" / "config.yaml").unlink()  # a run that never finished: no config
    err = refused(capsys, [str(sweep), "--seeds", "0", "--study-seeds", "1-4"])
    assert err == (
        "positive_control.py: the study's seeds are 1, 2, 3, 4, but grpo_fork_rare has no run of seed(s) 4; "
        "grpo has no run of seed(s) 2, 4\n"
    )
    write_run(tmp_path / "rerun" / "grpo-1", "grpo", 1, [0, 0, 0])  # the same seed again, in another sweep
    err = refused(capsys, [str(sweep), str(tmp_path / "rerun"), "--seeds", "0", "--study-seeds", "1,3"])
    assert f"grpo has 2 runs of seed 1: {sweep / 'grpo-1'} and {tmp_path / 'rerun' / 'grpo-1'}" in err


def test_runs_on_other_problems_are_refused_in_one_line_naming_both(tmp_path, capsys, no_completions):
    sweep = study(tmp_path, seeds=(1, 2))
    meta = sweep / "grpo_fork_rare-2" / "eval" / "trained" / "arith_tail" / "key_seed0" / "meta.json"
    meta.write_text(json.dumps({"ids": ["p0", "q1", "p2"]}))  # the method rerun on other problems
    err = refused(capsys, [str(sweep), "--seeds", "0"])
    assert (
        f"{sweep / 'grpo-1'} and {sweep / 'grpo_fork_rare-2'} were not evaluated on the same arith_tail"
        in err
    )
    assert "(problem 1: p1 and q1)" in err
    assert "nokl" not in err  # another row's runs are not compared


@pytest.mark.parametrize(
    "options",
    [
        ["--seeds", "0"],
        ["--seeds", "4", "--sims", "20"],
        ["--seeds", "4", "--sims", "20", "--detectable"],
        ["--seeds", "0", "--study-seeds", "2-4", "--split", "pilot=2-3,4"],
        ["--seeds", "0", "--reference", "grpo_nokl", "--study-seeds", "1"],
    ],
)
def test_the_data_file_prints_what_the_folders_print(tmp_path, capsys, options):
    sweep = study(tmp_path)
    assert pc.main([str(sweep), *options]) in (0, 1)
    from_folders = capsys.readouterr().out
    saved = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in saved:
        assert pc.main([str(sweep), *options, "--save-data", str(path)]) in (0, 1)
        assert capsys.readouterr().out == from_folders  # saving changes nothing printed
    assert saved[0].read_bytes() == saved[1].read_bytes()  # deterministic: no time stamp, sorted keys
    data = ["--data", str(saved[0]), *[o for o in options if o not in ("--reference", "grpo_nokl")]]
    assert pc.main(data) in (0, 1)
    assert capsys.readouterr().out == from_folders
    doc = json.loads(saved[0].read_text())
    assert doc["ids"] == ["p0", "p1", "p2"] and doc["settings"]["argv"] == [str(sweep), *options]
    assert doc["settings"]["dataset"] == "arith_tail" and doc["settings"]["method"] == "grpo_fork_rare"
    first = doc["runs"][0]
    assert first["folder"] == str(sweep / first["method"]) + f"-{first['seed']}"
    assert first["samples"] == 4 and first["correct"] == [1, 1, 1]  # the first sample of each is correct
    assert first["cells"][0]["samples"] == 4 and len(first["cells"][0]["rare"]) == 3


def test_the_default_output_has_no_new_parts(tmp_path, capsys):
    assert pc.main([str(study(tmp_path)), "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert "per-pair interval (analysis/bootstrap.py difference):\n" in out
    assert f"\n{bootstrap.METHOD}\n" in out  # the interval's method, under the differences
    assert "detectable" not in out and "paired" not in out and out.count(" minus ") == 1


def test_sweeps_and_a_data_file_exclude_each_other(tmp_path, capsys):
    sweep = study(tmp_path, seeds=(1, 2))
    assert pc.main([str(sweep), "--seeds", "0", "--save-data", str(tmp_path / "d.json")]) == 0
    capsys.readouterr()
    assert "not both" in refused(capsys, [str(sweep), "--data", str(tmp_path / "d.json")])
    assert "give sweep folders or --data" in refused(capsys, ["--seeds", "0"])
    (tmp_path / "bad.json").write_text("{}")
    assert "not a data file" in refused(capsys, ["--data", str(tmp_path / "bad.json")])


def test_detectable_without_a_study_size_is_refused_before_completions_are_read(
    tmp_path, capsys, no_completions
):
    sweep = study(tmp_path, seeds=(1, 2))
    for seeds in ("0", "1"):
        err = refused(capsys, [str(sweep), "--seeds", seeds, "--detectable"])
        assert f"--detectable needs --seeds 2 or more (the study's seeds per arm), not {seeds}" in err


def test_batches_data_files_read_together_print_what_their_folders_print(tmp_path, capsys):
    """A study run in batches, each batch's sweep saved as its own data file: the files together are the
    study, as its folders together are; the merged file keeps the commit each batch was counted at."""
    sweeps = [study(tmp_path / "b1", seeds=(1, 2)), study(tmp_path / "b2", seeds=(3, 4))]
    options = ["--paired", "--seeds", "0", "--study-seeds", "1-4"]
    assert pc.main([*map(str, sweeps), *options]) == 0
    from_folders = capsys.readouterr().out
    files = [tmp_path / "b1.json", tmp_path / "b2.json"]
    for sweep, path in zip(sweeps, files, strict=True):
        assert pc.main([str(sweep), "--seeds", "0", "--save-data", str(path)]) == 0
    capsys.readouterr()
    merged = tmp_path / "all.json"
    data = ["--data", str(files[0]), "--data", str(files[1])]
    assert pc.main([*data, *options, "--save-data", str(merged)]) == 0
    assert capsys.readouterr().out == from_folders
    sources = json.loads(merged.read_text())["settings"]["sources"]
    assert [s["file"] for s in sources] == [str(f) for f in files]
    assert pc.main(["--data", str(merged), *options, "--save-data", str(tmp_path / "again.json")]) == 0
    assert capsys.readouterr().out == from_folders
    assert json.loads((tmp_path / "again.json").read_text())["settings"]["sources"] == sources  # kept
    twice = refused(capsys, ["--data", str(files[0]), "--data", str(files[0]), *options[:3]])
    assert "grpo_fork_rare has 2 runs of seed 1" in twice
    other = tmp_path / "nokl.json"
    assert pc.main([str(sweeps[0]), "--seeds", "0", "--method", "grpo_nokl", "--save-data", str(other)]) == 0
    capsys.readouterr()
    mixed = refused(capsys, ["--data", str(files[0]), "--data", str(other), "--seeds", "0"])
    assert f"{other} has method 'grpo_nokl', but {files[0]} has 'grpo_fork_rare'" in mixed


def test_split_prints_each_seed_groups_difference_apart(tmp_path, capsys):
    sweep = study(tmp_path)
    assert pc.main([str(sweep), "--seeds", "0", "--split", "pilot=1-2,3-4"]) == 0
    out = capsys.readouterr().out
    runs = [pc.load_run(f, "arith_tail", ("grpo", "grpo_fork_rare")) for f in sorted(sweep.iterdir())]
    runs = [r for r in runs if r]
    heads = [ln for ln in out.splitlines() if " minus " in ln]
    assert heads == [
        "grpo_fork_rare minus grpo, per-pair interval (analysis/bootstrap.py difference):",
        "grpo_fork_rare minus grpo, seeds 1-2 (pilot), per-pair interval (analysis/bootstrap.py difference):",
        "grpo_fork_rare minus grpo, seeds 3-4, per-pair interval (analysis/bootstrap.py difference):",
    ]
    blocks = out.split(" minus ")[1:]
    for block, seeds in zip(blocks, (None, [1, 2], [3, 4]), strict=True):
        _, m = pc.arm(runs, "grpo_fork_rare", "share", seeds)
        _, ref = pc.arm(runs, "grpo", "share", seeds)
        iv = bootstrap.difference(m, ref)
        line = f"= {iv.diff:+.4f} [{iv.lo:.4f}, {iv.hi:.4f}], p = {iv.p:.3g}"
        assert (
            f"{line}, detectable at 80% power {iv.mde:.4f}" in block
            and f"seeds {seeds or [1, 2, 3, 4]})" in block
        )
    err = refused(capsys, [str(sweep), "--seeds", "0", "--split", "1-2,4-5"])
    assert "--split's seeds 4-5: grpo_fork_rare has no run of seed(s) 5; grpo has no run of seed(s) 5" in err


def test_paired_uses_the_interval_paired_by_seed_and_needs_the_same_seeds(tmp_path, capsys):
    sweep = study(tmp_path)
    assert pc.main([str(sweep), "--seeds", "0", "--paired"]) == 0
    out = capsys.readouterr().out
    assert (
        "grpo_fork_rare minus grpo, paired-by-seed interval (analysis/bootstrap.py difference, paired=True):"
        in out
    )
    runs = [
        r for f in sorted(sweep.iterdir()) if (r := pc.load_run(f, "arith_tail", ("grpo", "grpo_fork_rare")))
    ]
    for figure in ("share", "pass@1", "pass@n"):
        _, m = pc.arm(runs, "grpo_fork_rare", figure)
        _, ref = pc.arm(runs, "grpo", figure)
        iv = bootstrap.difference(m, ref, paired=True)
        assert f"[{iv.lo:.4f}, {iv.hi:.4f}], p = {iv.p:.3g}, detectable at 80% power {iv.mde:.4f}" in out
    (sweep / "grpo-4" / "config.yaml").unlink()
    err = refused(capsys, [str(sweep), "--seeds", "0", "--paired"])
    assert (
        "--paired pairs runs by training seed, but grpo_fork_rare has seeds 1, 2, 3, 4 and grpo 1, 2, 3"
        in err
    )


def test_the_data_file_keeps_each_evaluation_cell(tmp_path, capsys):
    """Two evaluation seeds' cells, the second with fewer samples on some problems: the share averages the
    cells' own shares, and the data file keeps each cell's counts (a list where the samples differ)."""
    sweep = study(tmp_path, seeds=(1, 2))
    rng = random.Random(3)
    for run in ("grpo-1", "grpo_fork_rare-2"):
        cell = sweep / run / "eval" / "trained" / "arith_tail" / "key_seed1"
        cell.mkdir()
        texts = [[completion("round" if j < 1 else "direct", rng) for j in range(n)] for n in (4, 3, 2)]
        (cell / "completions.json").write_text(json.dumps(texts))
        (cell / "meta.json").write_text(json.dumps({"ids": ["p0", "p1", "p2"]}))
        np.save(cell / "correct.npy", np.ones((3, 4), dtype=bool))  # not read: the first cell's counts
    first = pc.load_run(sweep / "grpo-1", "arith_tail")
    only = json.loads(
        (sweep / "grpo-1" / "eval" / "trained" / "arith_tail" / "key_seed0" / "completions.json").read_text()
    )
    np.testing.assert_allclose(first.share, (pc.problem_shares(only) + [1 / 4, 1 / 3, 1 / 2]) / 2)
    assert first.correct.sum() == 3
    assert pc.main([str(sweep), "--seeds", "0", "--save-data", str(tmp_path / "d.json")]) == 0
    from_folders = capsys.readouterr().out
    assert pc.main(["--data", str(tmp_path / "d.json"), "--seeds", "0"]) == 0
    assert capsys.readouterr().out == from_folders
    (cells,) = [
        r["cells"]
        for r in json.loads((tmp_path / "d.json").read_text())["runs"]
        if r["seed"] == 1 and r["method"] == "grpo"
    ]
    assert [c["name"] for c in cells] == ["key_seed0", "key_seed1"]
    assert cells[1]["samples"] == [4, 3, 2] and cells[1]["rare"] == [1, 1, 1]


def test_the_data_file_of_a_whole_study_is_small():
    """3 arms x 8 seeds x 100 problems x 256 samples: integers per problem, no per-sample arrays."""
    rng = np.random.default_rng(0)
    ids = [f"{a}*{b}+{c}=" for a, b, c in rng.integers(10, 99, (100, 3))]
    counts = [
        pc.Counts(
            f"outputs/reproduce/fork/eval.n_samples=256,experiment={method},-{seed:08x}",
            method,
            seed,
            ids,
            ["6341aadbe794_seed0"],
            [[256] * 100],
            [rng.binomial(256, 0.05, 100).tolist()],
            256,
            rng.binomial(256, 0.01, 100).tolist(),
        )
        for method in ("grpo", "grpo_branch", "grpo_fork_rare")
        for seed in range(1, 9)
    ]
    text = pc.data_file(counts, {"argv": [], "dataset": "arith_tail", "method": "grpo", "reference": "grpo"})
    assert len(text.encode()) < 50_000 and text.count("\n") == 1
