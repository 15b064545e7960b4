"""The first hour on a GPU cluster: before a grid, one short run of the real recipe on one node, read back.

    python -m launchers.first_hour [--processes N] [--plan-only] [sage-train overrides ...]
    make first-hour PROCESSES=8 \
        ARGS="model=qwen2.5-math-7b trl=paper data=dapo_math_17k trl.gradient_accumulation_steps=8"

It prints the plan of the run (``python -m sage.train.plan``: batch and per-device memory) and its expected
wall time (an estimate from the throughputs stated below, not a measurement), then runs ``sage-train`` under
``torchrun`` with ``rollout=vllm`` for 2 optimiser steps and a tiny evaluation, and then reads the run's own
lines back into a summary:

- per process, its peak memory (the GPU allocator's peak on CUDA, the process's RSS on a CPU) against the
  plan's per-device total;
- per step and process, the time of the rollout, of the adapter hand-over and of the rest of the step
  (scoring, log-prob passes, backward, optimiser);
- whether every process evaluated its own blocks of every evaluation cell after the engines (a run whose
  process group an engine tore down has every process evaluate everything, alone).

It exits 1 when a process's peak exceeds the plan or a process evaluated other than its share; with
``--plan-only`` it prints the plan, the expected wall time and the command, and runs nothing.

What it shrinks, whatever the model: the RL stage to 2 steps; the evaluation to one seed, 8 new tokens and
just enough problems x samples that every cell has a block per process (32 samples x 33 problems on 2
processes; 256 x 29 on 8, since the paper suite's smallest set has 40 problems); a model's SFT stage to one
epoch of at most ``SFT_ROWS`` rows (``model.sft.data.n`` where the SFT data takes a size, else
``model.sft.args.max_steps``). A key the command line names is the user's: it is never added a second time.
The default (no overrides) is the paper path at 1M parameters on this CPU (``model=tiny_chat``, 2 processes):
the command CI runs.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass

TINY = [
    "model=tiny_chat",
    "model.sft.data.n=32",
    "model.sft.args.num_train_epochs=1",
    "trl.per_device_train_batch_size=4",
    "trl.num_generations=4",
    "eval.vllm_cpu_memory_utilization=0.1",
]
# what makes the run short whatever the model: 2 steps, a tiny evaluation that still has 2 blocks per cell
# (so that each of 2 processes has one; `evaluation_size` gives more processes theirs), short completions
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
# The SFT stage's rows at most: enough for its loss to move and for its merge and hand-over to the RL stage
# to run, while Table 7's batch of one row (trained by one process while the others wait) stays short.
SFT_ROWS = 256
# eval.n_samples tried for more processes, fewest first: powers of two up to a block's sequences
SAMPLES = (32, 64, 128, 256, 512, 1024)

# ---- the command ----------------------------------------------------------------------------------------


def key_of(override: str) -> str:
    """The key an override sets (``+a.b=1``, ``++a.b=1``, ``~a.b``: ``a.b``)."""
    return override.lstrip("~+").split("=", 1)[0]


def merged(given: list[str], defaults: list[str]) -> list[str]:
    """``given``, then each of ``defaults`` whose key ``given`` does not name: a key is on the command line
    once, with the user's value."""
    named = {key_of(o) for o in given}
    return [*given, *(o for o in defaults if key_of(o) not in named)]


def compose(overrides: list[str]):
    """sage-train's config for ``overrides``, composed as sage-train composes it; nothing is run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sage.config import register_configs
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def shrunk_sft(cfg) -> list[str]:
    """What cuts the model's SFT stage to one epoch of at most SFT_ROWS rows; [] without a stage."""
    from sage.train.sft import effective_batch

    sft = cfg.model.get("sft")
    if sft is None:
        return []
    out = []
    if "n" in sft.data:
        if sft.data.n > SFT_ROWS:
            out.append(f"model.sft.data.n={SFT_ROWS}")
    else:  # data that takes no size (a hub dataset, read whole): the trainer stops after SFT_ROWS rows
        out.append(f"model.sft.args.max_steps={max(1, SFT_ROWS // effective_batch(sft.args))}")
    if sft.args.num_train_epochs != 1:
        out.append("model.sft.args.num_train_epochs=1")
    return out


