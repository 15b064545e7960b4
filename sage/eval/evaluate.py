"""Sampling-based evaluation: a correctness matrix (problems x samples) per (checkpoint, dataset, seed), and
the unbiased pass@k curve (k = 1..n) from it. ``sage-train``'s end-of-run evaluation and ``sage-eval`` both
call :func:`evaluate_model`, so they give the same numbers for the same checkpoint and seed.

Departures from the authors' evaluator (SAGE.md section 7):
- the HF backend runs its own decode loop over (prompt, sample) pairs batched across problems: each
  distinct prompt is prefilled once and its KV cache copied to its samples, and finished sequences leave
  the batch, so no compute goes to a prompt's duplicates or to padding after eos (``generate`` with
  num_return_sequences computes every sequence until the longest one of the call stops); Llama-family
  models run through ``sage.eval.decode.CompactDecoder``, the same forward pass in a few fused tensor ops;
- the vLLM backend submits all prompts x n samples of a cell at once to one engine per checkpoint;
- pass@1 is the mean over ALL problems and samples; pass@k is the unbiased estimator for every k;
- finished cells are stored and never re-sampled; a cell's key holds everything that changes its samples
  (checkpoint files, n, temperature, top-p, max length, template, backend, dtype, seed), so results made
  under other settings are never mixed in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from sage.config import ConfigError
from sage.data.verifiers import row_verifier
from sage.eval.cells import (
    RESULTS_FILE,
    CellKey,
    cell_dir,
    load_cell,
    store_cell,
    write_results,
)
from sage.eval.checkpoint import Checkpoint
from sage.eval.sampling import (
    Sampler,
    SamplingSettings,
    check_backend,
    open_sampler,
    template_fingerprint,
    tokenize_prompts,
)
from sage.grading import GradingPool
from sage.metrics import pass_at_k_curve_over_seeds, pass_at_k_over_seeds
from sage.paths import folder_lock

log = logging.getLogger(__name__)


def evaluate_dataset(
    sampler: Sampler,
    tokenizer,
    rows: list[dict],
    key: CellKey,
    *,
    cell: Path,
    pool: GradingPool,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Sample, grade and store one (checkpoint, dataset, seed) cell. Returns {correct, completions}.
    ``progress(m)`` is told of every m completions sampled."""
    s = key.settings
    t0 = time.perf_counter()
    samples = sampler.sample(tokenize_prompts(tokenizer, rows, s.chat), s, progress=progress)
    t_sample = time.perf_counter() - t0
    flat = [c for per_row in samples.completions for c in per_row]
    golds = [r["answer"] for r in rows for _ in range(s.n_samples)]
    verifiers = [v for r in rows for v in [row_verifier(r)] * s.n_samples]
    correct = np.asarray(pool.grade_many(flat, golds, verifiers), dtype=bool).reshape(len(rows), s.n_samples)
    log.info(
        "%s: %d completions, %d tokens in %.1fs (%.0f tok/s), graded in %.1fs",
        cell.parent.name,
        len(flat),
        samples.n_tokens,
        t_sample,
        samples.n_tokens / max(t_sample, 1e-9),
        time.perf_counter() - t0 - t_sample,
    )
    store_cell(cell, key, [r["id"] for r in rows], correct, samples.completions)
    return {"correct": correct, "completions": samples.completions}


def load_eval_rows(datasets_cfg, limit: int | None) -> dict[str, list[dict]]:
    """Every eval dataset's rows, loaded up front so that a bad file or an unknown verifier fails before any
    sampling."""
    from sage.config import instantiate_node

    rows = {}
    for name, node in datasets_cfg.items():
        loaded = instantiate_node(node)
        rows[name] = loaded[:limit] if limit is not None else loaded
        if not rows[name]:
            raise ConfigError(f"eval.datasets.{name}: {node.get('_target_')} gave no rows to evaluate on")
        for row in rows[name]:
            try:
                row_verifier(row)
            except ValueError as error:
                raise ConfigError(f"eval.datasets.{name}: {error}") from None
    return rows


