"""Sampling-based evaluation: a correctness matrix (problems x samples) per (model, dataset, seed), and
pass@k from it with the unbiased estimator.

Departures from the authors' evaluator (SAGE.md section 7): prompts x samples are generated in large
left-padded batches (not one prompt at a time); pass@1 is the mean over ALL problems and samples; pass@k is
the unbiased estimator for every k; finished cells are stored and never re-sampled; a stored cell records
the settings that produced it and is only reused under the same settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from sage.metrics import pass_at_k_curve
from sage.prompts import make_prompt
from sage.rewards import GradingPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """Everything that changes the samples; part of every stored result's key."""

    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    chat: bool
    seed: int

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _prompt_texts(tokenizer, rows: list[dict], chat: bool) -> list[str]:
    prompts = [make_prompt(r["problem"], chat) for r in rows]
    if chat:
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return prompts


@torch.no_grad()
def sample_completions(
    model, tokenizer, rows: list[dict], s: SamplingSettings, batch_size: int
) -> list[list[str]]:
    """n_samples completions per row. All (prompt, sample) pairs are flattened, ordered by prompt length
    and generated batch_size sequences at a time, so short prompts are not padded to long ones."""
    texts = _prompt_texts(tokenizer, rows, s.chat)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    pairs = [(i, j) for i in order for j in range(s.n_samples)]  # (row, sample)
    out: list[list[str]] = [[""] * s.n_samples for _ in rows]
    tokenizer.padding_side = "left"
    torch.manual_seed(s.seed)
    do_sample = s.temperature > 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        enc = tokenizer(
            [texts[i] for i, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False
        )
        enc = {k: v.to(model.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        gen = model.generate(
            **enc,
            do_sample=do_sample,
            temperature=s.temperature if do_sample else None,
            top_p=s.top_p if do_sample else None,
            top_k=0 if do_sample else None,
            max_new_tokens=s.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
        decoded = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for (i, j), text in zip(chunk, decoded, strict=True):
            out[i][j] = text
    return out


def evaluate_dataset(
    model,
    tokenizer,
    rows: list[dict],
    settings: SamplingSettings,
    *,
    results_dir: Path,
    batch_size: int,
    pool: GradingPool,
) -> dict:
    """Correctness matrix for one (model, dataset, seed) cell, loaded from ``results_dir`` if that exact
    cell (same settings, same problem ids) was finished before. Returns {correct, completions, settings}."""
    cell = results_dir / f"{settings.key()}_seed{settings.seed}"
    ids = [r["id"] for r in rows]
    if (cell / "correct.npy").exists():
        meta = json.loads((cell / "meta.json").read_text())
        if meta["settings"] == asdict(settings) and meta["ids"] == ids:
            log.info("reusing finished evaluation cell %s", cell)
            completions = json.loads((cell / "completions.json").read_text())
            return {
                "correct": np.load(cell / "correct.npy"),
                "completions": completions,
                "settings": settings,
            }
        log.warning("stored cell %s was made with other settings or problems: re-sampling", cell)
    t0 = time.perf_counter()
    completions = sample_completions(model, tokenizer, rows, settings, batch_size)
    t_sample = time.perf_counter() - t0
    flat = [c for per_row in completions for c in per_row]
    golds = [r["answer"] for r in rows for _ in range(settings.n_samples)]
    correct = np.asarray(pool.grade_many(flat, golds), dtype=bool).reshape(len(rows), settings.n_samples)
    log.info(
        "sampled %d completions in %.1fs, graded in %.1fs",
        len(flat),
        t_sample,
        time.perf_counter() - t0 - t_sample,
    )
    # Written to a temporary folder and renamed: a killed evaluation leaves no half-finished cell.
    tmp = cell.with_name(cell.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "correct.npy", correct)
    (tmp / "completions.json").write_text(json.dumps(completions))
    (tmp / "meta.json").write_text(json.dumps({"settings": asdict(settings), "ids": ids}))
    tmp.rename(cell)
    return {"correct": correct, "completions": completions, "settings": settings}


def summarise(correct_by_seed: list[np.ndarray], ks: list[int]) -> dict[str, float]:
    """pass@k per seed -> mean and std over seeds, for each reported k."""
    curves = [pass_at_k_curve(c, ks) for c in correct_by_seed]
    out = {}
    for k in ks:
        vals = np.array([c[k] for c in curves])
        out[f"pass@{k}"] = float(vals.mean())
        out[f"pass@{k}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    return out


def load_eval_rows(datasets_cfg, limit: int | None) -> dict[str, list[dict]]:
    """Every eval dataset's rows, loaded up front so that a bad file fails before any sampling."""
    from sage.config import build

    rows = {}
    for name, node in datasets_cfg.items():
        loaded = build(node)
        rows[name] = loaded[:limit] if limit is not None else loaded
    return rows


def evaluate_model(
    model_path: str,
    rows_by_dataset: dict[str, list[dict]],
    eval_cfg,
    *,
    chat: bool,
    max_new_tokens: int,
    results_dir: Path,
    dtype: str = "float32",
) -> dict[str, dict]:
    """Evaluate one model (a folder or hub id) on every dataset and seed. Returns, per dataset,
    {"summary": {pass@k: mean, pass@k_std: std}, "correct": [matrix per seed], "completions": [...]}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    results = {}
    with GradingPool(workers=2) as pool:
        for name, rows in rows_by_dataset.items():
            per_seed = []
            for seed in eval_cfg.seeds:
                s = SamplingSettings(
                    n_samples=eval_cfg.n_samples,
                    temperature=eval_cfg.temperature,
                    top_p=eval_cfg.top_p,
                    max_new_tokens=max_new_tokens,
                    chat=chat,
                    seed=seed,
                )
                per_seed.append(
                    evaluate_dataset(
                        model,
                        tokenizer,
                        rows,
                        s,
                        results_dir=results_dir / name,
                        batch_size=eval_cfg.batch_size,
                        pool=pool,
                    )
                )
            correct = [r["correct"] for r in per_seed]
            results[name] = {
                "summary": summarise(correct, list(eval_cfg.ks)),
                "correct": correct,
                "completions": [r["completions"] for r in per_seed],
            }
    return results
