"""What the samples of an evaluation say beyond right or wrong, computed beside the evaluation and logged
with it: reasoning patterns among correct solutions (Table 2), the testbed's solution-strategy mix (mode
collapse shows as one strategy taking over) and each sample's perplexity under the base model (Figure 7).
``sage-report`` reads these from MLflow; it never loads a model.

Pattern detectors are the paper's keyword lists (its reasoning-pattern analysis), case-insensitive, on word
boundaries. On the arithmetic testbed they find nothing (its working out is bare arithmetic): the numbers
are still computed and shown, since the same code runs on the math benchmarks.

Perplexity: PPL(y | x) = exp( -(1/|y|) sum_t log pi_base(y_t | x, y_<t) ). The prompt x is rendered as
evaluation rendered it (``sage.eval.sampling.prompt_texts``), tokenised without special tokens as the
sampler did. The completion is re-tokenised from its text (the sampler dropped the end token), so y has no
end-of-sequence token. Empty completions have no perplexity and are left out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sage.eval.sampling import prompt_texts
from sage.testbed.task import (
    FORK_MARKERS,
    FORK_STRATEGIES,
    RARE_STRATEGY,
    STRATEGIES,
    TIERS,
    classify_strategy,
    problem_tier,
)

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
FORK_STRATEGY_NAMES = (*FORK_STRATEGIES, "other")


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
    """Fraction of ALL samples (right or wrong) following each testbed strategy; sums to 1. The fork
    world's six strategies when any sample announces one (a fork-world model writes its marker first),
    else the first worlds' three: each world's runs keep one set of keys."""
    texts = [t for group in completions for t in group]
    if not texts:
        raise ValueError("strategy_mix: no completions")
    fork = any(marker in t for t in texts for marker in FORK_MARKERS.values())
    flat = [classify_strategy(t) for t in texts]
    return {s: flat.count(s) / len(flat) for s in (FORK_STRATEGY_NAMES if fork else STRATEGY_NAMES)}


# Bounds on what one step of the perplexity computation holds, so that a 7B model's 152k-token vocabulary
# never meets a whole batch at once: 32 sequences x 2,200 tokens x 152,064 float32 logits would be 40 GiB.
FORWARD_TOKENS = 16384  # padded tokens per forward pass through the decoder (hidden states only)
LOGIT_TOKENS = 1024  # completion positions whose full-vocabulary logits exist at once (0.6 GiB at 152k)


def _token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped longest first so that each group's padded size (count x its
    longest) stays within ``max_tokens``; a sequence longer than that is a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _check_logits_from_hidden(model, decoder, head, ids: torch.Tensor) -> None:
    """The computation below takes a model's logits to be its output embedding applied to the decoder's
    last hidden state (true of Qwen2, Llama, Mistral); a model that scales or caps them would get wrong
    perplexities, so a few tokens of the first sequence are compared with the model's own forward."""
    full = model(input_ids=ids, use_cache=False).logits.float()
    ours = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(full, ours, rtol=1e-3, atol=1e-3 * float(full.abs().max())):
        raise ValueError(
            f"perplexity: {type(model).__name__}'s logits are not its output embedding of the last hidden "
            "state; set eval.perplexity_cap=0 to skip the analysis"
        )


