"""The memory plan's evaluation phase: whether the end-of-run evaluation engine (``eval.backend=vllm``) can
start on each GPU once training is over, and what its share then holds.

After RL, sage-train releases the policy, its optimiser and the training rollouts' engine
(``sage.train.main.release_training_engine`` and ``release_training_memory``), and every process then builds
an evaluation engine of its own on its own GPU (``sage.eval.sampling.VllmSampler``). vLLM's worker refuses
to start unless the GPU's free memory, measured after the worker has created its own CUDA context, is at
least ``eval.vllm_gpu_memory_utilization`` x the GPU's memory (``vllm.v1.worker.utils.request_memory``); and
it refuses when its share, less the weights it loads, cannot hold the KV cache of one sequence of the
model's context length (``max_model_len``, which sage leaves at the model's; the stored architectures do not
carry it, so the plan's floor is one sequence of the longest prompt and completion). What is
still in use on the GPU when it starts is therefore what decides: the CUDA contexts and NCCL's buffers,
which no release frees. The values below are stated upper bounds, not measurements (no GPU has been lent to
this project); a first run on the cluster can check them against ``nvidia-smi`` as the evaluation starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sage.train.architecture import DTYPE_BYTES, GIB, Architecture

# One CUDA context of a torch process (its kernels, cuBLAS's and cuDNN's handles and workspaces): about
# 0.3-0.6 GiB on A100/H100 under CUDA's lazy module loading, which torch enables by default; 1 GiB bounds it
# for a context that loads more kernels. Counted twice: the training process keeps its own until it exits,
# and the engine's worker creates one before it measures the free memory it checks its share against.
CUDA_CONTEXT_GIB = 1.0
# One NCCL communicator's buffers on each GPU, which the training process keeps while its process group
# lives (the DDP gradient all-reduce of a run of more than one process): NCCL_BUFFSIZE's 4 MiB per protocol
# buffer (and LL128's about as much), for each peer connection of each of up to 32 channels, plus NVLink
# SHARP's buffers on NVSwitch nodes (H100/H200); one communicator's all-reduce has been reported at
# 0.5-1.6 GiB (NVIDIA/nccl issues 864 and 964), so 2 GiB bounds it. None on one process (no collective).
NCCL_GIB = 2.0
# every projection vLLM can serve a LoRA adapter on: its LoRA buffers are allocated for each of them at the
# served rank, whichever modules the adapter targets
SERVED_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARE_KEY = "eval.vllm_gpu_memory_utilization"


@dataclass(frozen=True)
class EvalEngine:
    """The evaluation engine of one GPU, as its config asks for it."""

    share: float  # eval.vllm_gpu_memory_utilization: the fraction of the GPU the engine takes
    dtype: str  # the weights' and KV cache's
    lora_rank: int | None  # vLLM's max_lora_rank serving the trained adapter; None: no adapter served
    prompt_tokens: int
    completion_tokens: int  # eval.max_new_tokens, else model.max_completion_length
    samples: int  # eval.n_samples: one problem's completions, one request to the engine
    tensor_parallel: int = 1  # eval.vllm_tensor_parallel_size: GPUs one engine spans

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def left_after_training(processes: int, tensor_parallel: int = 1) -> dict[str, float]:
    """GiB in use on a GPU when its evaluation engine starts, term by term: the training process's CUDA
    context, its NCCL communicator's buffers (more than one process), the engine worker's CUDA context and,
    for an engine over several GPUs, its own NCCL communicator."""
    return {
        "cuda_context": CUDA_CONTEXT_GIB,
        "nccl": NCCL_GIB if processes > 1 else 0.0,
        "engine_context": CUDA_CONTEXT_GIB,
        "engine_nccl": NCCL_GIB if tensor_parallel > 1 else 0.0,
    }


def evaluation_estimate(arch: Architecture, engine: EvalEngine, *, processes: int, gpu_gib: float) -> dict:
    """The evaluation phase on one GPU: what training leaves in use (``left``, its terms), the engine's share
    and what the share holds: the weights at the engine's dtype, the served adapter's LoRA buffers, and in
    the rest a KV cache of ``tokens`` tokens, ``sequences`` of the longest length at once. Over
    ``tensor_parallel`` GPUs the weights are split and the KV heads too (replicated past their count). vLLM's
    own working memory (its profiling run's activations, CUDA graphs, the sampler's logits) also comes out of
    the share and is not counted, as for the training engine."""
    w = DTYPE_BYTES[engine.dtype]
    tp = engine.tensor_parallel
    left = left_after_training(processes, tp)
    share = math.ceil(engine.share * gpu_gib * GIB)  # bytes, as vLLM rounds its request
    weights = arch.parameters() * w // tp
    adapter = 0
    if engine.lora_rank is not None:
        adapter = arch.lora_parameters(engine.lora_rank, SERVED_PROJECTIONS) * w // tp
    per_token = arch.kv_bytes_per_token(w) // min(tp, arch.num_key_value_heads)
    kv = max(share - weights - adapter, 0)
    tokens = kv // per_token
    in_use = sum(left.values())
    return {
        "left": left,
        "in_use": in_use,
        "share": share / GIB,
        "weights": weights / GIB,
        "adapter": adapter / GIB,
        "kv": kv / GIB,
        "kv_per_token": per_token / GIB,
        "tokens": tokens,
        "sequences": tokens // engine.sequence_tokens,
        "total": in_use + share / GIB,
        "gpu": gpu_gib,
    }


def engine_starts(parts: dict) -> bool:
    """vLLM's two refusals at start: its share is not free beside what training left, or the share less the
    weights cannot hold the KV cache of one sequence."""
    return parts["total"] <= parts["gpu"] and parts["sequences"] >= 1


def largest_share(parts: dict) -> float:
    """The largest ``eval.vllm_gpu_memory_utilization`` (a multiple of 0.01) free beside what training
    left."""
    return math.floor((parts["gpu"] - parts["in_use"]) / parts["gpu"] * 100 + 1e-9) / 100


def smallest_share(parts: dict, engine: EvalEngine, sequences: int) -> float:
    """The smallest ``eval.vllm_gpu_memory_utilization`` (a multiple of 0.01) whose share holds the weights,
    the adapter and ``sequences`` sequences of the longest length."""
    need = parts["weights"] + parts["adapter"] + sequences * engine.sequence_tokens * parts["kv_per_token"]
    return math.ceil(need / parts["gpu"] * 100 - 1e-9) / 100


def describe_evaluation(parts: dict, engine: EvalEngine) -> list[str]:
    """Two lines: the phase's sum with its verdict, then what the share holds (the engine starts) or, when it
    cannot start, why, with the value of ``eval.vllm_gpu_memory_utilization`` that would let it."""
    starts = engine_starts(parts)
    left = ", ".join(f"{k} {v:.1f}" for k, v in parts["left"].items() if v or k != "engine_nccl")
    lines = [
        f"memory estimate per GPU at evaluation: {parts['total']:.1f} GiB of {parts['gpu']:.1f} GiB, "
        f"{'the engine starts' if starts else 'DOES NOT START'} (left in use after training releases the "
        f"policy, its optimiser and its engine: {left}; eval_vllm {parts['share']:.1f})"
    ]
    asked = f"{SHARE_KEY}={engine.share:g}"
    longest = f"{engine.prompt_tokens} prompt + {engine.completion_tokens} completion"
    low, high = smallest_share(parts, engine, 1), largest_share(parts)
    if starts:
        holds = (
            f"each problem's {engine.samples} samples fit at once"
            if parts["sequences"] >= engine.samples
            else (
                f"fewer than each problem's {engine.samples} samples at once: slower, not an error "
                f"({SHARE_KEY}={smallest_share(parts, engine, engine.samples):.2f} holds them)"
            )
        )
        lines.append(
            f"eval vllm: {asked} gives {parts['share']:.1f} GiB = weights {parts['weights']:.1f} + adapter "
            f"{parts['adapter']:.1f} + KV cache {parts['kv']:.1f} ({parts['tokens']:,} tokens: "
            f"{parts['sequences']} sequences of the longest length ({longest}) at once; {holds})"
        )
        return lines
    if low > high:
        fix = (
            f"no {SHARE_KEY} holds it beside what training leaves on a {parts['gpu']:.0f} GiB GPU: "
            "evaluate apart (eval.at_end=false, then sage-eval on the run's final/)"
        )
    elif parts["total"] > parts["gpu"]:
        fix = f"set {SHARE_KEY} to at most {high:.2f}"
    else:
        fix = f"set {SHARE_KEY} to at least {low:.2f}"
    if parts["total"] > parts["gpu"]:
        why = (
            f"{asked} asks {parts['share']:.1f} GiB of the GPU's {parts['gpu']:.1f} GiB, and "
            f"{parts['in_use']:.1f} GiB stay in use after training"
        )
    else:
        why = (
            f"{asked} gives {parts['share']:.1f} GiB, which cannot hold its {parts['weights']:.1f} GiB of "
            f"weights, {parts['adapter']:.1f} of adapter and the KV cache of one sequence of the longest "
            f"length ({longest})"
        )
    lines.append(f"evaluation: the engine cannot start: {why}: {fix}")
    return lines


def eval_engine(cfg, prompt_tokens: int) -> tuple[EvalEngine | None, str]:
    """(the end-of-run evaluation engine a composed sage-train config builds on each GPU, "") or (None, why
    there is none to plan). Its dtype is the one it serves in on the cluster: ``model.engine_dtype``, whose
    ``auto`` is bfloat16 on the GPUs a plan is for (as ``sage.train.memory.engine_room_dtype`` sizes the
    training engine); the trained model's adapter, under LoRA, is served at vLLM's rank for it."""
    from sage.vllm_engine import served_rank

    e = cfg.eval
    if not e.at_end:
        return None, "no evaluation engine (eval.at_end=false)"
    backend = str(getattr(e.backend, "value", e.backend))
    if backend != "vllm":
        return None, (
            f"not estimated (eval.backend={backend}: the training process loads the model again and "
            "samples eval.batch_size sequences at a time)"
        )
    engine = str(getattr(cfg.model.engine_dtype, "value", cfg.model.engine_dtype))
    trained_adapter = cfg.model.lora is not None and cfg.trl.max_steps != 0
    return (
        EvalEngine(
            share=float(e.vllm_gpu_memory_utilization),
            dtype="bfloat16" if engine == "auto" else engine,
            lora_rank=served_rank(int(cfg.model.lora.r)) if trained_adapter else None,
            prompt_tokens=prompt_tokens,
            completion_tokens=int(e.max_new_tokens or cfg.model.max_completion_length),
            samples=int(e.n_samples),
            tensor_parallel=int(e.vllm_tensor_parallel_size),
        ),
        "",
    )