def evaluate_model(
    model_path: str,
    rows_by_dataset: dict[str, list[dict]],
    eval_cfg,
    *,
    chat: bool,
    max_new_tokens: int,
    results_dir: Path,
    dtype: str,
    pool: GradingPool | None = None,
) -> dict[str, dict]:
    """Evaluate one checkpoint (a model folder, or a LoRA adapter folder) on every dataset and seed.

    Cells already in ``results_dir`` under the same settings are loaded, not re-sampled; the model and the
    grading pool (unless the caller passes its own ``pool``, as a training run does) are only started if
    some cell is missing. Writes ``results_dir/results.json`` and returns, per dataset,
    {"summary": {pass@k: mean, pass@k_std: std}, "curve": full_curve, "correct": [matrix per seed],
    "completions": [...], "settings": {...}}.
    """
    from transformers import AutoTokenizer

    check_backend(eval_cfg)
    checkpoint = Checkpoint.resolve(model_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    identity = {
        "template": template_fingerprint(tokenizer, chat),
        "backend": str(eval_cfg.backend),
        "dtype": dtype,
        "model": checkpoint.fingerprint(),
    }
    sampling = {
        "n_samples": eval_cfg.n_samples,
        "temperature": float(eval_cfg.temperature),
        "top_p": float(eval_cfg.top_p),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
    }
    results: dict[str, dict] = {}
    sampler: Sampler | None = None
    with contextlib.ExitStack() as stack:
        for name, rows in rows_by_dataset.items():
            ids = [r["id"] for r in rows]
            per_seed = []
            # One bar per dataset, in completions over all its seeds: a long cell shows its progress as it
            # samples, a reused cell counts as done at once.
            total = len(eval_cfg.seeds) * len(rows) * eval_cfg.n_samples
            with tqdm(total=total, desc=f"eval {name}", unit="completion", dynamic_ncols=True) as bar:
                for seed in eval_cfg.seeds:
                    key = CellKey(SamplingSettings(seed=seed, **sampling), **identity)
                    cell = cell_dir(results_dir / name, key)
                    # a grid's jobs evaluate the shared base-model cells at the same time: the second waits
                    # for the first and reuses its cell instead of sampling it again (and racing it to disk)
                    with folder_lock(cell):
                        done = load_cell(cell, key, ids)
                        if done is not None:
                            log.info("reusing finished evaluation cell %s", cell)
                            per_seed.append(done)
                            bar.update(len(rows) * eval_cfg.n_samples)
                            continue
                        # started only when a cell is missing: a finished run loads nothing
                        if sampler is None:
                            sampler = open_sampler(checkpoint, tokenizer, dtype=dtype, eval_cfg=eval_cfg)
                            # a vLLM engine is shut down before the next is built
                            stack.callback(sampler.close)
                            if pool is None:
                                pool = stack.enter_context(GradingPool(workers=2))
                        cell_result = evaluate_dataset(
                            sampler, tokenizer, rows, key, cell=cell, pool=pool, progress=bar.update
                        )
                        per_seed.append(cell_result)
            correct = [r["correct"] for r in per_seed]
            results[name] = {
                "summary": pass_at_k_over_seeds(correct, list(eval_cfg.ks)),
                "curve": pass_at_k_curve_over_seeds(correct),
                "correct": correct,
                "completions": [r["completions"] for r in per_seed],
                "settings": {
                    **sampling,
                    **identity,
                    "seeds": list(eval_cfg.seeds),
                    "batch_size": eval_cfg.batch_size,
                },
            }
    write_results(results_dir / RESULTS_FILE, model_path, results)
    return results


def format_table(rows: dict[str, dict[str, dict[str, float]]], ks: list[int]) -> str:
    """Markdown table: one line per (model, dataset), pass@k (mean ± std over seeds)."""
    head = "| model | dataset | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ks))]
    for model_name, by_ds in rows.items():
        for ds, s in by_ds.items():
            cells = [f"{s[f'pass@{k}']:.3f} ± {s[f'pass@{k}_std']:.3f}" for k in ks]
            lines.append(f"| {model_name} | {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
