"""Guide diagnostics (``python -m sage.eval.guide_diagnostics``): the entropy, the token categories and each
guide's q against hand-computed values, the forward pass's alignment against a full forward, and one small
run on the testbed model whose files and numbers must agree with each other."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sage.config import ConfigError
from sage.eval import guide_diagnostics as gd
from sage.eval import guide_maths as gm
from sage.eval import guide_sampling as gs
from sage.objective.guides import (
    BranchGuide,
    NoGuide,
    RandomGuide,
    TokenGuide,
    finalize,
    noise_generator,
    random_q,
)
from sage.objective.schedules import ConstantSchedule

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ entropy, log-probs
def test_entropy_and_log_probs_by_hand():
    # uniform over 2: ln 2; (1/2, 1/4, 1/4): 1.5 ln 2; a near one-hot: ~0
    logits = torch.tensor(
        [
            [0.0, 0.0, -1e9],
            [math.log(0.5), math.log(0.25), math.log(0.25)],
            [30.0, 0.0, 0.0],
        ]
    )
    h = gm.token_entropy(logits)
    assert h[0].item() == pytest.approx(math.log(2), abs=1e-6)
    assert h[1].item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    assert h[2].item() == pytest.approx(0.0, abs=1e-9)
    logp = gm.token_log_probs(logits, torch.tensor([1, 2, 0]))
    assert logp.tolist() == pytest.approx([math.log(0.5), math.log(0.25), 0.0], abs=1e-6)


def test_solution_statistics_align_with_a_full_forward():
    """The positions that predict the solution's tokens, and no others: against the logits of a full
    forward pass over prompt + solution, on a small random Qwen2 model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    prompt, solution = [3, 7, 11, 2], [5, 9, 1]
    entropy, logp = gs.solution_statistics(model, prompt, solution)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([prompt + solution])).logits[0].float()
    predicting = full[len(prompt) - 1 : len(prompt) + len(solution) - 1]  # (3, V)
    p = torch.softmax(predicting, -1)
    assert entropy == pytest.approx((-(p * p.log()).sum(-1)).double().numpy(), abs=1e-5)
    picked = torch.log_softmax(predicting, -1)[torch.arange(3), torch.tensor(solution)]
    assert logp == pytest.approx(picked.double().numpy(), abs=1e-5)


# ------------------------------------------------------------------------------------------- categories
def test_categories_of_a_solution_by_hand():
    tokens = [
        ("Let", "approach_word"),  # lexicon word, first of the solution
        (" x", "other"),
        (" =", "operator"),
        (" ", "whitespace"),
        ("3", "number"),
        (".", "operator"),
        ("5", "number"),  # 3.5: no sentence ends inside a number
        (".", "operator"),
        (" The", "step_opening"),  # after ". ": a sentence opens, not a lexicon word
        (" area", "other"),
        (" we", "approach_word"),
        (" sub", "approach_word"),  # "substitute" starts here
        ("stitute", "other"),  # the rest of the word
        ("\n\n", "whitespace"),
        ("1", "step_opening"),  # a numbered step: the line's first visible token
        (" Since", "approach_word"),
        (" \\frac", "operator"),
        ("{", "operator"),
        ("2", "number"),
        ("}", "operator"),
        ("\n", "whitespace"),
        ("Area", "step_opening"),  # a line opens; "Area" is not in the lexicon
        (" ", "whitespace"),
        ("letter", "other"),  # "let" is a word of the lexicon, "letter" is not
        ("<|im_end|>", "other"),  # a special token
    ]
    texts = [t for t, _ in tokens]
    special = [t == "<|im_end|>" for t in texts]
    assert gm.categorise(texts, special) == [c for _, c in tokens]


def test_category_shares_and_lift_by_hand():
    categories = np.array(["number", "number", "operator", "approach_word"], dtype=object)
    entropies = np.array([2.0, 0.1, 0.1, 1.5])
    where = gm.where_high(categories, entropies, {"paper": 1.2})
    assert where["base_rate"]["number"] == 0.5 and where["base_rate"]["approach_word"] == 0.25
    above = where["paper"]
    assert above["tokens"] == 2
    assert above["share"]["number"] == 0.5 and above["share"]["approach_word"] == 0.5
    assert above["lift"]["number"] == 1.0 and above["lift"]["approach_word"] == 2.0
    assert above["above_rate"]["number"] == 0.5 and above["above_rate"]["operator"] == 0.0
    assert math.isnan(above["lift"]["whitespace"])  # no base: no lift
    assert sum(above["share"].values()) == pytest.approx(1.0)
    assert where["mean_entropy"]["number"] == pytest.approx(1.05)


