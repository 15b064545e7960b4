"""Compact decoder: the CPU evaluator's forward pass for Llama-family decoder-only models (Qwen2, Llama,
Mistral) in float32, written as a handful of tensor ops per layer instead of transformers' module stack.

Why: on a small model and 2 cores, transformers' decode step spends most of its time outside the matrix
products: per-module Python calls, ``DynamicCache`` growing by ``torch.cat`` (a full copy of the cache at
every step) and the mask/rotary bookkeeping. Here
- q/k/v projections are fused into one matrix product, RMSNorm weights are folded into the columns of
  the projection that follows them and the attention scale into the query rows (weights packed once per
  ``sample`` call, so a model being trained is always decoded with its current weights);
- rotary embedding is one complex multiplication: the q/k output features of each head are permuted so
  that each rotated pair (i, i + head_dim/2) is adjacent. Queries and keys get the same permutation, so
  their dot products, and everything after them, are unchanged;
- a prompt's keys and values are computed and stored once, not copied to each of its n samples;
- the cache of the generated tokens is preallocated at its final length, slot-major, and written in
  place; finished sequences are dropped from the batch once a quarter of it has finished, since every
  drop moves the cache;
- a step's attention (each row's query against its prompt's keys and its own generated keys, one
  softmax) is one fused C++ kernel, ``torch.ops.sage.decode_attention`` (``sage/kernels``), built on
  first use. In torch ops it is a batched matrix-vector product per (row, head), whose per-product
  overhead and strided reads grow with every generated slot; those ops remain as ``attention="torch"``,
  the path taken (and logged by the evaluator) where the kernel cannot be built. ``make bench`` compares
  the three ways to attend (kernel, torch ops, torch ops under ``torch.compile``).

The model's own rotary module gives cos/sin, so every RoPE variant is covered; RMSNorm and softmax run in
float32 as in transformers. ``tests/test_decode.py`` checks logits against the model's forward pass at
every position. What it does not cover (other model types or dtypes, sliding-window attention,
PEFT-wrapped layers) is named by :func:`unsupported_reason`. The sampling loop that drives it (and
transformers' forward for the models it does not cover) is ``sage.eval.decode_loop``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "mistral")
ATTENTION = ("auto", "kernel", "torch")
"""How a step attends: the C++ kernel, torch ops, or the kernel when it can be built (else torch ops)."""


def unsupported_reason(model) -> str | None:
    """None if the compact decoder computes what ``model``'s forward does, else why not."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {list(SUPPORTED_MODEL_TYPES)}"
    if model.dtype != torch.float32:
        return f"dtype {model.dtype} (only torch.float32)"
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
    return _rotary_reason(base.rotary_emb, base.layers[0].self_attn.head_dim, model.dtype)


def _rotary_reason(rotary, head_dim: int, dtype) -> str | None:
    """The rotation as one complex multiply needs cos/sin over the whole head, repeated over its halves
    (transformers' rotate_half convention); probed on a few positions."""
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, 1, dtype=dtype), torch.arange(16)[None])  # (1, 16, D)
    if cos.shape[-1] != head_dim:
        return f"rotary embedding over {cos.shape[-1]} of {head_dim} head dims (only full rotary)"
    half = head_dim // 2
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return "rotary embedding whose cos/sin differ between the two halves of a head"
    return None


def _bias(linear: nn.Linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)


