"""The memory estimator: one process's peak GPU memory in training, term by term, from a composed sage-train
config's shapes (its model's architecture, TRL's batch knobs, the rollout engine's share), and what a model's
``config.json`` tells before the model is built. ``python -m sage.train.plan`` prints these estimates for each
job of a run or grid; ``launchers/gpu_check.py`` measures them on a GPU.

The architecture is the model's ``config.json``: read from ``model.source`` when that is a local folder, else
from ``architectures.json`` beside this file, a copy of the published config.json values of the paper's models
(the line printed says which); a testbed model is not estimated.

The estimate is an upper-bound style sum, not a measurement (no GPU is lent to this project): what is
resident (weights, trainable state, the reference, DDP's gradient buckets, vLLM's share under colocation)
plus the working set of one micro-batch (checkpointed layer inputs, one layer's activations when it is
recomputed, the logits of the completion tokens with their gradient). Each term is named so a user can
check it against ``torch.cuda.max_memory_allocated`` on a real run. The evaluation phase's estimate is
``sage.train.evaluation_memory``'s.

The same config.json says whether the output layer is tied to the embeddings, which ``rollout=vllm`` refuses
under full fine-tuning: :func:`check_rollout`, which sage-train and the plan run at composition, reads it
here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sage.train.architecture import DTYPE_BYTES, GIB, Architecture

ARCH_FILE = Path(__file__).with_name("architectures.json")
# bytes of optimiser state per trainable parameter (two moments)
OPTIMISER_BYTES = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_bnb_8bit": 2}
DEFAULT_OPTIMISER_BYTES = 8


@dataclass(frozen=True)
class Batch:
    """TRL's batch knobs, as GRPOConfig resolves them (steps_per_generation defaults to the accumulation)."""

    micro: int  # per_device_train_batch_size: completions per forward pass
    accumulation: int
    processes: int
    num_generations: int
    prompt_tokens: int
    completion_tokens: int
    steps_per_generation: int = 0  # 0: the accumulation (TRL's default)

    @property
    def per_step(self) -> int:
        return self.micro * self.accumulation * self.processes

    @property
    def generated_at_once(self) -> int:
        """Completions one process generates per generation round (TRL sizes vLLM's max_num_seqs so)."""
        return self.micro * (self.steps_per_generation or self.accumulation)

    def describe(self) -> str:
        longest = self.prompt_tokens + self.completion_tokens
        return (
            f"batch: {self.micro} completions per forward pass x {self.accumulation} accumulation steps x "
            f"{self.processes} processes = {self.per_step} completions "
            f"({self.per_step // self.num_generations} prompts x {self.num_generations} generations) per "
            f"optimiser step; longest micro-batch "
            f"{self.micro} x ({self.prompt_tokens} prompt + {self.completion_tokens} completion) = "
            f"{self.micro * longest} tokens"
        )


def estimate(
    arch: Architecture,
    batch: Batch,
    *,
    lora: tuple[int, list[str]] | None,
    beta: float,
    optim: str,
    gradient_checkpointing: bool,
    vllm_fraction: float,
    gpu_gib: float,
    dtype: str,
) -> dict[str, float]:
    """Peak memory of one process in GiB, term by term; ``total`` is their sum.

    ``dtype`` is the one TRL loads the policy in (``trl.model_init_kwargs.dtype``: ``model.dtype`` under LoRA,
    float32 master weights for full fine-tuning of a half-precision model, see ``sage.models.policy_dtype``).
    Weights: the policy at ``dtype``. Trainable state: under LoRA a float32 adapter (peft keeps it so), its
    float32 gradient and the optimiser's moments; for full fine-tuning a gradient at ``dtype`` and the
    moments.
    Reference: none under LoRA or with beta 0 (TRL then builds none: the adapter disabled is the reference);
    for full fine-tuning TRL builds it with the same ``model_init_kwargs``, so at ``dtype``. DDP's gradient
    buckets (more than one process): one more copy of the trainable gradients (transformers' DDP keeps
    ``gradient_as_bucket_view`` off). Activations (bf16): each layer's input when checkpointed, or every
    layer's working set otherwise, plus one layer's working set (q, k, v, attention output, the MLP's three
    wide tensors, and as much again for their gradients). Logits: bf16 logits of the completion tokens and
    their gradient, and one row's float32 log-softmax (TRL computes log-probs row by row)."""
    params = arch.parameters()
    b, s, c = batch.micro, batch.prompt_tokens + batch.completion_tokens, batch.completion_tokens
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    opt = OPTIMISER_BYTES.get(optim, DEFAULT_OPTIMISER_BYTES)
    w = DTYPE_BYTES[dtype]
    if lora is not None:
        trainable, grad_bytes = arch.lora_parameters(*lora), 4
        state, reference = trainable * (4 + grad_bytes + opt), 0
    else:
        trainable, grad_bytes = params, w
        state, reference = params * (grad_bytes + opt), (w * params if beta else 0)
    buckets = trainable * grad_bytes if batch.processes > 1 else 0
    layer = b * s * (4 * h + 2 * arch.kv_size + 3 * i) * 2 * 2
    layers = arch.num_hidden_layers
    kept = b * s * h * 2 * layers if gradient_checkpointing else layer * layers
    logits = b * c * v * 2 * 2 + c * v * 4
    parts = {
        "weights": w * params / GIB,
        "trainable_state": state / GIB,
        "reference": reference / GIB,
        "ddp_buckets": buckets / GIB,
        "activations": (kept + layer) / GIB,
        "logits": logits / GIB,
        "vllm": vllm_fraction * gpu_gib,
    }
    parts["total"] = sum(parts.values())
    parts["gpu"] = gpu_gib
    return parts


def describe_estimate(parts: dict[str, float]) -> str:
    terms = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k not in ("total", "gpu"))
    verdict = "fits" if parts["total"] <= parts["gpu"] else "DOES NOT FIT"
    # "in training": the plan's evaluation phase (sage.train.evaluation_memory) has a line of its own
    return (
        f"memory estimate per GPU: {parts['total']:.1f} GiB of {parts['gpu']:.1f} GiB in training, {verdict} "
        f"({terms})"
    )


def vllm_room(arch: Architecture, batch: Batch, share_gib: float, dtype: str) -> dict[str, float]:
    """What a colocated vLLM engine's share holds: its weights at ``dtype`` (vLLM's "auto": the checkpoint's
    dtype) and, in the rest, KV cache for ``sequences`` of the longest length at once. vLLM's own working
    memory (its profiling run's activations, CUDA graphs) also comes out of the share and is not counted."""
    weights = arch.parameters() * DTYPE_BYTES[dtype] / GIB
    kv = max(share_gib - weights, 0.0)
    tokens = int(kv * GIB // arch.kv_bytes_per_token(DTYPE_BYTES[dtype]))
    return {
        "share": share_gib,
        "weights": weights,
        "kv": kv,
        "tokens": tokens,
        "sequences": tokens // (batch.prompt_tokens + batch.completion_tokens),
        "generated_at_once": batch.generated_at_once,
    }


def describe_vllm(room: dict[str, float], fraction: float) -> str:
    if room["kv"] <= 0:
        return (
            f"vllm: trl.vllm_gpu_memory_utilization={fraction} gives {room['share']:.1f} GiB, which cannot "
            f"hold its {room['weights']:.1f} GiB of weights: DOES NOT FIT"
        )
    return (
        f"vllm: trl.vllm_gpu_memory_utilization={fraction} gives {room['share']:.1f} GiB = weights "
        f"{room['weights']:.1f} + KV cache {room['kv']:.1f} ({room['tokens']:,} tokens: {room['sequences']} "
        f"sequences of the longest length at once, for the {room['generated_at_once']} each process "
        "generates per round; fewer at once is slower, not an error)"
    )


def largest_vllm_fraction(parts: dict[str, float]) -> float:
    """The largest vLLM share (a multiple of 0.05 of the GPU) that fits beside everything else; 0 if none."""
    room = parts["gpu"] - (parts["total"] - parts["vllm"])
    return max(int(room / parts["gpu"] * 20) / 20, 0.0)


def architecture(source: dict) -> tuple[Architecture, str]:
    """The model's architecture and where it was read from."""
    repo = str(source.get("repo_id", ""))
    local = Path(repo) / "config.json"
    if repo and local.is_file():
        return Architecture.from_config(json.loads(local.read_text())), str(local)
    stored = json.loads(ARCH_FILE.read_text())
    if repo not in stored["models"]:
        raise ValueError(
            f"model.source.repo_id={repo!r}: no local config.json and no stored architecture "
            f"(stored: {sorted(stored['models'])})"
        )
    return Architecture.from_config(stored["models"][repo]), f"stored copy of {repo}'s config.json"


TESTBED_SOURCE = "sage.testbed.model.build_tiny_model"  # every testbed model ties (its make_model)


def check_rollout(cfg) -> None:
    """``rollout=vllm``'s refusals that the composed config already shows, in the one line its rollout
    function would raise later (``sage.train.vllm_rollout.refusal``, their one source): an adapter vLLM
    cannot serve (LoRA on the output layer or the embeddings, DoRA, ``modules_to_save``, a bias, a rank above
    vLLM's), a TRL setting it does not do, and full fine-tuning of a model whose output layer is tied to its
    embeddings (``sage.train.memory.tied_embeddings``: the stored or local config.json, the testbed's models).
    sage-train (after ``sage.config.validate``) and ``python -m sage.train.plan`` call it; imports no vLLM
    (here, not in sage.config, which the modules it reads import)."""
    from sage.config import ConfigError

    if not adapter_engine(cfg):
        return
    from sage.train.vllm_rollout import refusal

    refused = refusal(cfg.model.lora, cfg.trl, tied=tied_embeddings(cfg.model.source))
    if refused:
        raise ConfigError(refused)


def adapter_engine(cfg) -> bool:
    """Whether the training rollouts come from sage's adapter engine (``rollout=vllm``: a VllmRollout)."""
    from omegaconf import OmegaConf

    from sage.targets import builds

    node = OmegaConf.select(cfg, "rollout_func")
    if node is None:
        return False
    from sage.train.vllm_rollout import VllmRollout

    return builds(node, VllmRollout)


def tied_embeddings(source) -> bool | None:
    """Whether the model ``model.source`` names ties its output layer to its embeddings
    (``tie_word_embeddings``), as far as the config tells before the model is built: a hub or local model by
    its ``config.json`` (the paper's models by the stored copy, as :func:`architecture` reads them), a GGUF
    package by its converted folder's, a testbed model always (``sage.testbed.model.make_model``); None
    where it cannot tell (a hub model neither local nor stored, a GGUF file not converted yet, a config.json
    that does not say), which ``VllmRollout.attach`` then checks on the built model."""
    target = str(source.get("_target_", ""))
    if target == TESTBED_SOURCE:
        return True
    repo = source.get("repo_id")
    if repo:
        local = Path(str(repo)) / "config.json"
        if local.is_file():
            return json.loads(local.read_text()).get("tie_word_embeddings")
        stored = json.loads(ARCH_FILE.read_text())["models"].get(str(repo))
        return None if stored is None else stored["tie_word_embeddings"]
    if target == "sage.models.from_package_gguf" and source.get("sha256"):
        from sage.models import GGUF_MARKER, gguf_folder

        folder = gguf_folder(str(source.get("sha256")))
        if (folder / GGUF_MARKER).is_file():
            return json.loads((folder / "config.json").read_text()).get("tie_word_embeddings")
    return None


def training_dtype(cfg) -> str:
    """The dtype TRL loads the policy (and a full fine-tuning reference) in: sage-train's
    ``model_init_kwargs`` (``sage.train.main.grpo_args``), where ``trl.model_init_kwargs`` wins."""
    from sage.models import policy_dtype

    dtype = policy_dtype(str(cfg.model.dtype), lora=cfg.model.lora is not None)
    return str({"dtype": dtype, **(cfg.trl.model_init_kwargs or {})}["dtype"])


def batch_of(cfg, prompt_tokens: int, processes: int) -> Batch:
    t = cfg.trl
    if t.steps_per_generation is not None:
        steps_per_generation = t.steps_per_generation
    elif t.generation_batch_size is not None:
        steps_per_generation = t.generation_batch_size // (t.per_device_train_batch_size * processes)
    else:
        steps_per_generation = t.gradient_accumulation_steps
    return Batch(
        micro=t.per_device_train_batch_size,
        accumulation=t.gradient_accumulation_steps,
        processes=processes,
        num_generations=t.num_generations,
        prompt_tokens=prompt_tokens,
        completion_tokens=cfg.model.max_completion_length,
        steps_per_generation=steps_per_generation,
    )


def colocated_fraction(cfg) -> float:
    """The share of each GPU a training-rollout engine beside the trainer takes: TRL's colocated engine
    (``rollout=vllm_merged``) or sage's adapter-serving one (``rollout=vllm``), both sized by
    ``trl.vllm_gpu_memory_utilization``; 0 with no engine on the training GPU (or TRL's server mode)."""
    t = cfg.trl
    colocated = t.use_vllm and t.vllm_mode == "colocate"
    return float(t.vllm_gpu_memory_utilization) if colocated or adapter_engine(cfg) else 0.0


def plan(cfg, gpu_gib: float, prompt_tokens: int, processes: int = 1) -> tuple[Batch, dict[str, float], str]:
    """Batch shape and memory estimate of a composed sage-train config (one process per GPU)."""
    batch = batch_of(cfg, prompt_tokens, processes)
    arch, origin = architecture(cfg.model.source)
    lora = None if cfg.model.lora is None else (cfg.model.lora.r, list(cfg.model.lora.target_modules))
    parts = estimate(
        arch,
        batch,
        lora=lora,
        beta=cfg.divergence.beta,
        optim=str(cfg.trl.optim),
        gradient_checkpointing=bool(cfg.trl.gradient_checkpointing),
        vllm_fraction=colocated_fraction(cfg),
        gpu_gib=gpu_gib,
        dtype=training_dtype(cfg),
    )
    return batch, parts, origin


def engine_room_dtype(cfg) -> str:
    """The dtype a colocated engine holds its weights and KV cache in on the cluster. sage's adapter engine
    (``rollout=vllm``) serves in ``model.engine_dtype``, whose ``auto`` is bfloat16 on the bfloat16 GPUs a
    plan is for (resolving it on the planning machine would size the cluster's engine by this one's CPU);
    TRL's engine (``rollout=vllm_merged``) serves in the checkpoint's dtype, ``model.dtype``."""
    model_dtype = str(getattr(cfg.model.dtype, "value", cfg.model.dtype))
    if not adapter_engine(cfg):
        return model_dtype
    engine = str(getattr(cfg.model.engine_dtype, "value", cfg.model.engine_dtype))
    return "bfloat16" if engine == "auto" else engine


if __name__ == "__main__":  # the plan's command by its earlier name: the plan is sage.train.plan's
    from sage.train.plan import main

    raise SystemExit(main())