def test_lift_intervals_resample_solutions_not_tokens():
    """Two solutions, identical in every resample-relevant way: a resample of solutions is one of (a, a),
    (a, b), (b, b), and each gives the same lift, so the interval is a point. Resampling tokens instead
    would spread it."""
    categories = np.array(["number", "operator"] * 2, dtype=object)
    selected = np.array([True, False] * 2)
    solution = np.array([0, 0, 1, 1])
    iv = gm.lift_intervals(categories, selected, solution, draws=200)
    assert iv["number"] == pytest.approx((2.0, 2.0)) and iv["operator"] == pytest.approx((0.0, 0.0))
    assert all(math.isnan(v) for v in iv["whitespace"])  # in no solution


@pytest.mark.parametrize("solutions", [30, 80])
def test_lift_intervals_cover_the_true_lift_when_solutions_differ(solutions):
    """Coverage by simulation, clustered data with unequal solutions: each solution has its own rate of
    approach words among its high-entropy tokens (a solution-level effect that resampling tokens would
    ignore) and its own length. The true lift is the one the simulation converges to; the 95% interval over
    solutions must hold it in at least 90% of 300 simulated samples (80 solutions: the pages' sample)."""
    rng = np.random.default_rng(5)
    base_p, high_rate, sims, hits = 0.1, 0.12, 300, 0
    # the shares it converges to: E[p_high] above the threshold, 0.12 E[p_high] + 0.88 base_p overall
    p_high_mean = np.clip(rng.normal(0.3, 0.15, 1_000_000), 0, 1).mean()
    true = p_high_mean / (high_rate * p_high_mean + (1 - high_rate) * base_p)
    for sim in range(sims):
        lengths = rng.integers(50, 400, solutions)
        sol = np.repeat(np.arange(solutions), lengths)
        p_high = np.clip(rng.normal(0.3, 0.15, solutions), 0.0, 1.0)[sol]  # each solution's own rate
        high = rng.random(len(sol)) < high_rate
        approach = np.where(high, rng.random(len(sol)) < p_high, rng.random(len(sol)) < base_p)
        cats = np.where(approach, "approach_word", "other").astype(object)
        lo, hi = gm.lift_intervals(cats, high, sol, draws=400, seed=sim)["approach_word"]
        hits += lo <= true <= hi
    assert hits / sims >= 0.90, hits / sims


def test_lift_intervals_cover_the_true_lift_when_problems_differ():
    """40 problems x 2 solutions, as on docs/results/real_entropy.md, where a problem's two solutions share
    its rate of approach words among their high-entropy tokens (a problem-level effect): the interval that
    resamples problems must hold the true lift in at least 90% of 300 simulated samples."""
    rng = np.random.default_rng(6)
    base_p, high_rate, sims, hits = 0.1, 0.12, 300, 0
    p_high_mean = np.clip(rng.normal(0.3, 0.15, 1_000_000), 0, 1).mean()
    true = p_high_mean / (high_rate * p_high_mean + (1 - high_rate) * base_p)
    for sim in range(sims):
        problems = np.repeat(np.arange(40), 2)  # each problem's two solutions
        lengths = rng.integers(50, 400, len(problems))
        problem = np.repeat(problems, lengths)
        p_high = np.clip(rng.normal(0.3, 0.15, 40), 0.0, 1.0)[problem]  # each problem's own rate
        high = rng.random(len(problem)) < high_rate
        approach = np.where(high, rng.random(len(problem)) < p_high, rng.random(len(problem)) < base_p)
        cats = np.where(approach, "approach_word", "other").astype(object)
        lo, hi = gm.lift_intervals(cats, high, problem, draws=400, seed=sim)["approach_word"]
        hits += lo <= true <= hi
    assert hits / sims >= 0.90, hits / sims


def test_branch_and_archer_side_by_side_by_entropy_bin():
    q_branch = np.array([1.0, 1.0, 1.4, 1.4])
    q_archer = np.array([1.2, 1.2, 0.5, 0.5])
    h = np.array([0.05, 0.05, 1.5, 3.0])
    bins = gm.pair_by_entropy(q_branch, q_archer, h, (0.0, 0.1, 1.2))
    assert [(b["low"], b["share"]) for b in bins] == [(0.0, 0.5), (1.2, 0.5)]  # the empty bin left out
    assert bins[0]["ratio"] == pytest.approx(1.0 / 1.2) and bins[1]["ratio"] == pytest.approx(1.4 / 0.5)
    released = gm.pair_by_entropy(q_branch, np.array([1.0, 1.0, 0.0, 0.0]), h, (0.0, 1.2))
    assert math.isnan(released[1]["ratio"]) and released[1]["b"] == 0.0


