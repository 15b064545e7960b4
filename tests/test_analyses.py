"""What the samples say, computed beside each evaluation (sage.eval.analyses): the pattern formula and the
strategy mix by hand, the batched perplexity against a hand computation and against the full float32 logits
it replaces, its logits held within a token budget at a 150k-token vocabulary, the base model loaded in
model.dtype, a rerun that scores only what the run lacks; and analysis/ (sage-report) never imports torch or
transformers."""

import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sage.eval import analyses
from sage.eval.analyses import PATTERNS, completion_perplexities, pattern_frequency, strategy_mix
from sage.testbed.model import make_model
from sage.testbed.task import heldout_rows, make_problems, teacher_completion
from sage.testbed.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_analysis_imports_neither_torch_nor_transformers():
    modules = sorted(f"analysis.{p.stem}" for p in (REPO / "analysis").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(sorted(m for m in ('torch', 'transformers', 'sage.eval') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(modules) >= 4 and r.stdout.strip() == "[]"


def test_pattern_frequency_formula_by_hand():
    rx = PATTERNS["constraint setup"]
    completions = [
        ["Let x = 3, so ...", "x is 3", "wrong"],  # 2 correct, 1 with the pattern: 1/2
        ["Let y = 1", "nothing", "no"],  # no correct sample: not one of the N problems
        ["We denote by n the count", "no", "no"],  # 1 correct, with the pattern: 1/1
    ]
    correct = np.array([[True, True, False], [False, False, False], [True, False, False]])
    assert pattern_frequency(completions, correct, rx) == pytest.approx((0.5 + 1.0) / 2)
    assert math.isnan(pattern_frequency(completions, np.zeros((3, 3), bool), rx))
    assert PATTERNS["structural reasoning"].search("a number of the form 4k+1")
    assert PATTERNS["structural reasoning"].search("we decompose the sum into two parts")
    assert PATTERNS["proof by contradiction"].search("Assume, for contradiction, that p is even")
    assert not PATTERNS["constraint setup"].search("<start_working_out>12*3=36 36+5=41")


def test_strategy_mix_of_teacher_samples():
    rng = random.Random(0)
    rows = [
        [teacher_completion(p["a"], p["b"], p["c"], rng)[0] for _ in range(8)]
        for p in make_problems("train", 20, 0)
    ]
    mix = strategy_mix(rows + [["garbage"]])
    assert set(mix) == {"direct", "split", "round", "other"}
    assert sum(mix.values()) == pytest.approx(1.0) and mix["other"] == pytest.approx(1 / 161)
    assert mix["direct"] > mix["split"] > 0  # the teacher's skew (0.8 / 0.15 / 0.05)


def test_the_testbed_strategy_mix_is_reported_for_testbed_problems_only():
    """A MATH-500 completion follows none of the testbed's strategies: its run carries no strategy mix,
    while a testbed run still does."""
    rows = make_problems("train", 2, 0)
    rng = random.Random(0)
    completions = [[teacher_completion(p["a"], p["b"], p["c"], rng)[0]] for p in rows]
    result = {"completions": [completions], "correct": [np.ones((2, 1), dtype=bool)]}
    testbed = analyses.sample_analyses(result, rows)
    assert {f"strategy/{s}" for s in ("direct", "split", "round")} <= set(testbed)
    assert set(testbed) >= {f"pattern/{p}" for p in PATTERNS}
    math = [{"problem": "Determine the remainder of 54 (mod 6).", "answer": "0"}, rows[1]]
    real = analyses.sample_analyses(result, math)
    assert not any(k.startswith("strategy/") for k in real) and set(real) >= {
        f"pattern/{p}" for p in PATTERNS
    }


def tiny_model():
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = make_model({"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2}, tok)
    return model.eval(), tok


def test_batched_perplexity_equals_a_hand_computation():
    """Batches of different lengths, right-padded, and logits chunks that cut across sequences give each
    completion the perplexity of its own unpadded sequence: exp of the mean negative log-likelihood of the
    completion tokens."""
    model, tok = tiny_model()
    prompts = ["12*3+4=", "7*8+10=", "5*5+5="]
    texts = ["<SOLUTION>40</SOLUTION>", "66", ""]
    # 20 tokens per forward pass: one sequence a batch; 3 logits rows at a time: chunks span sequences
    for max_tokens, logit_tokens in [(20, 3), (10_000, 3), (10_000, 1024)]:
        batched = completion_perplexities(
            model, tok, prompts, texts, max_tokens=max_tokens, logit_tokens=logit_tokens
        )
        assert math.isnan(batched[2])  # an empty completion has no perplexity
        for i in (0, 1):
            p_ids = tok(prompts[i], add_special_tokens=False)["input_ids"]
            c_ids = tok(texts[i], add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([p_ids + c_ids])).logits[0], -1)
            nll = -sum(logp[len(p_ids) + t - 1, c].item() for t, c in enumerate(c_ids)) / len(c_ids)
            assert batched[i] == pytest.approx(math.exp(nll), rel=1e-5)


@torch.no_grad()
def full_logits_perplexities(model, tokenizer, prompts, completions, batch_size=32) -> np.ndarray:
    """The computation this module used before (issue 20, item 7): batches of 32 sequences through the
    whole vocabulary in float32, log-softmax at every position. Kept here as the reference."""
    out = np.full(len(prompts), np.nan)
    encoded = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        if c_ids:
            encoded.append((i, p_ids, c_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(p) + len(c) for _, p, c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)
        for b, (_, p, c) in enumerate(chunk):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            attn[b, : len(p) + len(c)] = 1
            target[b, len(p) : len(p) + len(c)] = True
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        tok_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = target[:, 1:]
        nll = -(tok_logp * mask).sum(-1) / mask.sum(-1)
        for b, (i, _, _) in enumerate(chunk):
            out[i] = float(torch.exp(nll[b]))
    return out


def test_perplexity_equals_the_full_logits_computation_it_replaces():
    model, tok = tiny_model()
    rng = random.Random(0)
    rows = heldout_rows(40)
    prompts = [r["problem"] for r in rows]
    texts = [
        teacher_completion(*map(int, _operands(r["problem"])), rng)[0][: rng.randint(0, 40)] for r in rows
    ]
    ours = completion_perplexities(model, tok, prompts, texts, max_tokens=256, logit_tokens=50)
    reference = full_logits_perplexities(model, tok, prompts, texts)
    assert np.isnan(ours).tolist() == np.isnan(reference).tolist() and not np.isnan(ours).all()
    np.testing.assert_allclose(ours, reference, rtol=1e-5)


def _operands(problem: str) -> list[str]:
    """a, b, c of a testbed problem ``a*b+c=``."""
    a, rest = problem.rstrip("=").split("*")
    b, c = rest.split("+")
    return [a, b, c]


class DigitTokenizer:
    """Whitespace-separated integers are the token ids: a tokenizer for a model with any vocabulary."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(w) for w in text.split()]}


def test_logits_stay_within_the_token_budget_at_a_150k_vocabulary():
    """A model with a 150k-token vocabulary (a 7B Qwen's is 152k): every logits tensor the output embedding
    produces holds at most ``logit_tokens`` rows, however many sequences and tokens are scored; the
    perplexities equal the full computation's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 150_000
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    rng = random.Random(0)
    words = lambda n: " ".join(str(rng.randrange(1, vocab)) for _ in range(n))  # noqa: E731
    prompts = [words(rng.randint(5, 30)) for _ in range(16)]
    texts = [words(rng.randint(1, 30)) for _ in range(16)]
    largest = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, output: largest.append(output.numel())
    )
    budget = 64
    try:
        ours = completion_perplexities(model, DigitTokenizer(), prompts, texts, logit_tokens=budget)
    finally:
        hook.remove()
    assert largest and max(largest) <= budget * vocab, (max(largest), budget * vocab)
    # the reference in batches of 4: its whole-vocabulary logits are what this test keeps out of memory
    reference = full_logits_perplexities(model, DigitTokenizer(), prompts, texts, batch_size=4)
    np.testing.assert_allclose(ours, reference, rtol=1e-5)


class Recorder:
    """A real MLflow run (SQLite in a temporary folder) bound to sage's Tracker."""

    def __init__(self, tmp_path):
        from sage.tracking import Tracker, open_store

        client, experiment = open_store(f"sqlite:///{tmp_path / 'mlflow.db'}", "analyses")
        self.tracker = Tracker(client, client.create_run(experiment).info.run_id, resumed=True)


def saved_base(tmp_path) -> str:
    model, tok = tiny_model()
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_the_base_model_is_loaded_in_model_dtype_and_a_rerun_scores_only_what_is_missing(
    tmp_path, monkeypatch
):
    """Perplexity loads the base in model.dtype (not float32), and a run that failed in its analysis after
    the first dataset rescores only the second when it is run again; a complete run loads no model."""
    base = saved_base(tmp_path)
    rows = {"a": heldout_rows(3, seed=1), "b": heldout_rows(2, seed=2)}
    results = {
        ds: {"completions": [[["12*3=36"] * 2 for _ in r]], "correct": [np.ones((len(r), 2), bool)]}
        for ds, r in rows.items()
    }
    loads, scored = [], []
    real_load, real_perplexities = analyses.load_base, analyses.perplexities

    def load_base(path, dtype):
        loaded = real_load(path, dtype)
        loads.append(loaded[0].dtype)
        return loaded

    def perplexities(base_model, ds_rows, result, **kw):
        name = next(ds for ds, r in rows.items() if r is ds_rows)
        if name == "b" and fail:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        scored.append(name)
        return real_perplexities(base_model, ds_rows, result, **kw)

    monkeypatch.setattr(analyses, "load_base", load_base)
    monkeypatch.setattr(analyses, "perplexities", perplexities)
    run = Recorder(tmp_path).tracker
    log = lambda: analyses.log_analyses(  # noqa: E731
        run, "base", rows, results, chat=False, base=base, cap=100, dtype="bfloat16"
    )
    fail = True
    with pytest.raises(torch.OutOfMemoryError):
        log()
    assert loads == [torch.bfloat16] and scored == ["a"]
    fail = False
    log()  # the rerun: only "b" is left
    assert loads == [torch.bfloat16] * 2 and scored == ["a", "b"]
    log()  # nothing left: the base model is not even loaded
    assert len(loads) == 2 and scored == ["a", "b"]
    assert analyses.logged_perplexities(run, "base") == {"a", "b"}
    metrics = run.client.get_run(run.run_id).data.metrics
    assert {"perplexity_median/base/a", "perplexity_median/base/b"} <= set(metrics)


def test_a_run_re_evaluated_on_other_samples_scores_their_perplexities_again(tmp_path, monkeypatch):
    """Issue 47: a run re-evaluated at the same step with another eval.n_samples kept the earlier samples'
    perplexities (held, so not scored again) under the new evaluation. Held but stale, they are scored
    again, and the new median is no longer listed stale."""
    base = saved_base(tmp_path)
    rows = {"a": heldout_rows(3, seed=1)}
    scored = []
    real_perplexities = analyses.perplexities

    def perplexities(base_model, ds_rows, result, **kw):
        scored.append(len(result["completions"][0][0]))  # samples per problem of what is scored
        return real_perplexities(base_model, ds_rows, result, **kw)

    monkeypatch.setattr(analyses, "perplexities", perplexities)
    run = Recorder(tmp_path).tracker
    for n in (2, 4, 4):  # evaluated, re-evaluated on other samples, then the same samples again
        correct = np.ones((3, n), bool)
        result = {
            "summary": {"pass@1": 1.0},
            "completions": [[["12*3=36"] * n for _ in range(3)]],
            "correct": [correct],
        }
        run.log_eval("base", "a", result, [1], None, step=0, rows=rows["a"])
        analyses.log_analyses(
            run, "base", rows, {"a": result}, chat=False, base=base, cap=100, dtype="float32"
        )
    assert scored == [2, 4]  # the re-evaluation's samples scored; the same samples again are not
    assert "perplexity_median/base/a" not in run.stale("base", "a")  # scored for this evaluation
