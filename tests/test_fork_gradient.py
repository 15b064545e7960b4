"""scripts/fork_gradient.py (issue 58, the q = 4 sign): the first-order change of the rare strategy's
probability at the fork from each loss term, against finite differences, exact enumeration over the fork's
strategies and cases computed by hand; and a data file through the command line."""

from __future__ import annotations

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import rebuild_results

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fork_gradient", REPO / "scripts" / "fork_gradient.py")
fg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fg)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def test_the_rare_step_is_the_derivative_of_the_rare_probability_along_e_y_minus_pi():
    rng = np.random.default_rng(3)
    z = rng.normal(size=5)
    pi = softmax(z)
    eps = 1e-6
    for y in range(5):
        direction = np.eye(5)[y] - pi
        numeric = (softmax(z + eps * direction)[2] - softmax(z - eps * direction)[2]) / (2 * eps)
        assert fg.rare_step(pi[None], np.array([y]), rare=2)[0] == pytest.approx(numeric, rel=1e-6)


def test_the_expected_terms_are_the_exact_expectation_over_the_forks_strategies():
    """Enumerate y: sum_y pi_y w_y (A_y + beta (q ref_y / pi_y - 1)) d(y), the descent step of the policy-
    gradient term and of k3 against q * ref, equals the three parts' sum."""
    rng = np.random.default_rng(4)
    K, beta, q, rare = 6, 0.2, 4.0, 5
    pi, ref = softmax(rng.normal(size=K)), softmax(rng.normal(size=K))
    ell = rng.uniform(0.02, 0.05, size=K)  # E[n w | y]: 1 / |o| by strategy
    adv = rng.normal(size=K)  # E[A | y]
    d = np.array([fg.rare_step(pi[None], np.array([y]), rare)[0] for y in range(K)])
    exact = sum(pi[y] * ell[y] * (adv[y] + beta * (q * ref[y] / pi[y] - 1)) * d[y] for y in range(K))
    t = fg.expected_terms(pi[None], ref[None], ell[None], (ell * adv)[None], rare, q, beta)
    assert (t["policy gradient"] + t["anchor, restoring"] + t["anchor, constant"])[0] == pytest.approx(exact)


def test_at_the_reference_q_pushes_away_from_long_strategies_and_only_under_length_weights():
    """pi = pi_ref = (1/2, 1/2), the rare strategy's completions 4 tokens, the other's 2: by hand,
    d(0) = -1/4, d(1) = +1/4, and the constant part beta (q - 1) (1/2 * 1/2 * -1/4 + 1/2 * 1/4 * 1/4)
    = 0.6 * -1/32 at q = 4, beta 0.2; 0 at q = 1, and 0 when both lengths are equal; the restoring part 0."""
    pi = np.array([[0.5, 0.5]])
    grpo = np.array([[1 / 2, 1 / 4]])
    for q, constant in ((4.0, -0.6 / 32), (1.4, -0.08 / 32), (1.0, 0.0)):
        t = fg.expected_terms(pi, pi, grpo, np.zeros((1, 2)), rare=1, q=q, beta=0.2)
        assert t["anchor, constant"][0] == pytest.approx(constant, abs=1e-15)
        assert t["anchor, restoring"][0] == 0.0
    equal = np.array([[1 / 3, 1 / 3]])  # bnpo's one normaliser: E[n w | y] the same for every y
    assert fg.expected_terms(pi, pi, equal, np.zeros((1, 2)), 1, 4.0, 0.2)["anchor, constant"][0] == 0.0


def test_the_restoring_part_pulls_a_depleted_rare_strategy_back_q_times_as_hard():
    ref, pi = np.array([[0.5, 0.5]]), np.array([[0.8, 0.2]])
    ell = np.array([[0.25, 0.25]])
    at = {
        q: fg.expected_terms(pi, ref, ell, np.zeros((1, 2)), 1, q, 0.2)["anchor, restoring"][0]
        for q in (1, 4)
    }
    assert at[1] > 0 and at[4] == pytest.approx(4 * at[1])


def test_weights_follow_each_loss_types_normaliser():
    lengths = np.array([2.0, 4.0, 3.0, 5.0, 10.0])
    prompt = np.array([0, 0, 1, 1, 1])
    assert fg.weights(lengths, prompt, "grpo") == pytest.approx([1 / 4, 1 / 8, 1 / 9, 1 / 15, 1 / 30])
    assert fg.weights(lengths, prompt, "bnpo") == pytest.approx([1 / 6, 1 / 6, 1 / 18, 1 / 18, 1 / 18])
    with pytest.raises(ValueError, match="loss_type must be one of"):
        fg.weights(lengths, prompt, "dapo")


def test_group_advantages_are_grpos_group_scaled_ones():
    a = fg.group_advantages(np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), group=4)
    assert a[:4] == pytest.approx([0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / 0.5001, -0.25 / 0.5001])
    assert list(a[4:]) == [0.0] * 4  # a group whose rewards agree teaches nothing


