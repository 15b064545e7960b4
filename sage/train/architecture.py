"""A decoder's shapes as the memory plan counts them (``sage.train.memory`` and
``sage.train.evaluation_memory``): parameters, LoRA parameters and KV bytes per token from the fields of a
Qwen2/Llama ``config.json``. A leaf module, so that the two planners share it without importing each
other."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token over every layer: vLLM's KV cache holds this per token."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes
