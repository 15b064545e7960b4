"""Sampling-based evaluation: a correctness matrix (problems x samples) per (checkpoint, dataset, seed), and
the unbiased pass@k curve (k = 1..n) from it. ``sage-train``'s end-of-run evaluation and ``sage-eval`` both
call :func:`evaluate_model`, so they give the same numbers for the same checkpoint and seed; the periodic
evaluation during training samples and grades through :func:`sample_share` too.

Departures from the authors' evaluator:
- the HF backend runs its own decode loop over (prompt, sample) pairs batched across problems: each
  distinct prompt is prefilled once and its KV cache copied to its samples, and finished sequences leave
  the batch, so no compute goes to a prompt's duplicates or to padding after eos (``generate`` with
  num_return_sequences computes every sequence until the longest one of the call stops); Llama-family
  models run through ``sage.eval.decode.CompactDecoder``, the same forward pass in a few fused tensor ops;
- the vLLM backend submits each block's prompts x n samples at once to one engine per checkpoint;
- a cell's problems are cut into fixed blocks of about ``BLOCK_SEQUENCES`` sequences, each sampled from a
  seed of its own (cell seed, block index). In a multi-process run (torchrun, SLURM tasks) every process
  samples and grades the blocks b with b % processes == its rank, and the main process merges them: the
  cell's samples do not depend on how many processes drew them;
- pass@1 is the mean over ALL problems and samples; pass@k is the unbiased estimator for every k;
- finished cells are stored and never re-sampled; a cell's key holds everything that changes its samples
  (checkpoint files, n, temperature, top-p, max length, template, backend, dtype, seed, blocks), so results
  made under other settings are never mixed in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from sage import distributed
from sage.config import ConfigError, check_backend
from sage.data.verifiers import row_verifier
from sage.durable import MainDecision, folder_lock
from sage.eval.cells import (
    BLOCK_SEQUENCES,
    RESULTS_FILE,
    CellKey,
    cell_dir,
    load_cell,
    rows_digest,
    store_cell,
    write_results,
)
from sage.eval.checkpoint import Checkpoint
from sage.eval.sampling import (
    Sampler,
    SamplingSettings,
    open_sampler,
    template_fingerprint,
    tokenize_prompts,
)
from sage.grading import GradingPool
from sage.metrics import pass_at_k_curve_over_seeds, pass_at_k_over_seeds
from sage.progress import Progress

log = logging.getLogger(__name__)


def problem_blocks(n_problems: int, n_samples: int) -> list[range]:
    """A cell's problems in consecutive blocks of about BLOCK_SEQUENCES sequences (problems x samples), of
    sizes that differ by at most one problem, so that the processes' shares are even. A function of the
    cell's problems and n alone, never of the number of processes."""
    count = min(n_problems, max(1, math.ceil(n_problems * n_samples / BLOCK_SEQUENCES)))
    return [range(b * n_problems // count, (b + 1) * n_problems // count) for b in range(count)]


def block_seed(seed: int, block: int) -> int:
    """The seed block ``block`` of a cell of seed ``seed`` is sampled from: the blocks' random streams are
    independent of each other, whichever process draws them and in whatever order."""
    return int(np.random.SeedSequence([seed, block]).generate_state(1)[0])


def _process() -> tuple[int, int]:
    """(rank, processes) of the sharding: one process unless a process group is up."""
    if distributed.initialized():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def my_blocks(n_blocks: int) -> list[int]:
    """The blocks of a cell this process samples: b % processes == rank."""
    rank, processes = _process()
    return list(range(rank, n_blocks, processes))


def share_size(n_problems: int, n_samples: int) -> int:
    """Completions this process samples in a cell of ``n_problems`` x ``n_samples``."""
    blocks = problem_blocks(n_problems, n_samples)
    return sum(len(blocks[b]) for b in my_blocks(len(blocks))) * n_samples


def sample_share(
    sampler: Sampler,
    tokenizer,
    rows: list[dict],
    s: SamplingSettings,
    pool: GradingPool,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """This process's share of one cell (``s.seed`` is the cell's seed): its blocks, sampled and graded.
    Returns {blocks, correct, completions} with one (problems of the block, n) matrix and one list of
    completion lists per block; :func:`merge_shares` puts the processes' shares together."""
    blocks = problem_blocks(len(rows), s.n_samples)
    mine = my_blocks(len(blocks))
    if not mine:  # more processes than blocks
        return {"blocks": [], "correct": [], "completions": []}
    t0 = time.perf_counter()
    samples = sampler.sample_blocks(
        [tokenize_prompts(tokenizer, [rows[i] for i in blocks[b]], s.chat) for b in mine],
        [replace(s, seed=block_seed(s.seed, b)) for b in mine],
        progress=progress,
    )
    t_sample = time.perf_counter() - t0
    mine_rows = [rows[i] for b in mine for i in blocks[b]]
    flat = [c for block in samples for per_row in block.completions for c in per_row]
    # one grading call for the whole share: the pool's workers stay busy across block boundaries
    scores = pool.grade_many(
        flat,
        [r["answer"] for r in mine_rows for _ in range(s.n_samples)],
        [v for r in mine_rows for v in [row_verifier(r)] * s.n_samples],
    )
    correct = np.asarray(scores, dtype=bool).reshape(len(mine_rows), s.n_samples)
    n_tokens = sum(block.n_tokens for block in samples)
    rank, processes = _process()
    log.info(
        "process %d of %d: %d of %d blocks, %d completions, %d tokens in %.1fs (%.0f tok/s), graded in %.1fs",
        rank,
        processes,
        len(mine),
        len(blocks),
        len(flat),
        n_tokens,
        t_sample,
        n_tokens / max(t_sample, 1e-9),
        time.perf_counter() - t0 - t_sample,
    )
    starts = np.cumsum([0] + [len(blocks[b]) for b in mine])
    return {
        "blocks": mine,
        "correct": [correct[a:z] for a, z in zip(starts[:-1], starts[1:], strict=True)],
        "completions": [block.completions for block in samples],
    }


def merge_shares(shares: list[dict], n_problems: int, n_samples: int) -> tuple[np.ndarray, list[list[str]]]:
    """The cell's (problems, n) correctness matrix and completions from every process's share."""
    by_block = {
        b: (correct, completions)
        for share in shares
        for b, correct, completions in zip(
            share["blocks"], share["correct"], share["completions"], strict=True
        )
    }
    n_blocks = len(problem_blocks(n_problems, n_samples))
    if sorted(by_block) != list(range(n_blocks)):
        raise RuntimeError(f"the processes' shares hold blocks {sorted(by_block)}, not 0..{n_blocks - 1}")
    ordered = [by_block[b] for b in range(n_blocks)]
    correct = np.concatenate([c for c, _ in ordered]).reshape(n_problems, n_samples)
    return correct, [per_row for _, completions in ordered for per_row in completions]


def sample_cell(
    sampler: Sampler | None,
    tokenizer,
    rows: list[dict],
    s: SamplingSettings,
    pool: GradingPool | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, list[list[str]]] | None:
    """One cell sampled by every process of the run, each its share (a process with no block of this cell
    may pass no sampler or pool); on the main process the merged (correctness, completions), on the others
    None. Every process of the run calls it."""
    share = (
        sample_share(sampler, tokenizer, rows, s, pool, progress)
        if sampler is not None
        else {"blocks": [], "correct": [], "completions": []}
    )
    shares = distributed.gather(share)
    if shares is None:
        return None
    return merge_shares(shares, len(rows), s.n_samples)


@contextlib.contextmanager
def claim_cell(cell: Path, key: CellKey, ids: list[str]) -> Iterator[dict | None]:
    """The finished cell if it exists (on the main process its contents; on the others {}), else None:
    this run samples it now, as the only one (the main process holds the cell's lock until the body ends).

    A grid's jobs evaluate the shared base-model cells at the same time: the second waits for the first
    and reuses its cell instead of sampling it again (and racing it to disk). In a multi-process run only
    the main process takes the lock, so only it waits on another job's sampling, and on the lock file; it
    then writes its decision to a file named by the run's token, and the other processes wait for that
    file on the file system. None of them waits inside a collective for another job's work, which could
    outlast the group's timeout (``trl.ddp_timeout``) and kill the run."""
    if not distributed.initialized():
        with folder_lock(cell):
            yield load_cell(cell, key, ids)
        return
    decision = MainDecision(cell, f"evaluation cell {cell}")
    if distributed.is_main():
        with decision.telling_failures(), folder_lock(cell):
            done = load_cell(cell, key, ids)
            decision.tell({"done": done is not None})
            yield done
    else:
        yield {} if decision.hear()["done"] else None
    decision.close()


def load_eval_rows(datasets_cfg, limit: int | None) -> dict[str, list[dict]]:
    """Every eval dataset's rows, loaded up front so that a bad file or an unknown verifier fails before any
    sampling."""
    from sage.targets import instantiate_node

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


def context_length(checkpoint: Checkpoint) -> int | None:
    """The positions the model reads (its config's ``max_position_embeddings``, or the older names of it);
    None where its config says none."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint.base)
    except (OSError, ValueError):
        return None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompt_lengths(
    checkpoint: Checkpoint, tokenizer, rows_by_dataset: dict[str, list[dict]], chat: bool, max_new_tokens: int
) -> None:
    """Every prompt and its ``max_new_tokens`` fit the model's context, checked before any sampling: a
    longer one is one line naming its file and row, where the sampler would have tried to allocate its
    (prompt x prompt) attention mask (a 1 MB problem: 250 GB) or run past the positions it was trained on."""
    context = context_length(checkpoint)
    if context is None:
        return
    room = context - max_new_tokens
    if room < 1:
        raise ConfigError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context of "
            f"{context} positions ({checkpoint.base}: max_position_embeddings); lower eval.max_new_tokens"
        )
    for name, rows in rows_by_dataset.items():
        for i, (row, ids) in enumerate(zip(rows, tokenize_prompts(tokenizer, rows, chat), strict=True)):
            if len(ids) > room:
                where = getattr(row, "where", "") or f"row {i + 1} (id {row['id']!r})"
                raise ConfigError(
                    f"eval.datasets.{name}: {where}: its prompt is {len(ids)} tokens; with max_new_tokens="
                    f"{max_new_tokens} the model's context of {context} positions ({checkpoint.base}: "
                    f"max_position_embeddings) holds a prompt of at most {room}; shorten or drop that problem"
                )


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
) -> dict[str, dict] | None:
    """Evaluate one checkpoint (a model folder, or a LoRA adapter folder) on every dataset and seed.

    Cells already in ``results_dir`` under the same settings are loaded, not re-sampled; the model and the
    grading pool (unless the caller passes its own ``pool``, as a training run does) are only started if
    some cell is missing. Writes ``results_dir/results.json`` and returns, per dataset,
    {"summary": {pass@k: mean, pass@k_std: std}, "curve": full_curve, "correct": [matrix per seed],
    "completions": [...], "settings": {...}}.

    In a multi-process run every process calls it with the same arguments and samples its share of each
    missing cell; the main process merges the shares, writes the cells and ``results.json`` and returns
    the results, the others return None.
    """
    from transformers import AutoTokenizer

    check_backend(eval_cfg, dtype)
    checkpoint = Checkpoint.resolve(model_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    check_prompt_lengths(checkpoint, tokenizer, rows_by_dataset, chat, max_new_tokens)
    main = distributed.is_main()
    identity = {
        "template": template_fingerprint(tokenizer, chat),
        "backend": str(eval_cfg.backend),
        "dtype": dtype,
        # hashing a large checkpoint's files once, not once per process; every process keys alike
        "model": distributed.broadcast(checkpoint.fingerprint() if main else None),
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
            digest = rows_digest(rows)  # rows rewritten under the same ids are other cells
            share = share_size(len(rows), eval_cfg.n_samples)
            per_seed = []
            # One bar per dataset, in this process's completions over all its seeds: a long cell shows its
            # progress as it samples, a reused cell counts as done at once. The main process's bar alone,
            # and its log lines with the time left (a grid job's log has no bar), each when a sampler's
            # report (per block at least) comes 30 s or more after the last line.
            total = len(eval_cfg.seeds) * share
            lines = Progress(f"eval {name}", total, log, "completions")
            with tqdm(
                total=total, desc=f"eval {name}", unit="completion", dynamic_ncols=True, disable=not main
            ) as bar:

                def progress(n: int, bar=bar, lines=lines) -> None:
                    bar.update(n)
                    if main:
                        lines.update(n)

                for seed in eval_cfg.seeds:
                    key = CellKey(SamplingSettings(seed=seed, **sampling), **identity, rows=digest)
                    cell = cell_dir(results_dir / name, key)
                    with claim_cell(cell, key, ids) as done:
                        if done is not None:
                            if main:
                                log.info("reusing finished evaluation cell %s", cell)
                                per_seed.append(done)
                            bar.update(share)
                            lines.total -= share  # the time left is the sampling's: a reused cell takes none
                            continue
                        # started only when a cell is missing and this process has blocks of it: a finished
                        # run loads nothing
                        if sampler is None and share:
                            sampler = open_sampler(checkpoint, tokenizer, dtype=dtype, eval_cfg=eval_cfg)
                            # a vLLM engine is shut down before the next is built
                            stack.callback(sampler.close)
                            if pool is None:
                                pool = stack.enter_context(GradingPool(workers=2))
                        merged = sample_cell(
                            sampler if share else None, tokenizer, rows, key.settings, pool, progress
                        )
                        if merged is not None:
                            correct, completions = merged
                            store_cell(cell, key, ids, correct, completions)
                            per_seed.append({"correct": correct, "completions": completions})
            if not main:
                continue
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
    if not main:
        return None
    write_results(results_dir / RESULTS_FILE, model_path, results)
    return results


def format_table(rows: dict[str, dict[str, dict[str, float]]], ks: list[int], seeds: int) -> str:
    """Markdown table: one line per (model, dataset), pass@k: mean ± std over the ``seeds`` evaluation
    seeds, the mean alone with one seed (its std is not zero, it is unknown)."""
    head = "| model | dataset | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ks))]
    for model_name, by_ds in rows.items():
        for ds, s in by_ds.items():
            cells = [
                f"{s[f'pass@{k}']:.3f}" + (f" ± {s[f'pass@{k}_std']:.3f}" if seeds > 1 else "") for k in ks
            ]
            lines.append(f"| {model_name} | {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
