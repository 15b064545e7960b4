"""The first hour on a GPU cluster: before a grid, one short run of the real recipe on one node, read back.

    python -m launchers.first_hour [--processes N] [sage-train overrides ...]
    make first-hour PROCESSES=8 ARGS="model=qwen2.5-math-7b trl=paper data=dapo_math_17k"   # one 8-GPU node

It prints the plan of the run (``python -m sage.train.memory``: batch and per-device memory), then runs
``sage-train`` under ``torchrun`` with ``rollout=vllm`` for 2 optimiser steps and a tiny evaluation, and then
reads the run's own lines back into a summary:

- per process, its peak memory (the GPU allocator's peak on CUDA, the process's RSS on a CPU) against the
  plan's per-device total;
- per step and process, the time of the rollout, of the adapter hand-over and of the rest of the step
  (scoring, log-prob passes, backward, optimiser);
- whether every process evaluated its own blocks of every evaluation cell after the engines (a run whose
  process group an engine tore down has every process evaluate everything, alone).

It exits 1 when a process's peak exceeds the plan or a process evaluated other than its share. The default
(no overrides) is the paper path at 1M parameters on this CPU (``model=tiny_chat``, 2 processes): the
command CI runs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

TINY = [
    "model=tiny_chat",
    "model.sft.data.n=32",
    "model.sft.args.num_train_epochs=1",
    "trl.per_device_train_batch_size=4",
    "trl.num_generations=4",
    "eval.vllm_cpu_memory_utilization=0.1",
]
# what makes the run short whatever the model: 2 steps, a tiny evaluation that still has 2 blocks per cell
# (so that each of 2 processes has one), short completions
SHORT = [
    "rollout=vllm",
    "trl.max_steps=2",
    "trl.save_strategy=no",
    "eval.n_samples=32",
    "eval.ks=[1,32]",
    "eval.limit=33",
    "eval.seeds=[0]",
    "eval.max_new_tokens=8",
    "eval.perplexity_cap=0",
]
STEP = re.compile(
    r"step (\d+), process (\d+): rollout ([\d.]+)s, adapter hand-over ([\d.]+)s, rest ([\d.]+)s; "
    r"peak memory ([\d.]+) GiB \(([^)]*)\)"
)
SHARE = re.compile(r"process (\d+) of (\d+): (\d+) of (\d+) blocks")
PLAN_TOTAL = re.compile(r"memory estimate per GPU: ([\d.]+) GiB")
PLAN_VLLM = re.compile(r"memory estimate per GPU: .*\bvllm ([\d.]+)\)")


def plan(overrides: list[str], processes: int) -> tuple[str, float | None]:
    """The memory plan's text and its per-device total in GiB for the training process (None if the plan
    estimated none)."""
    r = subprocess.run(
        [sys.executable, "-m", "sage.train.memory", *overrides, f"processes={processes}"],
        capture_output=True,
        text=True,
    )
    text = r.stdout + r.stderr
    found, engine = PLAN_TOTAL.search(text), PLAN_VLLM.search(text)
    if found is None:
        return text, None
    # the engine runs in processes of its own, with vLLM's allocator: the training process's allocator
    # peak is compared with the plan less the engine's share
    return text, float(found.group(1)) - (float(engine.group(1)) if engine else 0.0)


def summary(log: str, processes: int, planned: float | None) -> tuple[list[str], bool]:
    """The lines of the summary, and whether the run is sound (memory within the plan, shares right)."""
    lines, sound = [], True
    steps = [m.groups() for m in STEP.finditer(log)]
    peak: dict[int, tuple[float, str]] = {}
    for step, rank, rollout, handover, rest, memory, what in steps:
        lines.append(
            f"step {step}, process {rank}: rollout {rollout}s, adapter hand-over {handover}s, rest {rest}s"
        )
        peak[int(rank)] = max(peak.get(int(rank), (0.0, what)), (float(memory), what))
    if len(peak) != processes:
        lines.append(f"step lines from {sorted(peak)} of {processes} processes: the run did not train on all")
        sound = False
    for rank, (memory, what) in sorted(peak.items()):
        against = "no plan" if planned is None else f"the plan's {planned:.2f} GiB for training"
        over = planned is not None and what.startswith("cuda") and memory > planned
        sound &= not over
        flag = " EXCEEDED" if over else ""
        lines.append(f"process {rank}: peak {memory:.2f} GiB ({what}) against {against}{flag}")
    shares = [tuple(map(int, m.groups())) for m in SHARE.finditer(log)]
    own = all(world == processes for _, world, _, _ in shares) and len(shares) > 0
    counted = {}
    for rank, _, mine, blocks in shares:
        counted.setdefault(rank, []).append(f"{mine} of {blocks}")
    own &= sorted(counted) == list(range(processes))
    sound &= own
    lines.append(
        f"every process evaluated its own blocks: {'yes' if own else 'NO'} "
        + "; ".join(f"process {r}: {', '.join(v)}" for r, v in sorted(counted.items()))
    )
    return lines, sound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="processes on this node (one per GPU)")
    parser.add_argument(
        "overrides", nargs="*", help="sage-train overrides (default: model=tiny_chat, shrunk)"
    )
    args = parser.parse_args()
    overrides = (args.overrides or TINY) + SHORT
    text, planned = plan(overrides, args.processes)
    print(text.rstrip())
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.processes}",
    ]
    if not any(o.startswith("output_dir=") for o in overrides):
        # a folder of its own each time: a finished run's folder would skip training and its evaluation
        overrides.append(f"output_dir=outputs/first_hour/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    print("running:", " ".join(["torchrun", *torchrun[3:], "-m", "sage.train.main", *overrides]), flush=True)
    r = subprocess.run([*torchrun, "-m", "sage.train.main", *overrides], capture_output=True, text=True)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        print(log[-6000:])
        sys.exit(f"first-hour run failed (exit {r.returncode})")
    lines, sound = summary(log, args.processes, planned)
    print("\n".join(["", "first hour:", *lines]))
    sys.exit(0 if sound else 1)


if __name__ == "__main__":
    main()
