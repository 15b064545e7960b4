"""What the samples of an evaluation say beyond right or wrong, computed beside the evaluation and logged
with it: reasoning patterns among correct solutions (Table 2), the testbed's solution-strategy mix (mode
collapse shows as one strategy taking over) and each sample's perplexity under the base model (Figure 7).
``sage-report`` reads these from MLflow; it never loads a model.

Pattern detectors are the keyword lists of SAGE.md section 6, case-insensitive, on word boundaries. On the
arithmetic testbed they find nothing (its working out is bare arithmetic): the numbers are still computed
and shown, since the same code runs on the math benchmarks.

Perplexity: PPL(y | x) = exp( -(1/|y|) sum_t log pi_base(y_t | x, y_<t) ). The prompt x is rendered as
evaluation rendered it (``sage.eval.sampling.prompt_texts``), tokenised without special tokens as the
sampler did. The completion is re-tokenised from its text (the sampler dropped the end token), so y has no
end-of-sequence token. Empty completions have no perplexity and are left out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import numpy as np
import torch

from sage.eval.sampling import prompt_texts
from sage.testbed.task import STRATEGIES, classify_strategy

log = logging.getLogger(__name__)

PATTERNS: dict[str, re.Pattern[str]] = {
    # "let", "denote", symbol introductions ("let x =", "set n to", "define f as", "where a is")
    "constraint setup": re.compile(
        r"\blet\b|\bdenot(?:e|es|ed|ing)\b|\b(?:define|set)\s+\$?\\?[a-z]\w*\$?\s+(?:=|be|as|to)\b"
        r"|\bwhere\s+\$?\\?[a-z]\w*\$?\s+(?:is|=)",
        re.IGNORECASE,
    ),
    # "of the form", "decompose into"
    "structural reasoning": re.compile(
        r"\bof the form\b|\bdecompos(?:e|es|ed|ing|ition)\b(?:\s+\w+){0,3}?\s+into\b", re.IGNORECASE
    ),
    # "assume for contradiction", "leads to a contradiction"
    "proof by contradiction": re.compile(
        r"\bassum\w*\b[^.]{0,40}\bfor (?:the sake of )?contradiction\b|\bleads? to a contradiction\b"
        r"|\bcontradict(?:s|ion|ing)?\b",
        re.IGNORECASE,
    ),
}
STRATEGY_NAMES = (*STRATEGIES, "other")


def pattern_frequency(
    completions: Sequence[Sequence[str]], correct: np.ndarray, pattern: re.Pattern[str]
) -> float:
    """(1/N) sum_i (1/c_i) sum_j 1[pattern in correct solution j of problem i], over the N problems with
    c_i > 0 correct samples; NaN when no problem has a correct sample (there is nothing to measure).
    ``completions`` and ``correct`` are problems x samples and row-aligned (the first seed's)."""
    correct = np.asarray(correct, dtype=bool)
    if correct.shape != (len(completions), len(completions[0]) if completions else 0):
        raise ValueError(
            f"{len(completions)} problems of completions and correct {correct.shape} do not align"
        )
    per_problem = []
    for texts, ok in zip(completions, correct, strict=True):
        hits = [bool(pattern.search(t)) for t, good in zip(texts, ok, strict=True) if good]
        if hits:
            per_problem.append(sum(hits) / len(hits))
    return float(np.mean(per_problem)) if per_problem else float("nan")


def strategy_mix(completions: Sequence[Sequence[str]]) -> dict[str, float]:
    """Fraction of ALL samples (right or wrong) following each testbed strategy; sums to 1."""
    flat = [classify_strategy(t) for texts in completions for t in texts]
    if not flat:
        raise ValueError("strategy_mix: no completions")
    return {s: flat.count(s) / len(flat) for s in STRATEGY_NAMES}


@torch.no_grad()
def completion_perplexities(
    model, tokenizer, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32
) -> np.ndarray:
    """PPL of each completion given its prompt text; NaN for an empty completion."""
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
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # (B, T), right-padded
        attn = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)  # (B, T): positions holding a completion token
        for b, (_, p, c) in enumerate(chunk):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            attn[b, : len(p) + len(c)] = 1
            target[b, len(p) : len(p) + len(c)] = True
        logits = model(input_ids=ids.to(model.device), attention_mask=attn.to(model.device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): predicts tokens 1..T-1
        tok_logp = logp.gather(-1, ids[:, 1:, None].to(model.device)).squeeze(-1).cpu()  # (B, T-1)
        mask = target[:, 1:]  # (B, T-1)
        nll = -(tok_logp * mask).sum(-1) / mask.sum(-1)  # (B,)
        for b, (i, _, _) in enumerate(chunk):
            out[i] = float(torch.exp(nll[b]))
    return out


def load_base(path: str, dtype: str = "float32"):
    """(model, tokenizer) of the base model in eval mode, on the GPU if there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model.to("cuda") if torch.cuda.is_available() else model, tokenizer


def sample_analyses(result: dict) -> dict[str, float]:
    """Pattern frequencies (``pattern/<name>``) and strategy mix (``strategy/<name>``) of one dataset's
    evaluation result (its first seed's completions and correctness, row-aligned)."""
    completions, correct = result["completions"][0], result["correct"][0]
    out = {f"pattern/{name}": pattern_frequency(completions, correct, rx) for name, rx in PATTERNS.items()}
    out |= {f"strategy/{name}": v for name, v in strategy_mix(completions).items()}
    return out


def perplexities(base, rows: list[dict], result: dict, *, chat: bool, cap: int) -> list[float]:
    """Perplexity under ``base`` = (model, tokenizer) of the first ``cap`` completions (problem-major) of
    the first seed; empty completions are left out."""
    model, tokenizer = base
    prompts, texts = [], []
    for prompt, per_problem in zip(
        prompt_texts(tokenizer, rows, chat), result["completions"][0], strict=True
    ):
        prompts += [prompt] * len(per_problem)
        texts += per_problem
    ppl = completion_perplexities(model, tokenizer, prompts[:cap], texts[:cap])
    return [float(v) for v in ppl if not np.isnan(v)]


def log_analyses(
    tracker, label: str, rows_by_dataset: dict, results: dict, *, chat: bool, base: str | None, cap: int
) -> None:
    """The analyses of one evaluated checkpoint, per dataset, logged to the run: pattern and strategy
    frequencies always, perplexities of at most ``cap`` samples under the ``base`` model folder unless
    there is none or ``cap`` is 0 (said in one logged line)."""
    model = None
    if base is None or cap == 0:
        why = "eval.perplexity_cap=0" if cap == 0 else "no base model is known for this checkpoint"
        log.info("perplexity under the base model not computed for %s: %s", label, why)
    else:
        model = load_base(base)
    for ds, result in results.items():
        ppl = None if model is None else perplexities(model, rows_by_dataset[ds], result, chat=chat, cap=cap)
        tracker.log_analyses(label, ds, sample_analyses(result), ppl)
