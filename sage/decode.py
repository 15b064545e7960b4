"""Compact decoder: the CPU evaluator's forward pass for Llama-family decoder-only models (Qwen2, Llama,
Mistral), written as a handful of tensor ops per layer instead of transformers' module stack.

Why: on a small model and 2 cores, transformers' decode step spends most of its time outside the matrix
products: per-module Python calls, ``DynamicCache`` growing by ``torch.cat`` (a full copy of the cache at
every step) and the mask/rotary bookkeeping. Here
- q/k/v and gate/up projections are fused into one matrix product each (weights packed once per
  ``sample`` call, so a model being trained is always decoded with its current weights);
- the KV cache is preallocated at its final length and written in place;
- finished sequences are dropped from the batch only once a quarter of it has finished, since every
  drop copies the whole cache.

The maths is transformers' own, op for op (RMSNorm in float32, the model's own rotary embedding module so
every RoPE variant is covered, softmax in float32); ``tests/test_decode.py`` checks logits against the
model's forward pass at every position. Architectures or modules it does not cover (other model types,
sliding-window attention, PEFT-wrapped layers) are named by :func:`unsupported_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
COMPACT_WHEN_FINISHED = 0.5
"""Fraction of finished rows in the batch at which they are dropped (a drop copies the whole cache)."""


def unsupported_reason(model) -> str | None:
    """None if the compact decoder computes exactly what ``model``'s forward does, else why not."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer_types {sorted(set(layer_types))} (only full_attention)"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return f"sliding_window {cfg.sliding_window} (only full attention)"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {cfg.pretraining_tp} (only 1)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no .model.layers / .lm_head"
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in (
            ("q_proj", attn.q_proj),
            ("k_proj", attn.k_proj),
            ("v_proj", attn.v_proj),
            ("o_proj", attn.o_proj),
            ("gate_proj", mlp.gate_proj),
            ("up_proj", mlp.up_proj),
            ("down_proj", mlp.down_proj),
        ):
            if type(module) is not nn.Linear:  # a PEFT/quantised wrapper adds its own computation
                return f"layers.{i}.{name} is a {type(module).__name__}, not a plain nn.Linear"
        if attn.scaling != attn.head_dim**-0.5:
            return f"layers.{i}.self_attn.scaling {attn.scaling} (only head_dim**-0.5)"
    if type(model.lm_head) is not nn.Linear:
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear"
    return None


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, the weight applied in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class KVCache:
    """Preallocated keys and values of every layer, slot-major: (slots, rows, kv_heads, head_dim), so that
    a step writes one contiguous (rows, kv_heads, head_dim) block per layer and dropping finished rows
    only moves the slots written so far. Allocated once per evaluation and reused by every batch: fresh
    large tensors cost a page fault per 4 KiB on first touch."""

    def __init__(self, n_layers: int, slots: int, rows: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (slots, rows, kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.scratch = torch.empty(slots * rows * kv_heads * head_dim, dtype=dtype, device=device)
        self.slots, self.rows = slots, rows

    @staticmethod
    def nbytes(n_layers: int, slots: int, rows: int, kv_heads: int, head_dim: int, dtype) -> int:
        """Memory of a cache: keys and values of every layer plus the scratch used to drop rows."""
        return (2 * n_layers + 1) * slots * rows * kv_heads * head_dim * dtype.itemsize


@dataclass
class DecodeState:
    """A batch being decoded: its rows occupy the first ``rows`` rows of ``cache``; ``key_mask`` (rows,
    slots) is False on the left padding of a prompt, ``position`` is each row's next position id."""

    cache: KVCache
    rows: int
    key_mask: torch.Tensor  # (rows, slots) bool
    position: torch.Tensor  # (rows,) long
    filled: int  # slots written so far (the same for every row)
    padded: bool  # some prompt was left-padded: attention needs the key mask

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (ascending), moved to the front of the cache."""
        n, c = len(keep), self.cache
        moved = c.scratch[: self.filled * n * c.keys[0][0, 0].numel()].view(
            self.filled, n, *c.keys[0].shape[2:]
        )
        for buf in (*c.keys, *c.values):
            torch.index_select(buf[: self.filled, : self.rows], 1, keep, out=moved)
            buf[: self.filled, :n] = moved
        self.rows = n
        self.key_mask = self.key_mask.index_select(0, keep)
        self.position = self.position.index_select(0, keep)


class CompactDecoder:
    """Prefill and one-token steps for a supported model (see :func:`unsupported_reason`)."""

    @torch.no_grad()
    def __init__(self, model) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"compact decoder: {reason}")
        cfg = model.config
        base = model.model
        attn0 = base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scale = attn0.scaling
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm, self.norm_eps = base.norm.weight, base.norm.variance_epsilon
        self.lm_head_w, self.lm_head_b = model.lm_head.weight, model.lm_head.bias
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    eps1=layer.input_layernorm.variance_epsilon,
                    eps2=layer.post_attention_layernorm.variance_epsilon,
                    qkv_w=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    qkv_b=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    o_w=a.o_proj.weight,
                    o_b=a.o_proj.bias,
                    gate_up_w=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                    gate_up_b=_cat_bias(m.gate_proj, m.up_proj),
                    down_w=m.down_proj.weight,
                    down_b=m.down_proj.bias,
                )
            )
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    def cache(self, slots: int, rows: int) -> KVCache:
        return KVCache(len(self.layers), slots, rows, self.n_kv, self.head_dim, self.dtype, self.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_w, self.lm_head_b)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        h = _rms_norm(x, layer.ln2, layer.eps2)
        gate, up = F.linear(h, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_w, layer.down_b)

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], copies: list[int], cache: KVCache, max_new_tokens: int, pad_id: int
    ) -> tuple[DecodeState, torch.Tensor]:
        """Run each distinct prompt once (left-padded) and give each of its ``copies`` samples (consecutive
        rows) a copy of its keys and values; returns the state and next-token logits (sum(copies), vocab)."""
        dev = self.device
        p, width = len(prompts), max(len(q) for q in prompts)
        total = sum(copies)
        if total > cache.rows or width + max_new_tokens > cache.slots:
            raise ValueError(
                f"batch of {total} rows x {width + max_new_tokens} slots exceeds the cache "
                f"({cache.rows} x {cache.slots})"
            )
        ids = torch.tensor([[pad_id] * (width - len(q)) + q for q in prompts], device=dev)  # (P, W)
        real = torch.tensor([[False] * (width - len(q)) + [True] * len(q) for q in prompts], device=dev)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (P, W)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        # a padding query attends to itself only: a query with no key at all would give NaN rows
        allowed = ((causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=dev))[:, None]
        expand = torch.repeat_interleave(torch.arange(p, device=dev), torch.tensor(copies, device=dev))
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        group = self.n_heads // self.n_kv
        x = F.embedding(ids, self.embed)  # (P, W, H)
        cos, sin = self.rotary(x, positions)  # (P, W, D)
        cos, sin = cos[:, None], sin[:, None]  # (P, 1, W, D): broadcast over heads
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, layer.eps1)
            q, k, v = F.linear(h, layer.qkv_w, layer.qkv_b).split([q_size, kv_size, kv_size], dim=-1)
            q = _rotate(q.view(p, width, self.n_heads, self.head_dim).transpose(1, 2), cos, sin)  # (P,h,W,D)
            k = _rotate(k.view(p, width, self.n_kv, self.head_dim).transpose(1, 2), cos, sin)  # (P,kv,W,D)
            v = v.view(p, width, self.n_kv, self.head_dim).transpose(1, 2)  # (P, kv, W, D)
            # slot-major cache rows, one per sample: (W, rows, kv, D)
            cache.keys[i][:width, :total] = k[expand].permute(2, 0, 1, 3)
            cache.values[i][:width, :total] = v[expand].permute(2, 0, 1, 3)
            # grouped-query attention without repeating keys: queries as (P, kv, group, W, D)
            q = q.reshape(p, self.n_kv, group, width, self.head_dim)
            scores = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * self.scale  # (P, kv, g, W, W)
            scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            out = torch.matmul(probs, v[:, :, None])  # (P, kv, g, W, D)
            out = out.view(p, self.n_heads, width, self.head_dim).transpose(1, 2).reshape(p, width, q_size)
            x = self._mlp(x + F.linear(out, layer.o_w, layer.o_b), layer)
        logits = self._logits(_rms_norm(x[:, -1], self.norm, self.norm_eps))  # (P, V)
        key_mask = torch.ones(total, cache.slots, dtype=torch.bool, device=dev)
        key_mask[:, :width] = real[expand]
        state = DecodeState(
            cache=cache,
            rows=total,
            key_mask=key_mask,
            position=positions[expand, -1] + 1,
            filled=width,
            padded=bool((~real).any()),
        )
        return state, logits[expand]

    @torch.inference_mode()
    def step(self, state: DecodeState, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (rows,); returns the next-token logits (rows, vocab)."""
        b, slot = state.rows, state.filled
        end = slot + 1
        mask = state.key_mask[:, None, None, :end] if state.padded else None  # (B, 1, 1, S)
        x = F.embedding(ids, self.embed)  # (B, H)
        cos, sin = self.rotary(x[:, None], state.position[:, None])  # (B, 1, D)
        n_qk, group = self.n_heads + self.n_kv, self.n_heads // self.n_kv
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, layer.eps1)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(b, n_qk + self.n_kv, self.head_dim)
            qk = _rotate(qkv[:, :n_qk], cos, sin)  # (B, heads + kv_heads, D): q and k rotated at once
            keys, values = state.cache.keys[i], state.cache.values[i]
            keys[slot, :b] = qk[:, self.n_heads :]
            values[slot, :b] = qkv[:, n_qk:]
            q = qk[:, : self.n_heads].view(b, self.n_kv, group, self.head_dim)
            scores = torch.matmul(q, keys[:end, :b].permute(1, 2, 3, 0)) * self.scale  # (B, kv, g, S)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            out = torch.matmul(probs, values[:end, :b].permute(1, 2, 0, 3)).view(b, -1)  # (B, heads * D)
            x = self._mlp(x + F.linear(out, layer.o_w, layer.o_b), layer)
        state.filled = end
        state.position = state.position + 1
        return self._logits(_rms_norm(x, self.norm, self.norm_eps))


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Next token per row from (B, V) logits: greedy at temperature 0, else nucleus sampling (top-k off)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # drop a token once the mass before it already reaches top_p (the first token always stays)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
    choice = torch.multinomial(sorted_p, 1, generator=generator)  # (B, 1)
    return order.gather(-1, choice).squeeze(1)


@torch.inference_mode()
def sample_batch(
    decoder: CompactDecoder,
    cache: KVCache,
    prompts: list[list[int]],
    copies: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos: torch.Tensor,
    pad_id: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum(copies), max_new_tokens) sampled ids and each sequence's length (eos included); prompt i gets
    copies[i] consecutive rows."""
    state, logits = decoder.prefill(prompts, copies, cache, max_new_tokens, pad_id)
    dev = decoder.device
    total = logits.shape[0]
    tokens = torch.full((total, max_new_tokens), pad_id, dtype=torch.long, device=dev)  # (B, T)
    lengths = torch.full((total,), max_new_tokens, dtype=torch.long, device=dev)  # (B,)
    rows = torch.arange(total, device=dev)  # batch row -> output row
    running = torch.ones(total, dtype=torch.bool, device=dev)  # batch row has not emitted eos yet
    eos = eos.to(dev)
    for t in range(max_new_tokens):
        nxt = pick(logits, temperature, top_p, generator)  # (b,)
        live = rows[running]
        tokens[live, t] = nxt[running]
        done = running & torch.isin(nxt, eos)
        lengths[rows[done]] = t + 1
        running &= ~done
        n_running = int(running.sum())
        if t == max_new_tokens - 1 or n_running == 0:
            break
        if n_running <= (1 - COMPACT_WHEN_FINISHED) * len(rows):
            keep = running.nonzero().squeeze(1)
            state.select(keep)
            rows, nxt, running = rows[keep], nxt[keep], running[keep]
        logits = decoder.step(state, nxt)
    return tokens.cpu(), lengths.cpu()