def test_archers_strength_not_its_q_is_set_beside_branch():
    """At step 0 Archer's released tokens have q = pi/pi_ref = 1, yet k3 pulls there with strength 0: the
    comparison reads strengths. Two solutions of 5 tokens: each one's top token (above its own 0.8
    quantile) is released."""
    from sage.objective.guides import ArcherGuide, BranchGuide

    h = [np.array([0.1, 0.2, 0.3, 0.4, 2.0]), np.array([0.0, 0.0, 0.5, 0.1, 0.2])]
    archer, branch = ArcherGuide(), BranchGuide(ratio=0.3, threshold=1.2)
    q = gm.guide_q(archer, [np.zeros(5), np.zeros(5)], h)
    assert all((x == 1.0).all() for x in q)  # the release's q at step 0
    strength = gm.anchor_strength(archer, q, h)
    assert strength[0].tolist() == [1, 1, 1, 1, 0] and strength[1].tolist() == [1, 1, 0, 1, 1]
    branch_q = gm.guide_q(branch, [np.zeros(5), np.zeros(5)], h)
    assert gm.anchor_strength(branch, branch_q, h) is branch_q  # Branch's strength is its q


def test_entropy_summary_by_hand():
    entropies = np.array([0.0, 0.5, 1.0, 1.5, 2.0])
    s = gm.entropy_summary(entropies, [2, 3], {"paper": 1.2, "p60": 1.0})
    assert s["mean"] == 1.0 and s["quantiles"]["q50"] == 1.0
    assert s["above"]["paper"]["share"] == 0.4 and s["above"]["paper"]["per_solution"] == 1.0
    assert s["above"]["p60"]["share"] == 0.4  # strictly above: the threshold's own token is not
    assert sum(b["share"] for b in s["histogram"]) == pytest.approx(1.0)
    bins = {(b["low"], b["high"]): b["share"] for b in s["histogram"]}
    assert bins[(1.0, 1.2)] == 0.2 and bins[(1.2, 1.5)] == 0.0 and bins[(1.5, 2.0)] == 0.2
    assert bins[(2.0, 3.0)] == 0.2  # the top value falls in [2, 3)


# ------------------------------------------------------------------------------------------ guides' q
LOGPS = [np.log([0.9, 0.5, 0.2, 0.7]), np.log([0.6, 0.3])]  # two solutions of different lengths
ENTROPIES = [np.array([0.5, 1.5, 3.0, 1.2]), np.array([2.0, 0.0])]


def test_branch_q_by_hand():
    q = gm.guide_q(BranchGuide(ratio=0.3, threshold=1.2), LOGPS, ENTROPIES)
    # 1 + 0.3 max(0, H - 1.2), clamped at 1.4; padding never reaches a solution
    assert q[0] == pytest.approx([1.0, 1.09, 1.4, 1.0], abs=1e-6)
    assert q[1] == pytest.approx([1.24, 1.0], abs=1e-6)


def test_token_q_by_hand():
    """Rank normalisation and no noise: w = rank of the surprisal within its own solution / (n - 1)."""
    guide = TokenGuide(ConstantSchedule(), alpha_start=0.3, sigma_start=0.0, normalisation="rank")
    q = gm.guide_q(guide, LOGPS, ENTROPIES)
    # surprisals -log(0.9, 0.5, 0.2, 0.7): ranks 0, 2, 3, 1 of 3; -log(0.6, 0.3): ranks 0, 1 of 1
    assert q[0] == pytest.approx([1.0, 1.2, 1.3, 1.1], abs=1e-6)
    assert q[1] == pytest.approx([1.0, 1.3], abs=1e-6)


def test_random_and_no_guide_are_the_guides_own():
    assert all((q == 1).all() for q in gm.guide_q(NoGuide(), LOGPS, ENTROPIES))
    guide = RandomGuide(ConstantSchedule(), eps_start=0.5, sigma_start=0.3, seed=4)
    q = gm.guide_q(guide, LOGPS, ENTROPIES)
    # micro-batch 0 at step 0, rank 0: the trainer's noise for it, right-padded to the longer solution
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    expected = finalize(random_q(mask, 0.5, 0.3, noise_generator(4, 0, 0, 0)), mask, 0.6, 1.4)
    assert q[0] == pytest.approx(expected[0].double().numpy())
    assert q[1] == pytest.approx(expected[1, :2].double().numpy())
    assert not (q[0] == 1).all()


