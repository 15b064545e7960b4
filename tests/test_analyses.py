"""What the samples say, computed beside each evaluation (sage.eval.analyses): the pattern formula and the
strategy mix by hand, the batched perplexity against a hand computation; and analysis/ (sage-report) never
imports torch or transformers."""

import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sage.eval.analyses import PATTERNS, completion_perplexities, pattern_frequency, strategy_mix
from sage.testbed.model import make_model
from sage.testbed.task import make_problems, teacher_completion
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


def test_batched_perplexity_equals_a_hand_computation():
    """Right-padded batches of different lengths give each completion the perplexity of its own
    unpadded sequence: exp of the mean negative log-likelihood of the completion tokens."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = make_model(
        {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2}, tok
    ).eval()
    prompts = ["12*3+4=", "7*8+10=", "5*5+5="]
    texts = ["<SOLUTION>40</SOLUTION>", "66", ""]
    batched = completion_perplexities(model, tok, prompts, texts, batch_size=2)
    assert math.isnan(batched[2])  # an empty completion has no perplexity
    for i in (0, 1):
        p_ids = tok(prompts[i], add_special_tokens=False)["input_ids"]
        c_ids = tok(texts[i], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p_ids + c_ids])).logits[0], -1)
        nll = -sum(logp[len(p_ids) + t - 1, c].item() for t, c in enumerate(c_ids)) / len(c_ids)
        assert batched[i] == pytest.approx(math.exp(nll), rel=1e-5)
