"""Does one training micro-batch fit a GPU? An estimate of peak memory from the architecture and TRL's knobs.

    python -m sage.train.memory model=qwen2.5-math-7b trl=paper rollout=vllm [gpu_gib=80] [prompt_tokens=1024]

prints the batch shape (the same line sage-train prints at start; TRL does not truncate prompts, so the
longest prompt is a stated assumption, ``prompt_tokens``) and the estimate term by term, and exits
1 if it does not fit. The architecture is the model's ``config.json``: read from ``model.source`` when that
is a local folder (or the hub is reachable), else from ``architectures.json`` beside this file, a copy of
the published config.json values of the paper's models (the line printed says which).

The estimate is an upper-bound style sum, not a measurement (no GPU is lent to this project): what is
resident (weights, trainable state, the reference, vLLM's share under colocation) plus the working set of
one micro-batch (checkpointed layer inputs, one layer's activations when it is recomputed, the logits of
the completion tokens with their gradient). Each term is named so a user can check it against
``torch.cuda.max_memory_allocated`` on a real run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
ARCH_FILE = Path(__file__).with_name("architectures.json")
# bytes of optimiser state per trainable parameter (two moments)
OPTIMISER_BYTES = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_bnb_8bit": 2}
DEFAULT_OPTIMISER_BYTES = 8


@dataclass(frozen=True)
class Architecture:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> Architecture:
        return cls(**{k: config[k] for k in cls.__dataclass_fields__})

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.hidden_size // self.num_attention_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one decoder layer (Qwen2/Llama naming)."""
        h, kv, i = self.hidden_size, self.kv_size, self.intermediate_size
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def parameters(self) -> int:
        layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + self.hidden_size

    def lora_parameters(self, r: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f"model.lora.target_modules: {unknown} are not projections of this architecture")
        return self.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


@dataclass(frozen=True)
class Batch:
    """TRL's batch knobs, as GRPOConfig resolves them (steps_per_generation defaults to the accumulation)."""

    micro: int  # per_device_train_batch_size: completions per forward pass
    accumulation: int
    processes: int
    num_generations: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def per_step(self) -> int:
        return self.micro * self.accumulation * self.processes

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
) -> dict[str, float]:
    """Peak memory of one process in GiB, term by term; ``total`` is their sum.

    Weights: bf16 (2 bytes) under LoRA (frozen); float32 master weights (4 bytes) for full fine-tuning,
    which bf16 autocast trains. Trainable state: float32 weight copy (LoRA only), float32 gradient and
    the optimiser's moments. Reference: none under LoRA (the adapter is disabled), a bf16 copy for full
    fine-tuning with beta > 0. Activations (bf16): each layer's input when checkpointed, or every layer's
    working set otherwise, plus one layer's working set (q, k, v, attention output, the MLP's three wide
    tensors, and as much again for their gradients). Logits: bf16 logits of the completion tokens and their
    gradient, and one row's float32 log-softmax (TRL computes log-probs row by row)."""
    params = arch.parameters()
    b, s, c = batch.micro, batch.prompt_tokens + batch.completion_tokens, batch.completion_tokens
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    opt = OPTIMISER_BYTES.get(optim, DEFAULT_OPTIMISER_BYTES)
    if lora is not None:
        trainable = arch.lora_parameters(*lora)
        weights, state, reference = 2 * params, trainable * (4 + 4 + opt), 0
    else:
        weights, state, reference = 4 * params, params * (4 + opt), (2 * params if beta else 0)
    layer = b * s * (4 * h + 2 * arch.kv_size + 3 * i) * 2 * 2
    layers = arch.num_hidden_layers
    kept = b * s * h * 2 * layers if gradient_checkpointing else layer * layers
    logits = b * c * v * 2 * 2 + c * v * 4
    parts = {
        "weights": weights / GIB,
        "trainable_state": state / GIB,
        "reference": reference / GIB,
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
    return f"memory estimate per GPU: {parts['total']:.1f} GiB of {parts['gpu']:.1f} GiB, {verdict} ({terms})"


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


def plan(cfg, gpu_gib: float, prompt_tokens: int) -> tuple[Batch, dict[str, float], str]:
    """Batch shape and memory estimate of a composed sage-train config (one process per GPU)."""
    t = cfg.trl
    batch = Batch(
        micro=t.per_device_train_batch_size,
        accumulation=t.gradient_accumulation_steps,
        processes=1,
        num_generations=t.num_generations,
        prompt_tokens=prompt_tokens,
        completion_tokens=cfg.model.max_completion_length,
    )
    arch, origin = architecture(cfg.model.source)
    lora = None if cfg.model.lora is None else (cfg.model.lora.r, list(cfg.model.lora.target_modules))
    parts = estimate(
        arch,
        batch,
        lora=lora,
        beta=cfg.divergence.beta,
        optim=str(t.optim),
        gradient_checkpointing=bool(t.gradient_checkpointing),
        vllm_fraction=t.vllm_gpu_memory_utilization if t.use_vllm and t.vllm_mode == "colocate" else 0.0,
        gpu_gib=gpu_gib,
    )
    return batch, parts, origin


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.paths import CONF_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    gpu_gib = 80.0
    for a in [a for a in args if a.startswith("gpu_gib=")]:
        gpu_gib = float(a.split("=", 1)[1])
        args.remove(a)
    prompt_tokens = 1024
    for a in [a for a in args if a.startswith("prompt_tokens=")]:
        prompt_tokens = int(a.split("=", 1)[1])
        args.remove(a)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=args)
    try:
        batch, parts, origin = plan(cfg, gpu_gib, prompt_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"architecture: {origin}")
    print(batch.describe())
    print(describe_estimate(parts))
    return 0 if parts["total"] <= parts["gpu"] else 1


if __name__ == "__main__":
    sys.exit(main())