def _pair_rotated(t: torch.Tensor, n_heads: int, scale: float = 1.0) -> torch.Tensor:
    """Rows (output features) of a q or k projection reordered per head as (0, D/2, 1, D/2 + 1, ...), the
    pairs rotate_half rotates together, so that a complex view of the output is the rotation's input."""
    head = t.view(n_heads, 2, t.shape[0] // n_heads // 2, *t.shape[1:])  # (heads, 2, D/2, ...)
    return (head.transpose(1, 2) * scale).reshape(t.shape)


@dataclass
class _Layer:
    """One decoder layer's weights; the RMSNorm weight before a projection is folded into its columns."""

    eps1: float
    eps2: float
    qkv_w: torch.Tensor  # rows: scale * q (pair order), k (pair order), v
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gate_w: torch.Tensor
    gate_b: torch.Tensor | None
    up_w: torch.Tensor
    up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without its weight (folded into the next projection): x / sqrt(mean(x^2) + eps)."""
    r = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # one pass over x for the statistic
    return x * r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; written out below 16 entries, where torch's CPU kernel leaves its
    vectorised path (the first decode steps of short prompts)."""
    if scores.shape[-1] >= 16:
        return torch.softmax(scores, dim=-1)
    e = (scores - scores.amax(-1, keepdim=True)).exp_()
    return e.div_(e.sum(-1, keepdim=True))


def _linear_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """a @ w.T (+ b) written into ``out``."""
    return torch.mm(a, w.t(), out=out) if b is None else torch.addmm(b, a, w.t(), out=out)


def _add_linear(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x += a @ w.T (+ b), in place: x is the residual stream, which the decoder owns. Out of place, the
    product first copies x into its output, an extra pass over the batch's activations (~4% of a step)."""
    x.addmm_(a, w.t())
    return x if b is None else x.add_(b)


class KVCache:
    """Preallocated keys and values of the GENERATED tokens of every layer, slot-major: (slots, rows,
    kv_heads, head_dim), so that a step writes one contiguous (rows, kv_heads, head_dim) block per layer and
    dropping finished rows only moves the slots written so far. (A prompt's keys and values are not copied
    to its samples: they live once per prompt in the DecodeState.) Allocated once per evaluation and
    reused by every batch: fresh large tensors cost a page fault per 4 KiB on first touch."""

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
    """A batch being decoded. Its rows occupy the first ``rows`` rows of ``cache`` (generated tokens); the
    prompts' keys and values are held once per distinct prompt, per layer, and ``owner`` says which
    prompt each row samples from. ``prompt_real`` (prompts, width) is False on the left padding of a
    prompt; ``position`` is each row's next position id."""

    cache: KVCache
    rows: int
    owner: torch.Tensor  # (rows,) long
    prompt_keys: list[torch.Tensor]  # per layer (P, kv, W, D)
    prompt_values: list[torch.Tensor]  # per layer (P, kv, W, D)
    prompt_real: torch.Tensor  # (P, W) bool
    position: torch.Tensor  # (rows,) long
    filled: int  # generated slots written so far (the same for every row)
    padded: bool  # some prompt was left-padded: attention to the prompts needs the mask

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (ascending), moved to the front of the cache."""
        n, c = len(keep), self.cache
        moved = c.scratch[: self.filled * n * c.keys[0][0, 0].numel()].view(
            self.filled, n, *c.keys[0].shape[2:]
        )
        for buf in (*c.keys, *c.values):  # nothing to move before the first step (filled = 0)
            torch.index_select(buf[: self.filled, : self.rows], 1, keep, out=moved)
            buf[: self.filled, :n] = moved
        self.rows = n
        self.owner = self.owner.index_select(0, keep)
        self.position = self.position.index_select(0, keep)


class CompactDecoder:
    """Prefill and one-token steps for a supported model (see :func:`unsupported_reason`). ``attention``
    is one of :data:`ATTENTION`; with "auto", ``attention_fallback`` says why the kernel is not used (None
    when it is)."""

    @torch.no_grad()
    def __init__(self, model, attention: str = "auto") -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"compact decoder: {reason}")
        if attention not in ATTENTION:
            raise ValueError(f"compact decoder: attention {attention!r} is not one of {list(ATTENTION)}")
        self.attention_fallback = None
        if attention != "torch":
            from sage.eval.kernels import decode_attention_unavailable

            unavailable = decode_attention_unavailable()
            if unavailable is not None and attention == "kernel":
                raise RuntimeError(f"compact decoder: decode attention kernel unavailable: {unavailable}")
            self.attention_fallback = unavailable
        self.attention = "torch" if attention == "torch" or self.attention_fallback else "kernel"
        cfg = model.config
        base = model.model
        attn0 = base.layers[0].self_attn
        self.head_dim = d = attn0.head_dim
        self.n_heads = h = cfg.num_attention_heads
        self.n_kv = kv = cfg.num_key_value_heads
        scale = attn0.scaling
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm_eps = base.norm.variance_epsilon
        self.lm_head_w, self.lm_head_b = model.lm_head.weight * base.norm.weight, model.lm_head.bias
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            has_bias = any(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj))
            ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            self.layers.append(
                _Layer(
                    eps1=layer.input_layernorm.variance_epsilon,
                    eps2=layer.post_attention_layernorm.variance_epsilon,
                    qkv_w=torch.cat(
                        [
                            _pair_rotated(a.q_proj.weight, h, scale),
                            _pair_rotated(a.k_proj.weight, kv),
                            a.v_proj.weight,
                        ]
                    )
                    * ln1,
                    qkv_b=torch.cat(
                        [
                            _pair_rotated(_bias(a.q_proj), h, scale),
                            _pair_rotated(_bias(a.k_proj), kv),
                            _bias(a.v_proj),
                        ]
                    )
                    if has_bias
                    else None,
                    o_w=a.o_proj.weight,
                    o_b=a.o_proj.bias,
                    gate_w=m.gate_proj.weight * ln2,
                    gate_b=m.gate_proj.bias,
                    up_w=m.up_proj.weight * ln2,
                    up_b=m.up_proj.bias,
                    down_w=m.down_proj.weight,
                    down_b=m.down_proj.bias,
                )
            )
        self.sizes = [h * d, kv * d, kv * d]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self._workspace: dict[str, torch.Tensor] = {}

    def _out(self, name: str, rows: int, features: int) -> torch.Tensor:
        """A (rows, features) output buffer reused by every step and layer: a fresh tensor per product
        costs a page fault per 4 KiB on first touch, which the decode step's small products cannot hide."""
        buf = self._workspace.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != features:
            buf = self._workspace[name] = torch.empty(rows, features, dtype=self.dtype, device=self.device)
        return buf[:rows]

    def cache(self, slots: int, rows: int) -> KVCache:
        return KVCache(len(self.layers), slots, rows, self.n_kv, self.head_dim, self.dtype, self.device)

    def _rotation(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """(N, 1, D/2) complex rotations for positions (N,), from the model's own rotary module (whose
        cos/sin repeat over the two halves of a head, as rotate_half requires)."""
        cos, sin = self.rotary(x[:, None], position[:, None])  # (N, 1, D)
        half = self.head_dim // 2
        return torch.complex(cos[..., :half], sin[..., :half])

    def _qkv_product(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """(N, q + k + v features) of the normalised x (N, H); valid until the next layer's."""
        out = self._out("qkv", x.shape[0], layer.qkv_w.shape[0])
        return _linear_into(out, _normalized(x, layer.eps1), layer.qkv_w, layer.qkv_b)

    def _qkv(self, x: torch.Tensor, layer: _Layer, rotation: torch.Tensor):
        """Rotated queries (N, heads, D) and keys (N, kv, D) in pair order, values (N, kv, D), of x (N, H)."""
        n, d = x.shape[0], self.head_dim
        q, k, v = self._qkv_product(x, layer).split(self.sizes, dim=-1)
        q = torch.view_as_real(torch.view_as_complex(q.view(n, self.n_heads, d // 2, 2)) * rotation)
        k = torch.view_as_real(torch.view_as_complex(k.view(n, self.n_kv, d // 2, 2)) * rotation)
        return q.view(n, self.n_heads, d), k.view(n, self.n_kv, d), v.view(n, self.n_kv, d)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """x + MLP(norm(x)) for (N, H) inputs."""
        h = _normalized(x, layer.eps2)
        # two products rather than one fused gate/up: the activation then runs in place on contiguous
        # memory (a strided in-place silu is an order of magnitude slower on CPU)
        n, inter = x.shape[0], layer.gate_w.shape[0]
        gate = F.silu(_linear_into(self._out("gate", n, inter), h, layer.gate_w, layer.gate_b), inplace=True)
        up = _linear_into(self._out("up", n, inter), h, layer.up_w, layer.up_b)
        return _add_linear(x, gate.mul_(up), layer.down_w, layer.down_b)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_normalized(x, self.norm_eps), self.lm_head_w, self.lm_head_b)

    @torch.inference_mode()
    def prefill(
        self, prompts: list[list[int]], copies: list[int], cache: KVCache, max_new_tokens: int, pad_id: int
    ) -> tuple[DecodeState, torch.Tensor]:
        """Run each distinct prompt once (left-padded) and keep its keys and values once for its ``copies``
        samples (consecutive rows); returns the state and next-token logits (sum(copies), vocab)."""
        dev = self.device
        p, width = len(prompts), max(len(q) for q in prompts)
        total = sum(copies)
        if total > cache.rows or max_new_tokens > cache.slots:
            raise ValueError(
                f"batch of {total} rows x {max_new_tokens} new tokens exceeds the cache "
                f"({cache.rows} x {cache.slots})"
            )
        ids = torch.tensor([[pad_id] * (width - len(q)) + q for q in prompts], device=dev)  # (P, W)
        real = torch.tensor([[False] * (width - len(q)) + [True] * len(q) for q in prompts], device=dev)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (P, W)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
        # a padding query attends to itself only: a query with no key at all would give NaN rows
        allowed = ((causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=dev))[
            :, None, None
        ]
        owner = torch.repeat_interleave(torch.arange(p, device=dev), torch.tensor(copies, device=dev))
        kv, group, d = self.n_kv, self.n_heads // self.n_kv, self.head_dim
        x = F.embedding(ids.view(-1), self.embed)  # tokens (P * W, H)
        rotation = self._rotation(x, positions.view(-1))
        prompt_keys, prompt_values = [], []
        for layer in self.layers:
            q, k, v = self._qkv(x, layer, rotation)  # (P * W, heads or kv, D)
            k, v = k.view(p, width, kv, d), v.view(p, width, kv, d)
            # one copy per prompt, (P, kv, W, D): cloned, as v lives in a buffer the next layer reuses
            # (and .contiguous() would return it as it is when kv = 1)
            prompt_keys.append(k.permute(0, 2, 1, 3).clone(memory_format=torch.contiguous_format))
            prompt_values.append(v.permute(0, 2, 1, 3).clone(memory_format=torch.contiguous_format))
            # grouped-query attention without repeating keys: queries as (P, kv, group, W, D)
            q = q.view(p, width, kv, group, d).permute(0, 2, 3, 1, 4)
            k, v = k.permute(0, 2, 1, 3)[:, :, None], v.permute(0, 2, 1, 3)[:, :, None]  # (P, kv, 1, W, D)
            scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))  # (P,kv,g,W,W)
            out = torch.matmul(torch.softmax(scores, dim=-1), v)  # (P, kv, g, W, D)
            out = out.permute(0, 3, 1, 2, 4).reshape(p * width, -1)  # (P * W, heads * D)
            x = self._mlp(_add_linear(x, out, layer.o_w, layer.o_b), layer)
        logits = self._logits(x.view(p, width, -1)[:, -1])  # (P, V)
        state = DecodeState(
            cache=cache,
            rows=total,
            owner=owner,
            prompt_keys=prompt_keys,
            prompt_values=prompt_values,
            prompt_real=real,
            position=positions[owner, -1] + 1,
            filled=0,
            padded=bool((~real).any()),
        )
        return state, logits[owner]

    @torch.inference_mode()
    def step(self, state: DecodeState, ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (rows,); returns the next-token logits (rows, vocab). Attention has two
        parts that share one softmax: the row's generated tokens (its own cache rows) and its prompt,
        whose keys and values are stored once per prompt."""
        b, slot = state.rows, state.filled
        end = slot + 1
        kv, group, d = self.n_kv, self.n_heads // self.n_kv, self.head_dim
        torch_attention = _TorchAttention(state) if self.attention == "torch" else None
        x = F.embedding(ids, self.embed)  # (B, H)
        rotation = self._rotation(x, state.position)
        for i, layer in enumerate(self.layers):
            keys, values = state.cache.keys[i], state.cache.values[i]
            q, k, v = self._qkv_product(x, layer).split(self.sizes, dim=-1)
            q = torch.view_as_real(torch.view_as_complex(q.view(b, self.n_heads, d // 2, 2)) * rotation)
            # the rotated keys and the values go straight into their cache slot
            torch.mul(
                torch.view_as_complex(k.view(b, kv, d // 2, 2)),
                rotation,
                out=torch.view_as_complex(keys[slot, :b].view(b, kv, d // 2, 2)),
            )
            values[slot, :b] = v.view(b, kv, d)
            q = q.view(b, kv, group, d)
            if torch_attention is None:
                out = torch.ops.sage.decode_attention(
                    q,
                    state.prompt_keys[i],
                    state.prompt_values[i],
                    state.prompt_real,
                    state.owner,
                    keys,
                    values,
                    end,
                )
            else:
                out = torch_attention(q, i, end)
            x = self._mlp(_add_linear(x, out.view(b, -1), layer.o_w, layer.o_b), layer)
        state.filled = end
        state.position = state.position + 1
        return self._logits(x)


class _TorchAttention:
    """A step's attention in torch ops (the kernel's reference, and the path where it cannot be built).
    For the prompt part the rows of each prompt (consecutive) are laid out as a (prompts, c) grid, c the
    most rows any prompt has left, so that one batched product per layer multiplies each prompt's keys
    by the queries of all its samples at once: the prompt is read once per prompt and step, not once per
    sample (n = 64-256 of them)."""

    def __init__(self, state: DecodeState) -> None:
        self.state = state
        p, self.width = state.prompt_real.shape
        self.grid = _PromptGrid(state.owner, p)
        # (B, 1, 1, W), True on padding
        self.pad_mask = ~state.prompt_real[state.owner][:, None, None, :] if state.padded else None

    def __call__(self, q: torch.Tensor, layer: int, end: int) -> torch.Tensor:
        """(B, kv, g, D) outputs of queries q (B, kv, g, D) at ``layer``, slots [0, end) written."""
        state, grid, width = self.state, self.grid, self.width
        b, kv, group, d = q.shape
        keys, values = state.cache.keys[layer], state.cache.values[layer]
        prompt_keys = state.prompt_keys[layer].view(-1, width, d).transpose(1, 2)  # (P * kv, D, W)
        prompt_scores = grid.from_grid(torch.bmm(grid.to_grid(q), prompt_keys), (kv, group, width))
        if self.pad_mask is not None:
            prompt_scores = prompt_scores.masked_fill(self.pad_mask, float("-inf"))  # (B, kv, g, W)
        # generated part: (B * kv, g, S) from (B * kv, D, S) views of the cache, no copy
        own_scores = torch.bmm(
            q.view(b * kv, group, d), keys[:end, :b].permute(1, 2, 3, 0).reshape(b * kv, d, end)
        )
        probs = _softmax(torch.cat([prompt_scores.view(b * kv, group, width), own_scores], dim=-1))
        out = torch.bmm(probs[..., width:], values[:end, :b].permute(1, 2, 0, 3).reshape(b * kv, end, d))
        from_prompt = grid.from_grid(
            torch.bmm(
                grid.to_grid(probs[..., :width].reshape(b, kv, group, width)),
                state.prompt_values[layer].view(-1, width, d),
            ),
            (kv, group, d),
        )  # (B, kv, g, D)
        return out.view(b, kv, group, d) + from_prompt


class _PromptGrid:
    """Rows sorted by prompt (``owner`` ascending) <-> a (prompts, c) grid, c = most rows of any prompt:
    a row's cell is (its prompt, its rank among that prompt's rows). Cells no row occupies get zeros
    and their results are never read."""

    def __init__(self, owner: torch.Tensor, n_prompts: int) -> None:
        counts = torch.bincount(owner, minlength=n_prompts)  # (P,)
        starts = counts.cumsum(0) - counts
        self.p, self.c = n_prompts, int(counts.max())
        rank = torch.arange(len(owner), device=owner.device) - starts[owner]
        self.cell = owner * self.c + rank  # (B,) flat grid index of each row

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(B, kv, g, F) per-row values -> (P * kv, c * g, F) for a product with per-prompt matrices."""
        _, kv, g, f = x.shape
        grid = x.new_zeros(self.p * self.c, kv, g, f)
        grid.index_copy_(0, self.cell, x)
        return grid.view(self.p, self.c, kv, g, f).transpose(1, 2).reshape(self.p * kv, self.c * g, f)

    def from_grid(self, y: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """(P * kv, c * g, F) product -> (B, kv, g, F), each row's own cell."""
        kv, g, f = shape
        return y.view(self.p, kv, self.c, g, f).transpose(1, 2).reshape(self.p * self.c, kv, g, f)[self.cell]
