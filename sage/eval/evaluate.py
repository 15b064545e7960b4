"""Sampling-based evaluation: a correctness matrix (problems x samples) per (checkpoint, dataset, seed), and
the unbiased pass@k curve (k = 1..n) from it. ``sage-train``'s end-of-run evaluation and ``sage-eval`` both
call :func:`evaluate_model`, so they give the same numbers for the same checkpoint and seed.

Departures from the authors' evaluator (SAGE.md section 7):
- the HF backend runs its own decode loop over (prompt, sample) pairs batched across problems: each
  distinct prompt is prefilled once and its KV cache copied to its samples, and finished sequences leave
  the batch, so no compute goes to a prompt's duplicates or to padding after eos (``generate`` with
  num_return_sequences computes every sequence until the longest one of the call stops); Llama-family
  models run through ``sage.eval.decode.CompactDecoder``, the same forward pass in a few fused tensor ops;
- the vLLM backend submits all prompts x n samples of a cell at once to one engine per checkpoint;
- pass@1 is the mean over ALL problems and samples; pass@k is the unbiased estimator for every k;
- finished cells are stored and never re-sampled; a cell's key holds everything that changes its samples
  (checkpoint files, n, temperature, top-p, max length, template, backend, dtype, seed), so results made
  under other settings are never mixed in.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import psutil
import torch

from sage.config import ConfigError
from sage.data.prompts import make_prompt
from sage.data.verifiers import row_verifier
from sage.eval.decode import CompactDecoder, KVCache, pick, sample_batch, unsupported_reason
from sage.grading import GradingPool
from sage.metrics import pass_at_k_curve

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
RESULTS_FILE = "results.json"


# ---------------------------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class Checkpoint:
    """What to load for a model folder: full weights, or a LoRA adapter on the base it names."""

    path: str
    base: str  # full weights: the folder itself, or the adapter's base_model_name_or_path
    adapter: str | None
    tokenizer: str

    @classmethod
    def resolve(cls, path: str) -> Checkpoint:
        folder = Path(path)
        if not (folder / ADAPTER_CONFIG).is_file():
            return cls(path=path, base=path, adapter=None, tokenizer=path)
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path to merge onto")
        tokenizer = path if (folder / "tokenizer_config.json").is_file() else base
        return cls(path=path, base=base, adapter=path, tokenizer=tokenizer)

    def fingerprint(self) -> str:
        """Changes whenever the weights do: resolved path, then name, size and mtime of every file of the
        folder(s). A hub id (no local folder) is its own fingerprint."""
        h = hashlib.sha256()
        for part in (self.base, self.adapter):
            if part is None:
                continue
            folder = Path(part)
            if not folder.is_dir():
                h.update(part.encode())
                continue
            h.update(str(folder.resolve()).encode())
            for f in sorted(p for p in folder.iterdir() if p.is_file()):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: the parameters every backend takes."""

    n_samples: int
    temperature: float
    top_p: float
    max_new_tokens: int
    chat: bool
    seed: int


@dataclass(frozen=True)
class CellKey:
    """Everything that changes the samples of a stored cell, recorded with it: the sampling settings and
    what they were applied to. ``template`` fingerprints the rendered prompt (system prompt, chat template,
    output tags); ``model`` the checkpoint's files (Checkpoint.fingerprint)."""

    settings: SamplingSettings
    template: str
    backend: str
    dtype: str
    model: str

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def prompt_texts(tokenizer, rows: list[dict], chat: bool) -> list[str]:
    """The training template (``make_prompt``), rendered with the model's chat template if any."""
    prompts = [make_prompt(r["problem"], chat) for r in rows]
    if chat:
        return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    return prompts


def template_fingerprint(tokenizer, chat: bool) -> str:
    rendered = prompt_texts(tokenizer, [{"problem": "{problem}"}], chat)[0]
    return hashlib.sha256(rendered.encode()).hexdigest()[:12]


def check_backend(eval_cfg) -> None:
    """eval.backend=vllm's requirements, checked before anything is loaded; each failure is one line."""
    if eval_cfg.backend != "vllm":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "eval.backend=vllm needs a CUDA GPU and none is visible; use eval.backend=hf on this machine"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("eval.backend=vllm needs the vllm package: pip install -e '.[vllm]'")


# ---------------------------------------------------------------------------------------------- samplers
@dataclass
class Samples:
    completions: list[list[str]]  # (rows, n_samples)
    n_tokens: int  # sampled tokens, eos included, padding excluded


class Sampler(Protocol):
    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings) -> Samples: ...


def _chunks(order: list[int], n: int, batch_size: int) -> Iterator[list[tuple[int, int]]]:
    """Groups of (row, copies) with at most batch_size sequences in all; a row's n samples may span
    groups when n > batch_size."""
    chunk: list[tuple[int, int]] = []
    room = batch_size
    for row in order:
        left = n
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


class HFSampler:
    """transformers backend (the CPU default), on a loaded model (also the one being trained, for the
    periodic evaluation) in eval mode.

    Llama-family models (Qwen2, Llama, Mistral) are decoded by :class:`sage.eval.decode.CompactDecoder`, which
    computes the model's forward pass op for op with fused projections and a preallocated cache; any other
    model (or a PEFT-wrapped one) by the same loop around transformers' own forward, at about half the
    speed. Both sample the same distribution; the choice and its reason are logged, as is the compact
    decoder's fallback to torch-ops attention where its C++ kernel cannot be built."""

    def __init__(self, model, tokenizer, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
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

    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings) -> Samples:
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        out: list[list[str]] = [[] for _ in prompt_ids]
        generator = torch.Generator(device=self.model.device).manual_seed(s.seed)
        if self.decoder == "compact":
            # weights are packed per call: the periodic evaluation sees the current training weights
            decoder = CompactDecoder(self.model)
            if decoder.attention_fallback is not None and not self._fallback_logged:
                log.warning(
                    "evaluation attends with torch ops (about 1.3x slower on the testbed): %s",
                    decoder.attention_fallback,
                )
                self._fallback_logged = True
            cache = self._compact_cache(decoder, s.max_new_tokens, len(prompt_ids) * s.n_samples)

            def decode(prompts, copies):
                return sample_batch(
                    decoder,
                    cache,
                    prompts,
                    copies,
                    max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    eos=self.eos,
                    pad_id=self.pad_id,
                    generator=generator,
                )
        else:

            def decode(prompts, copies):
                return self._decode(prompts, copies, s, generator)

        n_tokens = 0
        for chunk in _chunks(order, s.n_samples, self.batch_size):
            tokens, lengths = decode([prompt_ids[r] for r, _ in chunk], [c for _, c in chunk])
            n_tokens += int(lengths.sum())
            texts = self.tokenizer.batch_decode(
                [t[:n].tolist() for t, n in zip(tokens, lengths, strict=True)], skip_special_tokens=True
            )
            rows = [r for r, c in chunk for _ in range(c)]
            for r, text in zip(rows, texts, strict=True):
                out[r].append(text)
        return Samples(out, n_tokens)

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

    @torch.inference_mode()
    def _decode(
        self, prompts: list[list[int]], copies: list[int], s: SamplingSettings, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' forward with a DynamicCache, for models the compact decoder does not cover:
        (sum(copies), max_new_tokens) sampled ids and each sequence's length (eos included)."""
        from transformers import DynamicCache

        dev = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=dev)  # (P, L)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)  # (P, L)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # (P, V)
        # every distinct prompt is prefilled once; its cache is then copied to each of its samples
        expand = torch.repeat_interleave(
            torch.arange(len(prompts), device=dev), torch.tensor(copies, device=dev)
        )
        cache.batch_select_indices(expand)
        logits, mask, position = logits[expand], mask[expand], positions[expand, -1]
        # without padding no mask is needed, and attention takes its fast path (no (B, 1, 1, T) mask)
        padded = bool((mask == 0).any())
        total = len(expand)
        tokens = torch.full((total, s.max_new_tokens), self.pad_id, dtype=torch.long, device=dev)  # (B, T)
        lengths = torch.full((total,), s.max_new_tokens, dtype=torch.long, device=dev)  # (B,)
        alive = torch.arange(total, device=dev)  # batch row -> output row
        eos = self.eos.to(dev)
        for t in range(s.max_new_tokens):
            nxt = pick(logits, s.temperature, s.top_p, generator)  # (b,)
            tokens[alive, t] = nxt
            done = torch.isin(nxt, eos)
            lengths[alive[done]] = t + 1
            if t == s.max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):  # finished sequences leave the batch: no compute on padding
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                alive, nxt, mask, position = alive[keep], nxt[keep], mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            position = position + 1
            logits = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask if padded else None,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        return tokens.cpu(), lengths.cpu()