def constructed(lengths: dict[int, int]) -> dict:
    """Two tiers' prompts at pi = pi_ref, every strategy chosen in proportion; strategy k's completions
    ``lengths[k]`` tokens long; no reward."""
    pi = [0.5, 0.3, 0.2]
    samples = [0] * 5 + [1] * 3 + [2] * 2  # ten per prompt, in proportion to pi
    prompts = 4
    return {
        "policy": "constructed",
        "git_commit": "abc",
        "strategies": ["common", "middle", "round"],
        "rare": "round",
        "beta": 0.2,
        "group": 10,
        "groups": 1,
        "prompts": prompts,
        "temperature": 1.0,
        "sampling_seed": 0,
        "tier": ["easy", "easy", "tail", "tail"],
        "prompt": [p for p in range(prompts) for _ in samples],
        "fork": samples * prompts,
        "pi": [pi] * (10 * prompts),
        "ref": [pi] * (10 * prompts),
        "length": [lengths[y] for y in samples] * prompts,
        "reward": [0.0] * (10 * prompts),
        "advantage": [0.0] * (10 * prompts),
    }


def row(text: str, loss_type: str, beta: str, q: str) -> list[str]:
    prefix = f"| {loss_type} | {beta} | {q} |"
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return [cell.strip() for cell in line[len(prefix) :].strip(" |").split("|")]


def test_the_report_shows_the_constant_part_against_a_long_rare_strategy_under_grpo_only(tmp_path, capsys):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(constructed({0: 20, 1: 30, 2: 40})))
    assert fg.main(["--data", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| round | 0.2000 | 40.00 | 0.02500 | 0.2000 | 0.2000 |" in out
    # by hand, per prompt: d(y) = pi_r (delta_yr - pi_r - pi_y + 0.38); sum_y pi_y / L_y d(y) x 0.6 x 1e3
    d = {y: 0.2 * ((y == 2) - 0.2 - p + 0.38) for y, p in enumerate((0.5, 0.3, 0.2))}
    expected = (
        0.6 * 1e3 * sum(p / length * d[y] for y, (p, length) in enumerate(((0.5, 20), (0.3, 30), (0.2, 40))))
    )
    assert expected < 0
    cells = row(out, "grpo", "0.2", "4")
    assert cells[2].startswith(f"{expected:+.4f} [{expected:+.4f}, {expected:+.4f}]")  # every prompt alike
    assert cells[1].startswith("+0.0000") and cells[0].startswith("+0.0000")
    assert row(out, "grpo", "0.2", "1")[2].startswith("+0.0000")  # q = 1: no constant part
    assert row(out, "grpo", "0.8", "1")[2].startswith("+0.0000")  # 4x beta: none either
    for q in ("1", "1.4", "4"):
        assert row(out, "bnpo", "0.2", q)[2].lstrip("+-").startswith("0.0000")  # one normaliser: none


def test_data_and_a_measurement_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fg.main(["--data", str(tmp_path / "d.json"), "--checkpoint", str(tmp_path)])
    assert "--data reads a data file" in capsys.readouterr().err
    assert fg.main(["--data", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert fg.main(["--checkpoint", str(tmp_path)]) == 2
    assert "no config.json: not a model folder" in capsys.readouterr().err


def test_the_committed_results_rebuild_from_the_committed_data_alone(tmp_path):
    """`make reproduce-fork-gradient-report` on a copy of the committed data files (no model, no run) writes
    the committed results page byte for byte: what a fresh clone rebuilds."""
    results = REPO / "docs" / "results"
    (tmp_path / "data").mkdir()
    for name in ("base", "grpo"):
        shutil.copy2(results / "data" / f"fork_gradient_{name}.json.gz", tmp_path / "data")
    rebuild_results("reproduce-fork-gradient-report", tmp_path)
    rebuilt = (tmp_path / "fork_gradient_results.md").read_text()
    assert rebuilt == (results / "fork_gradient_results.md").read_text()


@pytest.mark.slow
def test_a_measurement_reads_the_base_models_fork_and_gives_each_group_its_advantages(tmp_path, capsys):
    path = tmp_path / "base.json.gz"
    assert fg.main(["--prompts", "2", "--groups", "1", "--save-data", str(path)]) == 0
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    n = 2 * data["group"]
    assert len(data["fork"]) == len(data["length"]) == len(data["advantage"]) == n
    assert data["prompt"] == [0] * data["group"] + [1] * data["group"]
    chose = [i for i in range(n) if data["fork"][i] >= 0]
    assert chose  # the base model names a strategy in (almost) every sample
    for i in chose:
        assert data["pi"][i] == data["ref"][i]  # the base model is its own reference
        assert 0.9 < sum(data["pi"][i]) <= 1 + 1e-4  # the fork's mass is on the six strategy markers
    advantage = np.array(data["advantage"]).reshape(2, -1)
    assert np.abs(advantage.sum(1)).max() < 1e-4  # group-centred
    assert "| grpo | 0.2 | 4 |" in capsys.readouterr().out