@torch.no_grad()
def completion_perplexities(
    model,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_tokens: int = FORWARD_TOKENS,
    logit_tokens: int = LOGIT_TOKENS,
) -> np.ndarray:
    """PPL of each completion given its prompt text; NaN for an empty completion.

    The decoder runs on batches of at most ``max_tokens`` padded tokens and returns hidden states only; the
    hidden states at the positions that predict a completion token are gathered and the output embedding
    is applied to ``logit_tokens`` of them at a time, so no logits of prompt or padding positions exist and
    the largest logits tensor is ``logit_tokens`` x vocabulary, whatever the batch."""
    out = np.full(len(prompts), np.nan)
    encoded = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        if c_ids:
            encoded.append((i, p_ids, c_ids))
    if not encoded:
        return out
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = model.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    first = encoded[0][1] + encoded[0][2]
    probe = first[: min(8, logit_tokens)]  # within the logits budget too
    _check_logits_from_hidden(model, decoder, head, torch.tensor([probe], device=device))
    for group in _token_batches([len(p) + len(c) for _, p, c in encoded], max_tokens):
        chunk = [encoded[g] for g in group]
        width = max(len(p) + len(c) for _, p, c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # (B, T), right-padded
        attn = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)  # (B, T): positions holding a completion token
        for b, (_, p, c) in enumerate(chunk):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            attn[b, : len(p) + len(c)] = 1
            target[b, len(p) : len(p) + len(c)] = True
        ids, attn, mask = ids.to(device), attn.to(device), target[:, 1:].to(device)  # mask: (B, T-1)
        hidden = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state  # (B, T, H)
        states = hidden[:, :-1][mask]  # (N, H): the positions predicting tokens 1..T-1 that are completion
        labels = ids[:, 1:][mask]  # (N,)
        rows = torch.arange(len(chunk), device=device)[:, None].expand_as(mask)[mask]  # (N,) sequence of each
        nll = torch.zeros(len(chunk), dtype=torch.float64, device=device)  # (B,)
        for start in range(0, len(labels), logit_tokens):
            logits = head(states[start : start + logit_tokens]).float()  # (n, V)
            tok = logits.gather(-1, labels[start : start + logit_tokens, None]).squeeze(-1)  # (n,)
            logp = tok - torch.logsumexp(logits, dim=-1)  # (n,)
            nll.index_add_(0, rows[start : start + logit_tokens], -logp.double())
            del logits
        nll = (nll / mask.sum(-1)).cpu()  # (B,): mean over each completion's tokens
        for b, (i, _, _) in enumerate(chunk):
            out[i] = float(torch.exp(nll[b]))
    return out


def load_base(path: str, dtype: str):
    """(model, tokenizer) of the base model in eval mode, in ``dtype`` (``model.dtype``: the dtype it was
    trained and evaluated in), on the GPU if there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model.to("cuda") if torch.cuda.is_available() else model, tokenizer


def sample_analyses(result: dict, rows: list[dict] | None = None) -> dict[str, float]:
    """Pattern frequencies (``pattern/<name>``) of one dataset's evaluation result (its first seed's
    completions and correctness, row-aligned); on the testbed's problems (all of them when ``rows`` is not
    given) also the mix of the testbed's strategies (``strategy/<name>``), and given its ``rows``, the
    testbed's figures by tier (:func:`tier_figures`, over every seed). A math benchmark's completions
    follow none of the testbed's strategies: a mix of them would be a figure of nothing."""
    completions, correct = result["completions"][0], result["correct"][0]
    out = {f"pattern/{name}": pattern_frequency(completions, correct, rx) for name, rx in PATTERNS.items()}
    if rows is None or testbed_problems(rows) is not None:
        out |= {f"strategy/{name}": v for name, v in strategy_mix(completions).items()}
    if rows is not None:
        for seed_completions, seed_correct in zip(result["completions"], result["correct"], strict=True):
            for name, value in tier_figures(rows, seed_completions, seed_correct).items():
                out[name] = out.get(name, 0.0) + value / len(result["correct"])
    return out


TESTBED_PROBLEM = re.compile(r"(\d+)\*(\d+)\+(\d+)=")


def testbed_problems(rows: list[dict]) -> list[re.Match] | None:
    """Each row's testbed problem parsed (a, b, c), or None when any row is not one (a math benchmark)."""
    parsed = [TESTBED_PROBLEM.fullmatch(r["problem"]) for r in rows]
    return parsed if all(parsed) else None