def evaluation_size(
    processes: int, smallest: int | None, samples: int | None = None, limit: int | None = None
) -> tuple[int, int]:
    """(eval.n_samples, eval.limit) that cut every evaluation cell into at least one block per process
    (``sage.eval.evaluate.problem_blocks``: a process without a block logs no share, and the summary could
    not tell it from one that never evaluated): the fewest samples of SAMPLES (the user's ``samples`` if
    given) for which the smallest dataset (``smallest`` problems, None if unknown) holds enough problems,
    and the fewest problems that make the blocks (the user's ``limit`` if given). One process gets what 2
    get."""
    from sage.eval.cells import BLOCK_SEQUENCES

    bounds = [v for v in (smallest, limit) if v is not None]
    for s in (samples,) if samples else SAMPLES:
        # a cell of n problems has min(n, ceil(n x s / BLOCK_SEQUENCES)) blocks: `processes` from n = need on
        need = max(processes, (max(processes, 2) - 1) * BLOCK_SEQUENCES // s + 1)
        if not bounds or min(bounds) >= need:
            break
    return s, need if limit is None else limit


def shrunk_evaluation(cfg, given: set[str], processes: int) -> list[str]:
    """SHORT, its evaluation sized for ``processes`` (``evaluation_size``) from the eval datasets' sizes."""
    from sage.train.completions import count_problems

    problems = count_problems(cfg.eval, {})
    smallest = min(problems.counts.values()) if problems.error is None and problems.counts else None
    samples, limit = evaluation_size(
        processes,
        smallest,
        cfg.eval.n_samples if "eval.n_samples" in given else None,
        cfg.eval.limit if "eval.limit" in given else None,
    )
    sized = {"eval.n_samples": samples, "eval.ks": f"[1,{samples}]", "eval.limit": limit}
    return [f"{key_of(o)}={sized[key_of(o)]}" if key_of(o) in sized else o for o in SHORT]


def first_hour_overrides(given: list[str], processes: int) -> list[str]:
    """sage-train's overrides for the first hour: the user's (TINY without any), then what shrinks the SFT
    stage and SHORT, each only where the user's do not name its key."""
    base = list(given) or TINY
    cfg = compose(base)
    keys = {key_of(o) for o in base}
    return merged(base, shrunk_sft(cfg) + shrunk_evaluation(cfg, keys, processes))


# ---- the expected wall time -----------------------------------------------------------------------------
# An estimate from a simple throughput model, not a measurement: each phase is its fixed costs (a process's
# start, the weights read or written, a vLLM engine's start) plus its tokens at an assumed rate. Training a
# token costs TRAIN_FLOPS_PER_TOKEN x parameters; a decode step reads the weights once for all the sequences
# in flight (up to VLLM_MAX_SEQS), and takes at least the device's least step time. Rollouts and evaluations
# generate up to their length (max_completion_length, eval.max_new_tokens): an upper bound.


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # FLOP/s training reaches
    bandwidth: float  # bytes/s a decode step reads the weights at
    least_step: float  # s: the least time of a decode step, however small the model
    engine_start: float  # s: a vLLM engine's start besides reading the weights
    process_start: float  # s: a process's start (Python, torch, TRL, vLLM imports; the process group)
    disk: float  # bytes/s weights are read and written at


# A hub model (one with a config.json to count): one 80 GB GPU per process, A100/H100 class.
GPU = Device(
    name="an 80 GB GPU (A100/H100 class) per process",
    # a dense bf16 peak between the two, at 30%: one row or completion per forward pass, gradient
    # checkpointing and LoRA's small matrices keep training far from the peak
    flops=400e12 * 0.3,
    # an A100 80 GB's HBM bandwidth, at half: a decode step also reads the KV cache and launches kernels
    bandwidth=2.0e12 * 0.5,
    least_step=0.01,  # a decode step's kernel launches under CUDA graphs
    engine_start=90.0,  # vLLM's memory profiling, torch.compile and CUDA graph capture
    process_start=60.0,
    disk=1.0e9,  # a shared or network filesystem that every process of the node reads at once
)
# A testbed model: this CPU's few cores, shared by the processes. Its costs are overheads, not FLOPs.
CPU = Device(
    name="this machine's CPU cores (a testbed model)",
    flops=2.0e9,  # small matrices on a few shared cores: a small fraction of their peak
    bandwidth=5.0e9,
    least_step=0.05,  # a decode step of vLLM's CPU build is its scheduling and Python, whatever the model
    engine_start=45.0,  # vLLM's CPU build: its worker processes, the KV cache reserved, the model loaded
    process_start=30.0,
    disk=1.0e9,
)
TRAIN_FLOPS_PER_TOKEN = 8  # x parameters: forward 2, backward 4, recomputing checkpointed activations 2
LOGPROB_FLOPS_PER_TOKEN = 4  # x parameters, RL only: the reference's and the old policy's forward passes
SFT_ROW_TOKENS = 0.5  # x model.sft.args.max_length: an SFT row's tokens (rows longer than it are dropped)
VLLM_MAX_SEQS = 256  # sequences a vLLM engine decodes at once (its max_num_seqs default)
TESTBED_PARAMETERS = 1e6  # the testbed models (conf/model/tiny*.yaml), which have no config.json to count


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def expected_wall_time(cfg, processes: int) -> list[str]:
    """Two lines: the expected wall time, phase by phase, and what it assumes (the plan's numbers)."""
    from sage.train.completions import count_problems
    from sage.train.memory import DTYPE_BYTES, architecture, batch_of
    from sage.train.sft import effective_batch, split_batch

    try:
        parameters, device = float(architecture(cfg.model.source)[0].parameters()), GPU
    except ValueError:  # no config.json: a testbed model
        parameters, device = TESTBED_PARAMETERS, CPU
    weights = parameters * DTYPE_BYTES.get(str(cfg.model.dtype), 4)
    read = weights / device.disk
    step = max(device.least_step, weights / device.bandwidth)

    def decode(sequences: int, tokens: int) -> float:
        return math.ceil(sequences / VLLM_MAX_SEQS) * tokens * step

    def train(tokens: float, flops_per_token: int) -> float:
        return tokens * flops_per_token * parameters / device.flops

    how = [
        f"{parameters / 1e9:.2g}B parameters" if parameters >= 1e8 else f"{parameters / 1e6:.2g}M parameters"
    ]
    sft = cfg.model.get("sft")
    sft_s: float | None = 0.0
    if sft is None:
        how.append("no SFT stage")
    else:
        a = sft.args
        batch = effective_batch(a)
        if a.max_steps is not None and a.max_steps > 0:
            rows = a.max_steps * batch
        elif "n" in sft.data:
            rows = math.ceil(sft.data.n * a.num_train_epochs)
        else:
            rows = None
        shared = split_batch(a.per_device_train_batch_size, a.gradient_accumulation_steps, processes)
        trainers = processes if shared is not None else 1
        row_tokens = SFT_ROW_TOKENS * (a.max_length or cfg.model.max_completion_length)
        if rows is None:
            sft_s = None
            how.append("SFT rows unknown (its data takes no size and model.sft.args.max_steps is unset)")
        else:
            alone = device.process_start if trainers < processes else 0.0  # its own process
            sft_s = alone + 2 * read + train(rows * row_tokens / trainers, TRAIN_FLOPS_PER_TOKEN)
            how.append(f"SFT {rows:,} rows x ~{row_tokens:.0f} tokens on {trainers} process(es)")
    b = batch_of(cfg, 0, processes)
    steps, length = int(cfg.trl.max_steps), int(cfg.model.max_completion_length)
    completions = b.micro * b.accumulation  # one process's per optimiser step
    rounds = math.ceil(completions / b.generated_at_once)
    per_step = rounds * decode(b.generated_at_once, length) + train(
        completions * length, TRAIN_FLOPS_PER_TOKEN + LOGPROB_FLOPS_PER_TOKEN
    )
    rl_s = 2 * read + device.engine_start + steps * per_step
    how.append(f"RL {steps} steps x {completions} completions per process x {length} tokens")
    e = cfg.eval
    models = int(bool(e.at_end)) + int(bool(e.at_end) and steps != 0)
    problems = count_problems(e, {})
    new_tokens = int(e.max_new_tokens or length)
    eval_s: float | None = 0.0
    if models and problems.error is not None:
        eval_s = None
        how.append(f"evaluation unknown ({problems.error})")
    elif models:
        shares = [math.ceil(n * e.n_samples / processes) for n in problems.counts.values()] * len(e.seeds)
        eval_s = models * (read + device.engine_start + sum(decode(s, new_tokens) for s in shares))
        how.append(
            f"evaluation {models} model(s) x {len(shares)} cells x ~{max(shares, default=0):,} completions "
            f"per process x {new_tokens} tokens"
        )
    start = device.process_start
    known = [t for t in (start, sft_s, rl_s, eval_s) if t is not None]
    about = "about" if len(known) == 4 else "at least"

    def shown(t: float | None) -> str:
        return "?" if t is None else minutes(t)

    phases = [f"start ~{minutes(start)} min"]
    phases += [f"SFT ~{shown(sft_s)} min"] if sft is not None else []
    phases += [f"{steps} RL steps ~{minutes(rl_s)} min", f"evaluation ~{shown(eval_s)} min"]
    return [
        f"expected wall time: {about} {max(1, round(sum(known) / 60))} min ({', '.join(phases)})",
        f"expected wall time: an estimate, not a measurement, for {device.name}, at the throughputs "
        f"launchers/first_hour.py assumes: {'; '.join(how)}",
    ]


# ---- the run's lines, read back --------------------------------------------------------------------------

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
        [sys.executable, "-m", "sage.train.plan", *overrides, f"processes={processes}"],
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


def sft_build(cfg, overrides: list[str], processes: int) -> tuple[list[str], list[str]] | None:
    """(the words said, the command) that build the run's SFT stage first as a job of its own, as a grid's
    launcher does: on the processes its batch can use, in a folder beside the run's; None without a stage
    or with it in the cache."""
    from sage.train.sft import BUILD_ONLY, cached_stage, stage_processes

    if cfg.model.get("sft") is None or cached_stage(cfg) is not None:
        return None
    n = stage_processes(cfg.model.sft.args, processes)
    own = [o for o in overrides if key_of(o) not in {"resume", *map(key_of, BUILD_ONLY)}]
    own = [f"{o}-sft" if key_of(o) == "output_dir" else o for o in own]
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    command = [sys.executable, *torchrun, "-m", "sage.train.main", *own, *BUILD_ONLY]
    size = f"{n} process(es)" + (f": its batch cannot use {processes}" if n < processes else "")
    said = [
        "the SFT stage first, as a job of its own on",
        f"{size}:",
        "torchrun",
        *torchrun[2:],
        *command[5:],
    ]
    return said, command


def main(argv: list[str] | None = None) -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="processes on this node (one per GPU)")
    parser.add_argument(
        "--plan-only", action="store_true", help="print the plan, the expected wall time and the command only"
    )
    parser.add_argument(
        "overrides", nargs="*", help="sage-train overrides (default: model=tiny_chat, shrunk)"
    )
    args = parser.parse_intermixed_args(argv)
    try:
        overrides = first_hour_overrides(args.overrides, args.processes)
        estimate = expected_wall_time(compose(overrides), args.processes)
    except (HydraException, OmegaConfBaseException) as e:
        sys.exit(f"error: {str(e).strip().splitlines()[0]}")
    text, planned = plan(overrides, args.processes)
    print(text.rstrip())
    print("\n".join(estimate))
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.processes}",
    ]
    if not any(key_of(o) == "output_dir" for o in overrides):
        # a folder of its own each time: a finished run's folder would skip training and its evaluation
        overrides.append(f"output_dir=outputs/first_hour/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    # the grid's job order (sage.train.sft.sft_stages): an SFT stage not in the cache is built first, on
    # the processes its batch can use, and the RL run starts from it
    stage = sft_build(compose(overrides), overrides, args.processes)
    if stage is not None:
        print(f"{'would build' if args.plan_only else 'building'} {' '.join(stage[0])}", flush=True)
    command = " ".join(["torchrun", *torchrun[3:], "-m", "sage.train.main", *overrides])
    print("would run:" if args.plan_only else "running:", command, flush=True)
    if args.plan_only:
        return
    if stage is not None:
        r = subprocess.run(stage[1], capture_output=True, text=True)
        if r.returncode != 0:
            print((r.stdout + r.stderr)[-6000:])
            sys.exit(f"first-hour SFT stage failed (exit {r.returncode}); the RL run did not start")
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
