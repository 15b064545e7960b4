"""``make bench`` (``python -m benchmarks.bench [--only <section>,...]`` from a clone's root, sections
below): speed and memory figures, printed as ``name: value`` lines. A development tool, not part of the
installed package: it times sage's internals (and wraps some of the trainer's methods to do so). Every
comparison is measured side by side in one run (medians over repeats where timing is noisy), since other
jobs share the machine's cores.

- eval: sampled tokens/s of our evaluator's sampler vs the authors' approach (one ``generate`` call per
  problem with num_return_sequences=n), same testbed model, problems, n and max length; and the time the
  evaluator's grading pool takes on those completions relative to sampling them (grading must not be the
  bottleneck);
- attention: the compact decoder's sampling speed with its C++ attention kernel, with eager torch ops and
  with the torch-ops step under ``torch.compile`` (the kernel stays only while neither comes within 10%);
- overhead: median TRL step time of ``guide=branch`` over ``guide=none`` (same seed), runs interleaved, and
  of ``guide=branch`` with the per-bucket anchor metrics (``tracking.anchor_buckets``) over without them;
- train: median testbed training step time with TRL's own ``generate`` (``rollout=hf``) and with the
  evaluator's compact sampler (``rollout=fast``), same seed, runs interleaved, and their ratio;
- run: wall time and peak RSS (process tree) of the default ``sage-train``, cached and cold base model;
- eval_processes: wall time of one evaluation (``evaluate_model``: sample, grade, merge, store) by 1 process
  and by 2 processes under ``torchrun`` (gloo), launches interleaved, and their ratio. Each process has
  one core to itself (pinned; one torch thread, OMP_NUM_THREADS=1, and one grading worker on that core), as
  each process of a GPU run has its own GPU and its own cores;
- real_rollout: the real 0.5B model's GRPO step (model=qwen2.5-coder-0.5b-instruct, LoRA, 8 MATH-500 prompts
  x 8 completions of at most REAL_TOKENS tokens) with ``rollout=hf`` (transformers' generate inside TRL) and
  ``rollout=vllm`` (the adapter served by vLLM's CPU build), each step split into the rollout and the rest,
  with the engine's CPU seconds per wall second while it decodes, and the loss passes' forward and backward
  with the trainer in bfloat16 (as trl=paper trains) against this machine's bfloat16 matrix-product limit;
- engine: the real 0.5B model's evaluation through vLLM in the dtype its engines serve in here
  (``model.engine_dtype=auto``), eager and compiled (``eval.vllm_compile``), as FLOP/s of the tokens it
  computes, beside the matrix-product limit this process measures in that dtype, and their ratio;
- vllm_seeding: seconds per block (30 prompts x 8 samples, ChatML prompts long enough that prefills are
  chunked) of the vLLM CPU build with seeds per request (chunked prefill off: on, it stops with "CPU
  Generator does not use offset") and with the engine seeded per block (``VllmSampler``), interleaved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.real_model import REAL_STEPS, REAL_TOKENS, _real_backend, bench_engine, bench_real_rollout
from benchmarks.sampler import bench_attention, bench_eval, bench_vllm_seeding
from benchmarks.testbed import (
    SHARD_PROBLEMS,
    _eval_processes_worker,
    bench_eval_processes,
    bench_overhead,
    bench_run,
    bench_train,
)

BENCHES = {
    "eval": bench_eval,
    "attention": bench_attention,
    "overhead": bench_overhead,
    "train": bench_train,
    "run": bench_run,
    "eval_processes": bench_eval_processes,
    "vllm_seeding": bench_vllm_seeding,
    "real_rollout": bench_real_rollout,
    "engine": bench_engine,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(BENCHES), help=f"comma-separated subset of {list(BENCHES)}"
    )
    parser.add_argument("--eval-processes-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--problems", type=int, default=SHARD_PROBLEMS, help=argparse.SUPPRESS)
    parser.add_argument("--real-backend", choices=("hf", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--real-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--real-steps", type=int, default=REAL_STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--real-tokens", type=int, default=REAL_TOKENS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real_backend is not None:  # one backend of bench_real_rollout, in a process of its own
        times = _real_backend(args.real_backend, args.real_steps, args.real_tokens)
        args.real_out.write_text(json.dumps(times))
        return
    if args.eval_processes_worker is not None:  # one process of bench_eval_processes' launches
        _eval_processes_worker(args.eval_processes_worker, args.problems)
        return
    chosen = args.only.split(",")
    unknown = [c for c in chosen if c not in BENCHES]
    if unknown:
        parser.error(f"--only: unknown bench {unknown}; choose from {list(BENCHES)}")
    for name in chosen:
        for key, value in BENCHES[name]().items():
            print(f"{key}: {value}", flush=True)


if __name__ == "__main__":
    main()