class VllmSampler:
    """vLLM backend (CUDA): one engine per checkpoint; all prompts x n samples of a cell in one call; a
    LoRA adapter is served with vLLM's LoRA support instead of being merged."""

    def __init__(self, checkpoint: Checkpoint, dtype: str, eval_cfg) -> None:
        from vllm import LLM

        lora_rank = None
        if checkpoint.adapter is not None:
            from vllm.lora.request import LoRARequest

            lora_rank = int(json.loads((Path(checkpoint.adapter) / ADAPTER_CONFIG).read_text())["r"])
            self.lora = LoRARequest("checkpoint", 1, checkpoint.adapter)
        else:
            self.lora = None
        self.llm = LLM(
            model=checkpoint.base,
            tokenizer=checkpoint.tokenizer,
            dtype=dtype,
            enable_lora=lora_rank is not None,
            max_lora_rank=lora_rank or 16,
            gpu_memory_utilization=eval_cfg.vllm_gpu_memory_utilization,
            tensor_parallel_size=eval_cfg.vllm_tensor_parallel_size,
        )

    def sample(self, prompt_ids: list[list[int]], s: SamplingSettings) -> Samples:
        from vllm import SamplingParams

        # one seed per prompt (derived from the cell's seed) so that problems do not share a random stream
        params = [
            SamplingParams(
                n=s.n_samples,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_new_tokens,
                seed=s.seed * 1_000_003 + i,
            )
            for i in range(len(prompt_ids))
        ]
        # token ids, not text: vLLM would add special tokens that the HF backend does not
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=self.lora, use_tqdm=False
        )
        completions = [[o.text for o in out.outputs] for out in outputs]
        return Samples(completions, sum(len(o.token_ids) for out in outputs for o in out.outputs))


def open_sampler(checkpoint: Checkpoint, tokenizer, *, dtype: str, eval_cfg) -> Sampler:
    check_backend(eval_cfg)
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


# ---------------------------------------------------------------------------------------------- cells
def cell_dir(results_dir: Path, key: CellKey) -> Path:
    return results_dir / f"{key.key()}_seed{key.settings.seed}"


def load_cell(cell: Path, key: CellKey, ids: list[str]) -> dict | None:
    """A finished cell made under exactly this key and these problems, else None."""
    if not (cell / "correct.npy").exists():
        return None
    meta = json.loads((cell / "meta.json").read_text())
    if meta["key"] != asdict(key) or meta["ids"] != ids:
        return None
    return {
        "correct": np.load(cell / "correct.npy"),
        "completions": json.loads((cell / "completions.json").read_text()),
    }


def evaluate_dataset(
    sampler: Sampler, tokenizer, rows: list[dict], key: CellKey, *, cell: Path, pool: GradingPool
) -> dict:
    """Sample, grade and store one (checkpoint, dataset, seed) cell. Returns {correct, completions}."""
    s = key.settings
    t0 = time.perf_counter()
    samples = sampler.sample(tokenize_prompts(tokenizer, rows, s.chat), s)
    t_sample = time.perf_counter() - t0
    flat = [c for per_row in samples.completions for c in per_row]
    golds = [r["answer"] for r in rows for _ in range(s.n_samples)]
    verifiers = [v for r in rows for v in [row_verifier(r)] * s.n_samples]
    correct = np.asarray(pool.grade_many(flat, golds, verifiers), dtype=bool).reshape(len(rows), s.n_samples)
    log.info(
        "%s: %d completions, %d tokens in %.1fs (%.0f tok/s), graded in %.1fs",
        cell.parent.name,
        len(flat),
        samples.n_tokens,
        t_sample,
        samples.n_tokens / max(t_sample, 1e-9),
        time.perf_counter() - t0 - t_sample,
    )
    # Written to a temporary folder and renamed: a killed evaluation leaves no half-finished cell.
    tmp = cell.with_name(cell.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "correct.npy", correct)
    (tmp / "completions.json").write_text(json.dumps(samples.completions))
    (tmp / "curve.json").write_text(json.dumps(pass_at_k_curve(correct)))
    (tmp / "meta.json").write_text(json.dumps({"key": asdict(key), "ids": [r["id"] for r in rows]}))
    if cell.exists():  # a stale cell under the same key (its problems changed): replaced, not mixed
        shutil.rmtree(cell)
    tmp.rename(cell)
    return {"correct": correct, "completions": samples.completions}


