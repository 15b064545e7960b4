"""``make bench``'s sections on the evaluator's samplers (``benchmarks.bench`` lists them): eval (our sampler
against one ``generate`` per problem, and grading's share), attention (the compact decoder's C++ kernel
against torch ops, eager and compiled) and vllm_seeding (the vLLM backend's seeds per block against seeds per
request)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

PROBLEMS, SAMPLES, REPEATS = 40, 64, 7
VLLM_PROMPTS, VLLM_SAMPLES, VLLM_REPEATS = 30, 8, 5


def _per_problem_generate(model, tokenizer, prompt_ids: list[list[int]], n: int, max_new: int) -> int:
    """The authors' evaluator: one generate call per problem, n samples each; returns sampled tokens
    (eos included, padding after it excluded, as our sampler counts them)."""
    eos = model.generation_config.eos_token_id
    n_tokens = 0
    for ids in prompt_ids:
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new,
                num_return_sequences=n,
                pad_token_id=tokenizer.pad_token_id,
            )
        gen = out[:, len(ids) :]  # (n, T)
        is_eos = gen == eos
        before_eos = (is_eos.cumsum(1) - is_eos.long()) == 0  # positions up to and including the first eos
        n_tokens += int((before_eos & ((gen != tokenizer.pad_token_id) | is_eos)).sum())
    return n_tokens


def bench_eval() -> dict[str, float]:
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.eval.sampling import HFSampler, SamplingSettings
    from sage.grading import GradingPool
    from sage.paths import CONF_DIR
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import heldout_rows

    path = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    max_new = 64  # model=tiny's max_completion_length: the training max length
    rows = heldout_rows(PROBLEMS)
    ids = [tokenizer(r["problem"], add_special_tokens=False)["input_ids"] for r in rows]
    # the testbed evaluation's own batch size (conf/eval/arith_heldout.yaml)
    batch_size = OmegaConf.load(Path(CONF_DIR) / "eval" / "arith_heldout.yaml").batch_size
    sampler = HFSampler(model, tokenizer, batch_size=batch_size)
    golds = [r["answer"] for r in rows for _ in range(SAMPLES)]
    ours, theirs, sample_s, grade_s = [], [], [], []
    # one untimed call of each first: the first call pays one-off costs (our KV cache's pages, loading the
    # attention kernel, transformers' first-call set-up), which an evaluation of many cells pays once
    sampler.sample(ids, SamplingSettings(SAMPLES, 1.0, 1.0, max_new, chat=False, seed=REPEATS))
    _per_problem_generate(model, tokenizer, ids[:2], SAMPLES, max_new)
    with GradingPool(workers=2) as pool:  # started once per evaluation: its start-up is not timed
        for seed in range(REPEATS):  # interleaved, so both see the same background load
            s = SamplingSettings(SAMPLES, 1.0, 1.0, max_new, chat=False, seed=seed)
            t0 = time.perf_counter()
            samples = sampler.sample(ids, s)
            sample_s.append(time.perf_counter() - t0)
            ours.append(samples.n_tokens / sample_s[-1])
            # the evaluator's next step on the same completions: Math-Verify in the process pool
            t0 = time.perf_counter()
            pool.grade_many([c for per_row in samples.completions for c in per_row], golds)
            grade_s.append(time.perf_counter() - t0)
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            n = _per_problem_generate(model, tokenizer, ids, SAMPLES, max_new)
            theirs.append(n / (time.perf_counter() - t0))
    # each repeat runs both back to back, so the median of the per-repeat ratios is less exposed to the
    # machine's drifts than the ratio of the two medians
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {
        "eval_tokens_per_s_ours": round(statistics.median(ours), 1),
        "eval_tokens_per_s_per_problem_generate": round(statistics.median(theirs), 1),
        "eval_batch_size_ours": batch_size,
        "eval_speedup_vs_per_problem_generate": round(statistics.median(ratios), 2),
        "eval_speedup_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "eval_sampling_s": round(statistics.median(sample_s), 2),
        "eval_grading_s": round(statistics.median(grade_s), 2),
        "eval_grading_over_sampling": round(
            statistics.median([g / t for g, t in zip(grade_s, sample_s, strict=True)]), 3
        ),
    }


def bench_attention() -> dict[str, float | str]:
    """Why the compact decoder attends with a C++ kernel: its sampling speed (tokens/s) with the kernel,
    with the same attention in eager torch ops, and with the torch-ops step compiled by ``torch.compile``
    (dynamic shapes: the batch shrinks and the cache grows every step), interleaved repeats on the testbed
    model; the compiler's warm-up (first call) is reported apart from the steady state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.eval.decode import CompactDecoder
    from sage.eval.decode_loop import CompactForward, sample_batch
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import heldout_rows

    path = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = [tokenizer(r["problem"], add_special_tokens=False)["input_ids"] for r in heldout_rows(PROBLEMS)]
    eos = torch.tensor([model.generation_config.eos_token_id])
    max_new, per_batch = 64, 8

    def tokens_per_s(decoder: CompactDecoder, seed: int) -> float:
        cache = decoder.cache(max_new, per_batch * SAMPLES)
        generator = torch.Generator().manual_seed(seed)
        n_tokens, t0 = 0, time.perf_counter()
        for start in range(0, len(ids), per_batch):
            chunk = ids[start : start + per_batch]
            _, lengths = sample_batch(
                CompactForward(decoder, cache),
                chunk,
                [SAMPLES] * len(chunk),
                max_new_tokens=max_new,
                temperature=1.0,
                top_p=1.0,
                eos=eos,
                pad_id=0,
                generator=generator,
            )
            n_tokens += int(lengths.sum())
        return n_tokens / (time.perf_counter() - t0)

    decoders = {
        "kernel": CompactDecoder(model, attention="kernel"),
        "torch": CompactDecoder(model, attention="torch"),
        "compiled": CompactDecoder(model, attention="torch"),
    }
    decoders["compiled"].step = torch.compile(decoders["compiled"].step, dynamic=True)
    t0 = time.perf_counter()
    tokens_per_s(decoders["compiled"], REPEATS)
    warmup = time.perf_counter() - t0
    for decoder in decoders.values():  # first-call costs (kernel load, cache pages) are not timed
        tokens_per_s(decoder, REPEATS)
    speed: dict[str, list[float]] = {name: [] for name in decoders}
    for seed in range(REPEATS):  # interleaved, so all three see the same background load
        for name, decoder in decoders.items():
            speed[name].append(tokens_per_s(decoder, seed))
    out: dict[str, float | str] = {
        f"attention_tokens_per_s_{name}": round(statistics.median(v), 1) for name, v in speed.items()
    }
    for name in ("torch", "compiled"):
        ratios = [a / b for a, b in zip(speed["kernel"], speed[name], strict=True)]
        out[f"attention_kernel_over_{name}"] = round(statistics.median(ratios), 3)
        out[f"attention_kernel_over_{name}_range"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
    out["attention_compile_warmup_s"] = round(warmup, 1)
    return out


def bench_vllm_seeding(repeats: int = VLLM_REPEATS) -> dict[str, float | str]:
    """Why the vLLM backend seeds the engine per block rather than each request: both ways on the same
    block (the tiny_chat model's ChatML prompts, about 180 tokens: 30 x 8 sequences do not fit one step's
    token budget, so prefills are split), two engines side by side, calls interleaved. Each way is checked
    to be reproducible (the same seed twice gives the same completions)."""

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from sage.eval.checkpoint import Checkpoint
    from sage.eval.sampling import SamplingSettings, VllmSampler, shutdown_engine, tokenize_prompts
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import heldout_rows

    path = build_tiny_model(chat=True, world="arith")
    ids = tokenize_prompts(AutoTokenizer.from_pretrained(path), heldout_rows(VLLM_PROMPTS), chat=True)
    memory = 0.1  # of the memory node, each: the two engines run side by side
    cfg = SimpleNamespace(vllm_tensor_parallel_size=1, vllm_cpu_memory_utilization=memory)
    engine_seeded = VllmSampler(Checkpoint.resolve(path), "float32", cfg)
    per_request = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=memory,
        enable_chunked_prefill=False,
    )

    def ours(seed: int) -> list[list[str]]:
        s = SamplingSettings(VLLM_SAMPLES, 1.0, 1.0, 64, chat=True, seed=seed)
        return engine_seeded.sample(ids, s).completions

    def seeded_requests(seed: int) -> list[list[str]]:
        # the old VllmSampler's seeds: vLLM seeds sample j of a request with seed + j
        params = [
            SamplingParams(
                n=VLLM_SAMPLES, temperature=1.0, max_tokens=64, seed=(seed * len(ids) + i) * VLLM_SAMPLES
            )
            for i in range(len(ids))
        ]
        out = per_request.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        return [[o.text for o in r.outputs] for r in out]

    ways = {"engine_seeded": ours, "per_request": seeded_requests}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    reproducible = dict.fromkeys(ways, True)
    try:
        for way in ways.values():  # first calls pay one-off costs
            way(repeats)
        for seed in range(repeats):
            for name, way in ways.items():
                t0 = time.perf_counter()
                first = way(seed)
                seconds[name].append(time.perf_counter() - t0)
                reproducible[name] &= way(seed) == first
    finally:
        engine_seeded.close()
        shutdown_engine(per_request)
    ratios = [p / e for p, e in zip(seconds["per_request"], seconds["engine_seeded"], strict=True)]
    return {
        "vllm_block_seconds_engine_seeded": round(statistics.median(seconds["engine_seeded"]), 2),
        "vllm_block_seconds_per_request_seeds": round(statistics.median(seconds["per_request"]), 2),
        "vllm_per_request_over_engine_seeded": round(statistics.median(ratios), 2),
        "vllm_per_request_over_engine_seeded_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "vllm_reproducible_engine_seeded": reproducible["engine_seeded"],
        "vllm_reproducible_per_request_seeds": reproducible["per_request"],
    }