def tier_figures(
    rows: list[dict], completions: Sequence[Sequence[str]], correct: np.ndarray
) -> dict[str, float]:
    """The testbed's held-out problems by tier (``sage.testbed.task.problem_tier``): pass@1 and pass@n
    (n: the samples per problem) of each tier, ``tier/<tier>/pass@<k>``, and in the fork world the share
    of the rare strategy among each tier's samples, ``rare_share/<tier>``: whether a method finds (or
    keeps) the one strategy that solves tail problems. The world is the fork world when any sample
    announces a fork strategy. {} for rows that are not testbed problems (a math benchmark)."""
    from sage.metrics import pass_at_k_curve

    parsed = testbed_problems(rows)
    if not parsed:
        return {}
    correct = np.asarray(correct, dtype=bool)
    texts = [t for group in completions for t in group]
    world = "fork" if any(m in t for t in texts for m in FORK_MARKERS.values()) else "graded"
    tiers = np.array([problem_tier(world, int(m[1]), int(m[2])) for m in parsed])
    n = correct.shape[1]
    out: dict[str, float] = {}
    for tier in TIERS:
        chosen = tiers == tier
        if not chosen.any():
            continue
        curve = pass_at_k_curve(correct[chosen], sorted({1, n}))
        out |= {f"tier/{tier}/pass@{k}": v for k, v in curve.items()}
        if world == "fork":
            used = [classify_strategy(t) for i in np.flatnonzero(chosen) for t in completions[i]]
            out[f"rare_share/{tier}"] = used.count(RARE_STRATEGY) / len(used)
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


def logged_perplexities(tracker, label: str) -> set[str]:
    """Datasets whose perplexity artifact the run already holds: work a rerun (a requeued job, sage-eval
    again with the same settings) must not redo. The artifact is the run's last record of a dataset's
    analyses (``sage.tracking.Tracker.log_analyses`` writes it after the metrics, as
    ``eval/<label>/<label>_<dataset>_perplexity.json``), so its presence means the dataset is complete."""
    suffix = "_perplexity.json"
    names = (Path(f.path).name for f in tracker.client.list_artifacts(tracker.run_id, f"eval/{label}"))
    return {n.removeprefix(f"{label}_").removesuffix(suffix) for n in names if n.endswith(suffix)}


def stale_perplexities(tracker, label: str, datasets: list[str]) -> set[str]:
    """Datasets whose logged perplexity median this evaluation's record names stale (``Tracker.log_eval``:
    metrics of an earlier evaluation of other samples that this one has not logged yet)."""
    from sage.metrics import metric_name
    from sage.tracking import metric_key

    return {
        ds
        for ds in datasets
        if metric_key(metric_name(label, ds, "perplexity_median")) in tracker.stale(label, ds)
    }


def log_analyses(
    tracker,
    label: str,
    rows_by_dataset: dict,
    results: dict,
    *,
    chat: bool,
    base: str | None,
    cap: int,
    dtype: str,
) -> None:
    """The analyses of one evaluated checkpoint, per dataset, logged to the run: pattern and strategy
    frequencies always (a resumed run logs no point twice), perplexities of at most ``cap`` samples under
    the ``base`` model folder loaded in ``dtype`` (``model.dtype``) unless there is none or ``cap`` is 0
    (said in one logged line). Datasets whose perplexities the run already holds are not scored again, and
    the base model is loaded only if one is left."""
    todo: list[str] = []
    if base is None or cap == 0:
        why = "eval.perplexity_cap=0" if cap == 0 else "no base model is known for this checkpoint"
        log.info("perplexity under the base model not computed for %s: %s", label, why)
    else:
        # held, and of these samples: an evaluation of other samples (a run re-evaluated at the same step
        # with another eval.n_samples) leaves its perplexities stale, and they are scored again
        done = logged_perplexities(tracker, label) - stale_perplexities(tracker, label, list(results))
        todo = [ds for ds in results if ds not in done]
        if len(todo) < len(results):
            kept = sorted(set(results) - set(todo))
            log.info("perplexity of %s on %s: already in the run, not computed again", label, ", ".join(kept))
    model = load_base(base, dtype) if todo else None
    for ds, result in results.items():
        ppl = perplexities(model, rows_by_dataset[ds], result, chat=chat, cap=cap) if ds in todo else None
        tracker.log_analyses(label, ds, sample_analyses(result, rows_by_dataset[ds]), ppl)