def test_q_summary_by_hand():
    q = np.array([1.0, 1.4, 0.8, 1.2])
    categories = np.array(["number", "number", "other", "other"], dtype=object)
    entropies = np.array([0.0, 3.0, 0.0, 2.0])
    s = gm.q_summary(q, categories, entropies, {"paper": 1.2}, q_max=1.4)
    assert s["mean"] == pytest.approx(1.1)
    assert s["share_gt_1"] == 0.5 and s["share_lt_1"] == 0.25 and s["share_at_q_max"] == 0.25
    assert s["mean_by_category"]["number"] == pytest.approx(1.2)
    assert s["mean_above"]["paper"] == pytest.approx(1.3)


# ------------------------------------------------------------------------------------ the command, small
def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    gd.register_diagnostics_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("guide_diagnostics", overrides=list(overrides))


def test_bad_settings_are_one_line_errors_naming_the_key():
    for override, key in (
        ("percentile=100", "percentile"),
        ("eval.n_samples=0", "eval.n_samples"),
        ("guides.token.alpha_start=-1", "guides.token"),
        ("+guides.fork._target_=sage.objective.guides.ForkGuide", "guides.fork"),  # needs fork markers
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
            gd.check(compose(override))
        assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_small_run_on_the_testbed_model(tmp_path, monkeypatch):
    """4 held-out problems x 2 solutions of the testbed model: the three files, the numbers consistent with
    each other and with the solutions pictured, and the MLflow run holding them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = compose(
        "eval.limit=4", "eval.n_samples=2", "shown=2", f"output_dir={tmp_path / 'out'}", f"tracking.uri={uri}"
    )
    clusters = []  # what the lifts' intervals resample: each token's problem, not its solution
    lift_intervals = gm.lift_intervals
    monkeypatch.setattr(
        gm,
        "lift_intervals",
        lambda c, s, cluster, **kw: clusters.append(cluster) or lift_intervals(c, s, cluster, **kw),
    )
    out = gd.run(cfg)
    assert clusters and all(len(np.unique(c)) == 4 for c in clusters)  # 4 problems, 8 solutions
    files = {p.name for p in out.iterdir()}
    assert {"summary.md", "diagnostics.json", "completions.html"} <= files
    report = json.loads((out / "diagnostics.json").read_text())

    e = report["entropy"]
    assert e["solutions"] == 8 and e["tokens"] > 8
    assert sum(b["share"] for b in e["histogram"]) == pytest.approx(1.0)
    assert e["quantiles"]["q10"] <= e["quantiles"]["q50"] <= e["quantiles"]["q99"]
    assert set(e["above"]) == {"paper", "p90"}
    assert e["above"]["p90"]["threshold"] == pytest.approx(e["quantiles"]["q90"])
    assert e["above"]["p90"]["share"] == pytest.approx(0.1, abs=0.02)  # the 90th percentile, up to ties

    w = report["where"]
    assert sum(w["base_rate"].values()) == pytest.approx(1.0)
    for name in ("paper", "p90"):
        if w[name]["tokens"]:
            assert sum(w[name]["share"].values()) == pytest.approx(1.0)
        assert w[name]["tokens"] == round(e["above"][name]["share"] * e["tokens"])

    g = report["guides"]
    assert set(g) == {"none", "random", "token", "branch", "archer", "branch_paper", "branch_p90"}
    assert g["none"]["mean"] == 1.0 and g["none"]["share_gt_1"] == 0.0
    for name in ("branch", "branch_paper", "branch_p90"):
        assert g[name]["share_lt_1"] == 0.0  # branch only raises
        assert 1.0 <= g[name]["mean"] <= g[name]["max"] <= 1.4
    # branch raises exactly the tokens above its threshold
    assert g["branch_paper"]["share_gt_1"] == pytest.approx(e["above"]["paper"]["share"])
    assert g["branch_p90"]["share_gt_1"] == pytest.approx(e["above"]["p90"]["share"])
    assert g["branch"]["described"] == "BranchGuide(ratio 0.3, threshold 0.3)"  # model=tiny's threshold

    page = (out / "completions.html").read_text()
    assert page.count("<h3>solution") == 2 and "q branch_p90" in page and "q none" not in page
    summary = (out / "summary.md").read_text()
    assert "| branch_p90: BranchGuide(ratio 0.3, threshold" in summary
    assert report["settings"]["interval_clusters"] == "problem" and "bootstrap over problems" in summary

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.data.metrics["entropy/mean"] == pytest.approx(e["mean"])
    assert run.data.tags["sage.kind"] == "guide_diagnostics"
    logged = {Path(f.path).name for f in client.list_artifacts(run_id, "guide_diagnostics")}
    assert logged == {"summary.md", "diagnostics.json", "completions.html"}


def test_stored_solutions_are_measured_without_sampling(tmp_path, monkeypatch):
    """samples=<an evaluation cell folder>: its stored solutions are measured (no sampler is opened), under
    every guide on the same tokens, Archer's beside Branch's; a cell whose problems the evaluation datasets
    lack is refused in one line naming it."""
    from sage.eval import sampling
    from sage.eval.evaluate import load_eval_rows

    rows = load_eval_rows(compose().eval.datasets, 3)["arith_heldout"]
    cell = tmp_path / "cell"
    cell.mkdir()
    ids = [str(r.get("id", r["problem"])) for r in rows]
    settings = {
        "n_samples": 2,
        "temperature": 0.7,
        "top_p": 1.0,
        "max_new_tokens": 16,
        "chat": False,
        "seed": 0,
    }
    (cell / "meta.json").write_text(json.dumps({"ids": ids, "key": {"settings": settings}}))
    (cell / "completions.json").write_text(json.dumps([["12+3=15", "7*8=56 so"] for _ in rows]))

    def no_sampling(*a, **kw):
        raise AssertionError("a stored cell is measured, not sampled again")

    monkeypatch.setattr(sampling, "open_sampler", no_sampling)
    cfg = compose(
        "eval.n_samples=2", f"samples={cell}", f"output_dir={tmp_path / 'out'}", "tracking.enabled=false"
    )
    report = json.loads((gd.run(cfg) / "diagnostics.json").read_text())
    assert report["settings"]["backend"] == "stored" and report["settings"]["samples"] == str(cell)
    assert report["settings"]["temperature"] == 0.7 and report["entropy"]["solutions"] == 6
    assert {"archer", "branch"} <= set(report["guides"])
    assert report["guides"]["archer"]["described"].startswith("ArcherGuide")

    (cell / "meta.json").write_text(json.dumps({"ids": ["no such problem"], "key": {"settings": settings}}))
    with pytest.raises(ConfigError) as error:
        gd.run(cfg)
    assert "\n" not in str(error.value) and str(error.value).startswith(
        f"samples={cell}: problem 'no such problem'"
    )


def test_top_texts_by_hand():
    texts = np.array([" Let", "2", " Let", "x", "2", "2"], dtype=object)
    selected = np.array([True, True, True, False, False, False])
    top = gm.top_texts(texts, selected, k=5)
    assert top == [
        {"text": " Let", "count": 2, "share": 2 / 3, "selected_rate": 1.0},
        {"text": "2", "count": 1, "share": 1 / 3, "selected_rate": 1 / 3},
    ]
    assert gm.top_texts(texts, np.zeros(6, dtype=bool)) == []


def test_a_cached_models_path_is_recorded_without_the_machines_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models" / "gguf-abc").mkdir(parents=True)
    assert (
        gd.portable_path(str(tmp_path / "cache" / "models" / "gguf-abc")) == "$SAGE_CACHE_DIR/models/gguf-abc"
    )
    assert gd.portable_path("/elsewhere/model") == "/elsewhere/model"


def test_every_guides_strength_in_the_training_logs_buckets():
    """The offline view of anchor_buckets/: ten tokens, quintiles of two tokens each, and the tokens above
    1.2 nats; each guide's mean strength there."""
    h = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 1.5, 2.5])
    strengths = {"branch": np.where(h > 1.2, 1.3, 1.0), "archer": np.where(h > 1.2, 0.0, 1.0)}
    rows = {r["bucket"]: r for r in gm.strength_by_bucket(strengths, h)}
    assert list(rows) == ["q1", "q2", "q3", "q4", "q5", "above_1.2"]
    assert rows["q5"]["share"] == 0.2 and (rows["q5"]["entropy_low"], rows["q5"]["entropy_high"]) == (
        1.5,
        2.5,
    )
    assert rows["q5"]["branch"] == pytest.approx(1.3) and rows["q5"]["archer"] == 0.0
    assert rows["q1"]["branch"] == 1.0 and rows["above_1.2"]["archer"] == 0.0