def summarise(correct_by_seed: list[np.ndarray], ks: list[int]) -> dict[str, float]:
    """pass@k per seed -> mean and std over seeds, for each reported k."""
    curves = [pass_at_k_curve(c, ks) for c in correct_by_seed]
    out = {}
    for k in ks:
        vals = np.array([c[k] for c in curves])
        out[f"pass@{k}"] = float(vals.mean())
        out[f"pass@{k}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    return out


def full_curve(correct_by_seed: list[np.ndarray]) -> dict[str, list[float]]:
    """pass@k for every k in 1..n: per seed, mean and std over seeds (Figure 3 of the paper)."""
    per_seed = np.array([list(pass_at_k_curve(c).values()) for c in correct_by_seed])  # (seeds, n)
    std = per_seed.std(axis=0, ddof=1) if len(per_seed) > 1 else np.zeros(per_seed.shape[1])
    return {
        "k": list(range(1, per_seed.shape[1] + 1)),
        "mean": per_seed.mean(axis=0).tolist(),
        "std": std.tolist(),
        "per_seed": per_seed.tolist(),
    }


def load_eval_rows(datasets_cfg, limit: int | None) -> dict[str, list[dict]]:
    """Every eval dataset's rows, loaded up front so that a bad file or an unknown verifier fails before any
    sampling."""
    from sage.config import build

    rows = {}
    for name, node in datasets_cfg.items():
        loaded = build(node)
        rows[name] = loaded[:limit] if limit is not None else loaded
        for row in rows[name]:
            try:
                row_verifier(row)
            except ValueError as error:
                raise ConfigError(f"eval.datasets.{name}: {error}") from None
    return rows


def evaluate_model(
    model_path: str,
    rows_by_dataset: dict[str, list[dict]],
    eval_cfg,
    *,
    chat: bool,
    max_new_tokens: int,
    results_dir: Path,
    dtype: str,
) -> dict[str, dict]:
    """Evaluate one checkpoint (a model folder, or a LoRA adapter folder) on every dataset and seed.

    Cells already in ``results_dir`` under the same settings are loaded, not re-sampled; the model and the
    grading pool are only started if some cell is missing. Writes ``results_dir/results.json`` and returns,
    per dataset, {"summary": {pass@k: mean, pass@k_std: std}, "curve": full_curve, "correct": [matrix per
    seed], "completions": [...], "settings": {...}}.
    """
    from transformers import AutoTokenizer

    check_backend(eval_cfg)
    checkpoint = Checkpoint.resolve(model_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    identity = {
        "template": template_fingerprint(tokenizer, chat),
        "backend": str(eval_cfg.backend),
        "dtype": dtype,
        "model": checkpoint.fingerprint(),
    }
    sampling = {
        "n_samples": eval_cfg.n_samples,
        "temperature": float(eval_cfg.temperature),
        "top_p": float(eval_cfg.top_p),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
    }
    results: dict[str, dict] = {}
    sampler: Sampler | None = None
    pool: GradingPool | None = None
    with contextlib.ExitStack() as stack:
        for name, rows in rows_by_dataset.items():
            ids = [r["id"] for r in rows]
            per_seed = []
            for seed in eval_cfg.seeds:
                key = CellKey(SamplingSettings(seed=seed, **sampling), **identity)
                cell = cell_dir(results_dir / name, key)
                done = load_cell(cell, key, ids)
                if done is not None:
                    log.info("reusing finished evaluation cell %s", cell)
                    per_seed.append(done)
                    continue
                if sampler is None:  # started only when a cell is missing: a finished run loads nothing
                    sampler = open_sampler(checkpoint, tokenizer, dtype=dtype, eval_cfg=eval_cfg)
                    pool = stack.enter_context(GradingPool(workers=2))
                per_seed.append(evaluate_dataset(sampler, tokenizer, rows, key, cell=cell, pool=pool))
            correct = [r["correct"] for r in per_seed]
            results[name] = {
                "summary": summarise(correct, list(eval_cfg.ks)),
                "curve": full_curve(correct),
                "correct": correct,
                "completions": [r["completions"] for r in per_seed],
                "settings": {
                    **sampling,
                    **identity,
                    "seeds": list(eval_cfg.seeds),
                    "batch_size": eval_cfg.batch_size,
                },
            }
    write_results(results_dir / RESULTS_FILE, model_path, results)
    return results


def write_results(path: Path, model_path: str, results: dict[str, dict]) -> None:
    payload: dict[str, Any] = {
        "checkpoint": model_path,
        "datasets": {
            name: {
                "n_problems": int(r["correct"][0].shape[0]),
                "summary": r["summary"],
                "curve": r["curve"],
                "settings": r["settings"],
            }
            for name, r in results.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))


def format_table(rows: dict[str, dict[str, dict[str, float]]], ks: list[int]) -> str:
    """Markdown table: one line per (model, dataset), pass@k (mean ± std over seeds)."""
    head = "| model | dataset | " + " | ".join(f"pass@{k}" for k in ks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ks))]
    for model_name, by_ds in rows.items():
        for ds, s in by_ds.items():
            cells = [f"{s[f'pass@{k}']:.3f} ± {s[f'pass@{k}_std']:.3f}" for k in ks]
            lines.append(f"| {model_name} | {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
