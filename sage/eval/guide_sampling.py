"""The guide diagnostics' solutions and their forward pass (``python -m sage.eval.guide_diagnostics``): new
solutions sampled with the evaluator's sampler, or a stored evaluation cell's read back, and each solution's
per-token entropy and log-prob from one teacher-forced pass, with each token's own text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sage.config import ConfigError
from sage.eval.guide_maths import token_entropy, token_log_probs


def token_texts(tokenizer, ids: Sequence[int]) -> tuple[list[str], list[bool]]:
    """Each token's own text (special tokens as their names) and whether it is special. A character that
    spans two byte-level tokens decodes as U+FFFD in each: symbols, for :func:`categorise`."""
    special = set(tokenizer.all_special_ids)
    return [tokenizer.decode([i]) for i in ids], [i in special for i in ids]


def sample_solution_ids(
    sampler, prompt_ids: list[list[int]], n: int, *, temperature: float, top_p: float, max_new: int, seed: int
) -> list[list[list[int]]]:
    """n sampled solutions (token ids, the end token included when one was sampled) of each prompt, from the
    evaluator's sampler: the HF backend's decode loop, or the vLLM engine."""
    from sage.eval.sampling import EngineSampler, HFSampler

    out: list[list[list[int]]] = [[] for _ in prompt_ids]
    if isinstance(sampler, HFSampler):
        for rows, completions in sampler.completion_ids(
            prompt_ids,
            [n] * len(prompt_ids),
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        ):
            for r, ids in zip(rows, completions, strict=True):
                out[r].append(list(ids))
        return out
    if isinstance(sampler, EngineSampler):
        from vllm import SamplingParams

        from sage.vllm_engine import generate_block

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new)
        for r, result in enumerate(generate_block(sampler.llm, prompt_ids, params, sampler.lora, seed)):
            out[r] = [list(o.token_ids) for o in result.outputs]
        return out
    raise TypeError(f"no token ids from a {type(sampler).__name__}")


def stored_solutions(
    folder: Path, rows_by_dataset: dict[str, list[dict]], tokenizer, limit: int | None, n: int
) -> tuple[list[dict], list[list[list[int]]], dict[str, Any]]:
    """(rows, solutions' token ids, the cell's sampling settings) of a stored evaluation cell: its first
    ``limit`` problems (all: None) and first ``n`` solutions of each, found by id among the evaluation
    datasets' rows, each solution's text tokenised again (the stored text has no end token). Offline: the
    same tokens can be measured under every guide, and a run's own final samples need no new sampling."""
    for name in ("completions.json", "meta.json"):
        if not (folder / name).is_file():
            raise ConfigError(f"samples={folder}: no {name} there (an evaluation cell folder holds both)")
    meta = json.loads((folder / "meta.json").read_text())
    completions = json.loads((folder / "completions.json").read_text())
    ids = list(meta["ids"])
    by_id = {str(r.get("id", r["problem"])): r for rows in rows_by_dataset.values() for r in rows}
    missing = [i for i in ids if str(i) not in by_id]
    if missing:
        raise ConfigError(
            f"samples={folder}: problem {missing[0]!r} is in none of eval.datasets "
            f"({', '.join(rows_by_dataset)}): choose the eval group the cell was evaluated on"
        )
    keep = len(ids) if limit is None else min(limit, len(ids))
    rows = [by_id[str(i)] for i in ids[:keep]]
    solutions = [
        [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:n]]
        for texts in completions[:keep]
    ]
    key = meta.get("key")
    settings = key.get("settings", {}) if isinstance(key, dict) else {}
    return rows, solutions, settings


@torch.no_grad()
def solution_statistics(
    model, prompt_ids: Sequence[int], solution: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(entropy, log-prob) at each solution token, from one teacher-forced pass over prompt + solution:
    the model's full next-token distribution at temperature 1. Only the positions that predict a solution
    token get logits (``logits_to_keep``), so a 150k vocabulary costs |solution| x V floats, not more."""
    ids = torch.tensor([list(prompt_ids) + list(solution)], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=len(solution) + 1, use_cache=False).logits[0, :-1]
    tokens = torch.tensor(list(solution), device=logits.device)
    entropy = token_entropy(logits).double().cpu().numpy()
    logp = token_log_probs(logits, tokens).double().cpu().numpy()
    return entropy, logp
