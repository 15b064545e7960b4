"""``make bench`` (``python -m benchmarks.bench [--only <section>,...]`` from a clone's root, sections
below): speed and memory figures, printed as ``name: value`` lines. A development tool, not part of the
installed package: it times sage's internals (and wraps some of the trainer's methods to do so). Every
comparison is measured side by side in one run (medians over repeats where timing is noisy), since other
jobs share the machine's cores.

- eval: sampled tokens/s of our evaluator's sampler vs the authors' approach (one ``generate`` call per
  problem with num_return_sequences=n), same testbed model, problems, n and max length; and the time the
  evaluator's grading pool takes on those completions relative to sampling them (grading must not be the
  bottleneck);
- attention: the compact decoder's sampling speed with its C++ attention kernel, with eager torch ops and
  with the torch-ops step under ``torch.compile`` (the kernel stays only while neither comes within 10%);
- overhead: median TRL step time of ``guide=branch`` over ``guide=none`` (same seed), runs interleaved, and
  of ``guide=branch`` with the per-bucket anchor metrics (``tracking.anchor_buckets``) over without them;
- train: median testbed training step time with TRL's own ``generate`` (``rollout=hf``) and with the
  evaluator's compact sampler (``rollout=fast``), same seed, runs interleaved, and their ratio;
- run: wall time and peak RSS (process tree) of the default ``sage-train``, cached and cold base model;
- eval_processes: wall time of one evaluation (``evaluate_model``: sample, grade, merge, store) by 1 process
  and by 2 processes under ``torchrun`` (gloo), launches interleaved, and their ratio. Each process has
  one core to itself (pinned; one torch thread, OMP_NUM_THREADS=1, and one grading worker on that core), as
  each process of a GPU run has its own GPU and its own cores;
- real_rollout: the real 0.5B model's GRPO step (model=qwen2.5-coder-0.5b-instruct, LoRA, 8 MATH-500 prompts
  x 8 completions of at most REAL_TOKENS tokens) with ``rollout=hf`` (transformers' generate inside TRL) and
  ``rollout=vllm`` (the adapter served by vLLM's CPU build), each step split into the rollout and the rest,
  with the engine's CPU seconds per wall second while it decodes, and the loss passes' forward and backward
  with the trainer in bfloat16 (as trl=paper trains) against this machine's bfloat16 matrix-product limit;
- engine: the real 0.5B model's evaluation through vLLM in the dtype its engines serve in here
  (``model.engine_dtype=auto``), eager and compiled (``eval.vllm_compile``), as FLOP/s of the tokens it
  computes, beside the matrix-product limit this process measures in that dtype, and their ratio;
- vllm_seeding: seconds per block (30 prompts x 8 samples, ChatML prompts long enough that prefills are
  chunked) of the vLLM CPU build with seeds per request (chunked prefill off: on, it stops with "CPU
  Generator does not use offset") and with the engine seeded per block (``VllmSampler``), interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]

PROBLEMS, SAMPLES, REPEATS = 40, 64, 7
OVERHEAD_STEPS, WARMUP_STEPS, OVERHEAD_PAIRS = 10, 2, 3
TRAIN_STEPS, TRAIN_PAIRS = 10, 3
SHARD_PROBLEMS, SHARD_SAMPLES, SHARD_PAIRS = 256, 32, 3
VLLM_PROMPTS, VLLM_SAMPLES, VLLM_REPEATS = 30, 8, 5
# 8 prompts x 8 completions (trl=paper's step) of at most 32 tokens: every step also runs three passes of
# the 0.5B model over 64 sequences (old and reference log-probs, the loss with its backward), which on two
# cores take minutes, so the length is kept short; 2 steps, the first a warm-up (the figures are the second's)
# One step per backend: its rollout is the only work that differs, and TRL's log-prob passes and backward
# over 64 sequences of the 0.5B model make each step minutes long on a CPU. vLLM's engine has
# run a forward pass when it is built (it sizes its KV cache from one), so the first step is not a warm-up.
REAL_PROMPTS, REAL_GENERATIONS, REAL_TOKENS, REAL_STEPS = 8, 8, 32, 1
ENGINE_PROMPTS, ENGINE_SAMPLES, ENGINE_TOKENS = 30, 8, 128  # the block issue 46 measured: 30 problems x 8


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

    from sage.eval.decode import CompactDecoder, CompactForward, sample_batch
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


def _sage_train(overrides: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run ``python -m sage.train``; returns (wall seconds, peak RSS of the process tree in GB), polling
    the RSS of the process and all its children (the grading/tokenizer workers count too)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sage.train", *overrides],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass  # a child exited between listing and reading: the next poll sees the tree again
        time.sleep(0.2)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"sage-train {' '.join(overrides)} failed: {stderr[-2000:]}")
    return time.perf_counter() - t0, peak / 1e9


def _median_per_step(out: Path, key: str = "step_time") -> float:
    """Median of a per-step figure of a run's log, over the steps after the first WARMUP_STEPS."""
    log = json.loads((out / "train_log.json").read_text())
    times = [e[key] for e in log if key in e and e["step"] > WARMUP_STEPS]
    return statistics.median(times)


def _interleaved_medians(
    runs: dict[str, list[str]], pairs: int, steps: int, keys: tuple[str, ...] = ("step_time",)
) -> dict[str, dict[str, list[float]]]:
    """Each named run's per-step medians of ``keys`` (``runs``: name -> its overrides), once per pair, the
    runs of a pair one after the other so that drifts in machine speed hit every name alike."""
    medians = {name: {key: [] for key in keys} for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            for name, overrides in runs.items():
                out = Path(tmp) / f"{name}-{pair}"
                _sage_train(
                    [f"trl.max_steps={steps}", "eval.at_end=false", "seed=0", f"output_dir={out}", *overrides]
                )
                for key in keys:
                    medians[name][key].append(_median_per_step(out, key))
    return medians


def bench_overhead() -> dict[str, float]:
    """Runs alternate none, branch, none, branch, ... so that drifts in machine speed hit both alike; the
    ratio is the median of the per-pair ratios of median step times."""
    runs = {guide: [f"guide={guide}"] for guide in ("none", "branch")}
    measured = _interleaved_medians(runs, OVERHEAD_PAIRS, OVERHEAD_STEPS)
    medians = {guide: m["step_time"] for guide, m in measured.items()}
    ratios = [b / n for n, b in zip(medians["none"], medians["branch"], strict=True)]
    # where the anchor acts (tracking.anchor_buckets, on by default): the Branch run with it against without
    buckets = {
        name: ["guide=branch", f"tracking.anchor_buckets={on}"]
        for name, on in (("off", "false"), ("on", "true"))
    }
    timed = _interleaved_medians(buckets, OVERHEAD_PAIRS, OVERHEAD_STEPS)
    bucket_ratios = [
        on / off for off, on in zip(timed["off"]["step_time"], timed["on"]["step_time"], strict=True)
    ]
    return {
        "step_time_s_guide_none": round(statistics.median(medians["none"]), 4),
        "step_time_s_guide_branch": round(statistics.median(medians["branch"]), 4),
        "sage_overhead_ratio": round(statistics.median(ratios), 3),
        "anchor_buckets_overhead_ratio": round(statistics.median(bucket_ratios), 3),
    }


def bench_train(
    steps: int = TRAIN_STEPS, pairs: int = TRAIN_PAIRS, overrides: tuple[str, ...] = ()
) -> dict[str, float]:
    """The default testbed run's training step (generation, grading, the loss passes and the update: TRL's
    ``step_time``) with ``rollout=hf`` and ``rollout=fast``. Runs alternate hf, fast, hf, ... so that drifts
    in machine speed hit both alike; the speedup is the median of the per-pair ratios of median step
    times. Each run's median completion length is reported too: the two samplers draw different
    completions, and a speedup bought with shorter ones would show there. ``overrides`` shrink the runs
    (the tests)."""
    # timing runs are not experiments: no MLflow run
    runs = {r: [f"rollout={r}", "tracking.enabled=false", *overrides] for r in ("hf", "fast")}
    keys = ("step_time", "completions/mean_length")
    measured = _interleaved_medians(runs, pairs, steps, keys)
    medians = {r: m["step_time"] for r, m in measured.items()}
    lengths = {r: m["completions/mean_length"] for r, m in measured.items()}
    ratios = [h / f for h, f in zip(medians["hf"], medians["fast"], strict=True)]
    return {
        "train_step_seconds_hf": round(statistics.median(medians["hf"]), 4),
        "train_step_seconds_fast": round(statistics.median(medians["fast"]), 4),
        "train_step_speedup": round(statistics.median(ratios), 2),
        "train_step_speedup_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "train_completion_tokens_hf": round(statistics.median(lengths["hf"]), 1),
        "train_completion_tokens_fast": round(statistics.median(lengths["fast"]), 1),
    }


def bench_run() -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # cached: the default cache (built there first if needed, outside the timing)
        from sage.testbed.model import build_tiny_model

        build_tiny_model()
        wall, peak = _sage_train([f"output_dir={Path(tmp) / 'cached'}"])
        out["run_cached_s"], out["peak_rss_gb_cached"] = round(wall, 1), round(peak, 2)
        wall, peak = _sage_train(
            [f"output_dir={Path(tmp) / 'cold'}"], env={"SAGE_CACHE_DIR": str(Path(tmp) / "c")}
        )
        out["run_cold_s"], out["peak_rss_gb"] = round(wall, 1), round(peak, 2)
    out["peak_rss_gb"] = max(out["peak_rss_gb"], out.pop("peak_rss_gb_cached"))
    return out


def _eval_processes_worker(result: Path, problems: int) -> None:
    """One process of ``bench_eval_processes``' evaluation (alone, or under torchrun): a first evaluation to
    warm up (the model's load, the attention kernel, the grading pool's workers), then the timed one, from
    a barrier to a barrier; the main process writes its wall time to ``result``."""
    from types import SimpleNamespace

    from sage import distributed
    from sage.eval.evaluate import evaluate_model
    from sage.grading import GradingPool
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import heldout_rows

    # One core per process, its grading worker included (children inherit the affinity): as each process of
    # a GPU run has its own GPU and its own cores. Unpinned, a lone process would grade on the core that its
    # second would sample on, and the 1-process run would borrow what the 2-process run splits.
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})
    distributed.init(timeout_s=1800)
    model = build_tiny_model()
    rows = {"heldout": heldout_rows(problems)}
    cfg = SimpleNamespace(
        n_samples=SHARD_SAMPLES, ks=[1], seeds=[0], temperature=1.0, top_p=1.0, batch_size=1024, backend="hf"
    )
    # one grading worker: each process has one core to itself, for its sampling and its grading alike
    with tempfile.TemporaryDirectory() as tmp, GradingPool(workers=1) as pool:
        # the main process's folder: the others write nothing
        cells = Path(distributed.broadcast(tmp))

        def evaluate(name: str, seed: int, limit: int) -> tuple[float, float]:
            distributed.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            evaluate_model(
                model,
                {k: v[:limit] for k, v in rows.items()},
                SimpleNamespace(**{**cfg.__dict__, "seeds": [seed]}),
                chat=False,
                max_new_tokens=64,
                results_dir=cells / name,
                dtype="float32",
                pool=pool,
            )
            cpu = time.process_time() - cpu0  # before the barrier: this process's own work
            distributed.barrier()
            return time.perf_counter() - t0, cpu

        evaluate("warm-up", 1, 64)
        wall, cpu = evaluate("timed", 0, problems)
        cpus = distributed.gather(cpu)
    if distributed.is_main():
        result.write_text(json.dumps({"seconds": wall, "cpu_seconds": sum(cpus)}))


def _eval_processes_run(processes: int, problems: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the evaluating processes, grading workers not counted)."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        r = subprocess.run(
            [
                *launcher,
                "-m",
                "benchmarks.bench",
                "--eval-processes-worker",
                str(result),
                "--problems",
                str(problems),
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            cwd=REPO,  # the module is found from the clone's root, as `make bench` runs it
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"the {processes}-process evaluation failed: {r.stderr[-3000:]}")
        measured = json.loads(result.read_text())
        return measured["seconds"], measured["cpu_seconds"]


def bench_eval_processes(pairs: int = SHARD_PAIRS, problems: int = SHARD_PROBLEMS) -> dict[str, float | str]:
    """The end-of-run evaluation's wall time by 1 and by 2 processes (each samples and grades its blocks,
    the main process merges and stores), launches alternating 1, 2, 1, 2, ... so that drifts in machine
    speed hit both alike; the ratio is the median of the per-pair ratios. ``problems`` x SHARD_SAMPLES
    sequences (8 blocks at the default): fewer shrink the runs (the tests). The CPU seconds of the
    evaluating processes show whether the work is split without overhead when other jobs take cores and
    hold the wall-time ratio down."""
    from sage.testbed.model import build_tiny_model

    build_tiny_model()  # built outside the timing
    one, two = [], []
    for _ in range(pairs):
        one.append(_eval_processes_run(1, problems))
        two.append(_eval_processes_run(2, problems))
    ratios = [a[0] / b[0] for a, b in zip(one, two, strict=True)]
    return {
        "eval_seconds_1_process": round(statistics.median(w for w, _ in one), 2),
        "eval_seconds_2_processes": round(statistics.median(w for w, _ in two), 2),
        "eval_1_over_2_processes": round(statistics.median(ratios), 2),
        "eval_1_over_2_processes_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "eval_cpu_seconds_1_process": round(statistics.median(c for _, c in one), 2),
        "eval_cpu_seconds_2_processes": round(statistics.median(c for _, c in two), 2),
    }


def bench_vllm_seeding(repeats: int = VLLM_REPEATS) -> dict[str, float | str]:
    """Why the vLLM backend seeds the engine per block rather than each request: both ways on the same
    block (the tiny_chat model's ChatML prompts, about 180 tokens: 30 x 8 sequences do not fit one step's
    token budget, so prefills are split), two engines side by side, calls interleaved. Each way is checked
    to be reproducible (the same seed twice gives the same completions)."""
    from types import SimpleNamespace

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


def _others_cpu_seconds(own: list[psutil.Process]) -> float:
    """CPU seconds the machine has been busy, bar those of the processes ``own``."""
    busy = psutil.cpu_times()
    return busy.user + busy.system + getattr(busy, "nice", 0.0) - _cpu_seconds(own)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def trainer_precision() -> dict:
    """The real-model step's GRPOConfig precision keys: as ``trl=paper`` trains a paper model on the cluster
    (the frozen base in bfloat16 under bf16 autocast), here under the CPU's bfloat16 autocast
    (``sage.trl_checks.cpu_precision``) where this machine computes bfloat16; float32 where it does not
    (``real_trainer_dtype`` says which)."""
    from omegaconf import OmegaConf

    from sage.models import policy_dtype
    from sage.trl_checks import cpu_precision

    if not trainer_computes_bfloat16():
        return {"bf16": False}
    # the paper's models: a bfloat16 checkpoint whose frozen base LoRA keeps in bfloat16 (model.dtype)
    frozen = policy_dtype("bfloat16", lora=True)
    return {
        "bf16": True,
        "model_init_kwargs": {"dtype": frozen},
        **cpu_precision(OmegaConf.create({"bf16": True}), "trl"),
    }


def trainer_computes_bfloat16() -> bool:
    from sage.config import cpu_computes_bfloat16

    return torch.cuda.is_available() or cpu_computes_bfloat16()


def _matrix_params(arch) -> int:
    """Parameters of a Qwen2-style model's matrix products per token (attention's projections, the MLP's
    three, and the output layer): a forward pass costs 2 FLOPs per such parameter per token."""
    hidden, inner, layers = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    kv = arch.num_key_value_heads * (hidden // arch.num_attention_heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner
    return layers * per_layer + hidden * arch.vocab_size


def _gemm_limit(dtype: torch.dtype, rows: int, arch) -> float:
    """This process's matrix-product limit in ``dtype``: the best of the model's widest layer (hidden x
    intermediate) at ``rows`` rows and a square product of 2048."""
    return max(
        _gemm_flops(dtype, rows, arch.hidden_size, arch.intermediate_size),
        _gemm_flops(dtype, 2048, 2048, 2048),
    )


def _real_step_times(
    rollout: str, model: str, dataset, steps: int, tokens: int, served: dict
) -> dict[str, list[float]]:
    """Per optimiser step of one ``rollout`` ("hf" or "vllm"): the step's wall seconds, its rollout's (the
    generation, and for vllm the adapter hand-over apart), and CPU seconds per wall second during the
    rollout of this process and of the engine's processes."""
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from sage.objective.divergences import NoDivergence
    from sage.objective.guides import NoGuide
    from sage.train.trl_import import import_grpo_trainer

    import_grpo_trainer(use_vllm=rollout == "vllm")
    from sage.train.trainer import SageGRPOTrainer
    from sage.train.vllm_rollout import VllmRollout

    times: dict[str, list[float]] = {
        "step": [],
        "rollout": [],
        "handover": [],
        "cpu_per_wall": [],
        "others_cpu_per_wall": [],
        "forward": [],
        "backward": [],
        "loss_tokens": [],
        "engine_cpu_per_wall_in_loss": [],
    }
    # per step: the loss passes' seconds, the engine's CPU seconds meanwhile, and the tokens they computed
    parts = {"forward": 0.0, "backward": 0.0, "engine_cpu": 0.0, "loss_tokens": 0.0}
    available: list[int] = []  # the machine's available memory after each loss pass
    me, engine = psutil.Process(), []
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=REAL_GENERATIONS,  # one prompt's group per forward pass
            gradient_accumulation_steps=REAL_PROMPTS,  # so one step generates 8 prompts x 8 completions
            num_generations=REAL_GENERATIONS,
            max_completion_length=tokens,
            # no reference pass: it is the same work under both backends, and it is not what is compared
            beta=0.0,
            use_bias_correction_kl=False,
            learning_rate=1e-5,
            max_steps=steps,
            save_strategy="no",
            report_to="none",
            logging_steps=1,
            gradient_checkpointing=False,
            temperature=0.7,
            seed=0,
            **trainer_precision(),
        )
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
        rollout_func = None
        if rollout == "vllm":
            # as sage-train builds it under rollout=vllm (conf/rollout/vllm.yaml): its dtype and memory share
            rollout_func = VllmRollout(
                args,
                lora,
                dtype=served["dtype"],
                engine_dtype=served["engine_dtype"],
                cpu_memory_utilization=served["cpu_memory_utilization"],
            )

        class Steps(TrainerCallback):
            """Each step's wall seconds, and the CPU seconds per wall second that processes other than this
            one and its engine took meanwhile: a step that shared the cores is seen to have shared them."""

            def on_step_begin(self, args, state, control, **kwargs):
                if not hasattr(self, "started"):
                    self.started, self.others = time.perf_counter(), _others_cpu_seconds([me, *engine])

            def on_step_end(self, args, state, control, **kwargs):
                now, others = time.perf_counter(), _others_cpu_seconds([me, *engine])
                times["step"].append(now - self.started)
                passes = parts["forward"] + parts["backward"]
                times["engine_cpu_per_wall_in_loss"].append(parts["engine_cpu"] / max(passes, 1e-9))
                for part in parts:
                    if part != "engine_cpu":
                        times[part].append(parts[part])
                    parts[part] = 0.0
                times["others_cpu_per_wall"].append((others - self.others) / (now - self.started))
                self.started, self.others = now, others

        before = {c.pid for c in psutil.Process().children(recursive=True)}
        trainer = SageGRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [float(len(str(c)) % 5) for c in completions]],
            args=args,
            train_dataset=dataset,
            peft_config=lora,
            divergence=NoDivergence(),
            guide=NoGuide(),
            callbacks=[Steps()],
            rollout_func=rollout_func,
        )
        engine += [c for c in me.children(recursive=True) if c.pid not in before]  # vLLM's processes
        generate = rollout_func.__call__ if rollout == "vllm" else trainer._generate_single_turn

        def timed(*a, **kw):
            t0, cpu0, engine0 = time.perf_counter(), me.cpu_times(), _cpu_seconds(engine)
            out = generate(*a, **kw)
            wall = time.perf_counter() - t0
            cpu1 = me.cpu_times()
            cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system + _cpu_seconds(engine) - engine0
            times["rollout"].append(wall)
            times["cpu_per_wall"].append(cpu / wall)
            return out

        if rollout == "vllm":  # TRL hands the adapter over (sync_weights), then calls rollout_func
            trainer.rollout_func = timed
            sync = rollout_func.sync_weights

            def timed_sync():
                t0 = time.perf_counter()
                sync()
                times["handover"].append(time.perf_counter() - t0)

            trainer.vllm_generation = SimpleNamespace(sync_weights=timed_sync)
        else:
            trainer._generate_single_turn = timed
        # the rest of the step, split: the loss passes' forward and their backward (what both backends
        # should spend alike), and the completions' mean length (the same work needs the same lengths)
        for name, owner in (("forward", trainer), ("backward", trainer.accelerator)):
            method = getattr(owner, "compute_loss" if name == "forward" else "backward")

            def timed_part(*a, _method=method, _name=name, **kw):
                if _name == "forward":  # compute_loss(model, inputs): the rows as padded
                    inputs = a[1]
                    parts["loss_tokens"] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
                t0, engine0 = time.perf_counter(), _cpu_seconds(engine)
                try:
                    return _method(*a, **kw)
                finally:
                    parts[_name] += time.perf_counter() - t0
                    parts["engine_cpu"] += _cpu_seconds(engine) - engine0
                    available.append(psutil.virtual_memory().available)

            setattr(owner, "compute_loss" if name == "forward" else "backward", timed_part)
        try:
            trainer.train()
        finally:
            if rollout_func is not None:
                rollout_func.close()
        times["available_gib_in_loss"] = [min(available) / 2**30] if available else []
        times["completion_length"] = [
            h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
        ]
    return times


def _real_model():
    """(the composed config of the real 0.5B model under rollout=vllm, its converted folder)."""
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.models import from_package_gguf
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=qwen2.5-coder-0.5b-instruct", "rollout=vllm"])
    return cfg, from_package_gguf(list(cfg.model.source.packages), cfg.model.source.sha256)


def _real_backend(backend: str, steps: int, tokens: int) -> dict[str, list[float]]:
    """``_real_step_times`` of one backend on the real model and the bench's prompts (run in a process of
    its own by :func:`bench_real_rollout`)."""
    from datasets import Dataset

    from sage.data.benchmarks import math_data
    from sage.data.prompts import make_prompt

    cfg, model = _real_model()
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()]
    easy = sorted((r for r in rows if r.get("level") == 1), key=lambda r: len(r["problem"]))[:REAL_PROMPTS]
    dataset = Dataset.from_list(
        [{"prompt": make_prompt(r["problem"], True), "answer": r["answer"]} for r in easy]
    )
    r = cfg.rollout_func
    engine = {
        "dtype": str(r.dtype),
        "engine_dtype": str(r.engine_dtype),
        "cpu_memory_utilization": float(r.cpu_memory_utilization),
    }
    return _real_step_times(backend, model, dataset, steps, tokens, engine)


def bench_real_rollout(steps: int = REAL_STEPS, tokens: int = REAL_TOKENS) -> dict[str, float | str]:
    """The real 0.5B model's GRPO step with each rollout backend, each in a fresh process of its own (so
    that neither inherits the other's allocator, threads or imports), on the same prompts (the shortest
    level-1 MATH-500 problems), group size, length and seed; medians over the steps. ``rest`` is the step
    without its rollout and hand-over: the scoring, the loss passes' forward and backward (printed apart,
    with the engine's CPU seconds per wall second meanwhile) and the optimiser. It is the same work for
    both: under rollout=vllm the importance-sampling correction's ratio comes from the training forward
    (one generation batch per optimiser step), not from TRL's extra log-prob pass over the rollouts
    (sage.train.trainer). The trainer computes as ``trl=paper`` does (:func:`trainer_precision`); its loss
    passes' rate counts 2 FLOPs per matrix parameter per token they compute (the rows as padded), for the
    backward as for the forward (the input gradients through the frozen base; the LoRA factors' own are a
    small fraction), beside the matrix-product limit this process measures in the trainer's dtype."""
    from transformers import AutoConfig

    bf16 = trainer_computes_bfloat16()
    arch = AutoConfig.from_pretrained(_real_model()[1])
    dtype = torch.bfloat16 if bf16 else torch.float32
    limit = _gemm_limit(dtype, 1024, arch)
    out: dict[str, float | str] = {
        "real_rollout_shape": f"{REAL_PROMPTS} prompts x {REAL_GENERATIONS} completions x <= {tokens} tokens",
        "real_trainer_dtype": "bfloat16 (bf16 autocast, the frozen base in bfloat16)"
        if bf16
        else "float32 (this machine has no bfloat16 arithmetic)",
        "real_trainer_gemm_limit_gflops": round(limit / 1e9, 1),
    }
    medians = {}
    for backend in ("hf", "vllm"):
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.bench",
                    "--real-backend",
                    backend,
                    "--real-out",
                    result.name,
                    "--real-steps",
                    str(steps),
                    "--real-tokens",
                    str(tokens),
                ],
                check=True,
                cwd=REPO,
            )
            times = json.loads(Path(result.name).read_text())
        m = {k: statistics.median(v) for k, v in times.items() if v}
        m.setdefault("handover", 0.0)
        rest = m["step"] - m["rollout"] - m["handover"]
        medians[backend] = m
        out[f"real_step_seconds_{backend}"] = round(m["step"], 1)
        out[f"real_rollout_seconds_{backend}"] = round(m["rollout"], 1)
        out[f"real_rest_seconds_{backend}"] = round(rest, 1)
        out[f"real_loss_forward_seconds_{backend}"] = round(m["forward"], 1)
        out[f"real_loss_backward_seconds_{backend}"] = round(m["backward"], 1)
        flops = 2 * _matrix_params(arch) * m["loss_tokens"]
        for part in ("forward", "backward"):
            out[f"real_loss_{part}_gflops_{backend}"] = round(flops / m[part] / 1e9, 1)
            out[f"real_loss_{part}_over_gemm_limit_{backend}"] = round(flops / m[part] / limit, 2)
        out[f"real_completion_mean_length_{backend}"] = round(m["completion_length"], 1)
        out[f"real_available_gib_in_loss_{backend}"] = round(m["available_gib_in_loss"], 1)
        out[f"real_rollout_cpu_per_wall_{backend}"] = round(m["cpu_per_wall"], 2)
        out[f"real_step_others_cpu_per_wall_{backend}"] = round(m["others_cpu_per_wall"], 2)
    out["real_engine_cpu_per_wall_in_loss_vllm"] = round(medians["vllm"]["engine_cpu_per_wall_in_loss"], 2)
    out["real_handover_seconds_vllm"] = round(medians["vllm"]["handover"], 3)
    out["real_rollout_hf_over_vllm"] = round(medians["hf"]["rollout"] / medians["vllm"]["rollout"], 2)
    out["real_step_hf_over_vllm"] = round(medians["hf"]["step"] / medians["vllm"]["step"], 2)
    out["cores"] = len(os.sched_getaffinity(0))
    return out


def _gemm_flops(dtype: torch.dtype, rows: int, inner: int, cols: int, repeats: int = 7) -> float:
    """Median FLOP/s of ``(rows x inner) @ (inner x cols)`` in ``dtype`` on this process's threads."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
    for _ in range(2):  # the first products pay for the kernels' selection and the pages' first touch
        a @ b
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - t0)
    return 2 * rows * inner * cols / statistics.median(seconds)


def bench_engine(prompts: int = ENGINE_PROMPTS, samples: int = ENGINE_SAMPLES) -> dict[str, float | str]:
    """The real 0.5B model's evaluation through vLLM's engine in the dtype it serves in here
    (``model.engine_dtype=auto``: bfloat16 on a CPU with bfloat16 arithmetic), beside this machine's
    matrix-product limit in that dtype; run eager, then compiled (``eval.vllm_compile``, which a real model's
    evaluation gets by default), one engine after the other. The limit is the best of two products timed in
    this process on its cores: the model's widest layer (896 x 4864) at the decode batch's rows, and a
    square one of 2048. The evaluation's rate counts every token the engine computes (each prompt's prefill
    once, since vLLM shares a prompt's cache among its samples, and every sampled token) at 2 x the model's
    matrix parameters in FLOPs per token; ``engine_over_gemm_limit`` is that rate over the limit, for the
    engine as sage-eval builds it, and ``engine_start_seconds`` its build, compilation and first block."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from sage.config import engine_dtype, register_configs
    from sage.data.benchmarks import math_data
    from sage.eval.checkpoint import Checkpoint
    from sage.eval.sampling import SamplingSettings, VllmSampler, compiles, tokenize_prompts
    from sage.models import from_package_gguf
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=qwen2.5-coder-0.5b-instruct", "eval.backend=vllm"])
    dtype = engine_dtype(str(cfg.model.engine_dtype), str(cfg.model.dtype))
    path = from_package_gguf(list(cfg.model.source.packages), cfg.model.source.sha256)
    arch = AutoConfig.from_pretrained(path)
    matrix_params = _matrix_params(arch)
    limit = _gemm_limit(getattr(torch, dtype), prompts * samples, arch)
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()][:prompts]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenize_prompts(tokenizer, rows, chat=True)
    checkpoint = Checkpoint.resolve(path)
    default = compiles(checkpoint, cfg.eval.vllm_compile)
    out: dict[str, float | str] = {
        "engine_dtype": dtype,
        "engine_shape": f"{prompts} MATH-500 prompts x {samples} samples x <= {ENGINE_TOKENS} tokens",
        "engine_compiled_by_default": default,
        "gemm_limit_gflops": round(limit / 1e9, 1),
    }
    for compiled in (False, True):
        started = time.perf_counter()
        eval_cfg = OmegaConf.merge(cfg.eval, {"vllm_compile": compiled})
        sampler = VllmSampler(checkpoint, dtype, eval_cfg)  # as sage-eval builds it
        try:
            settings = SamplingSettings(samples, 1.0, 1.0, ENGINE_TOKENS, chat=True, seed=0)
            sampler.sample(ids[:2], SamplingSettings(2, 1.0, 1.0, 8, chat=True, seed=0))  # one-off costs
            start_seconds = time.perf_counter() - started
            t0 = time.perf_counter()
            sampled = sampler.sample(ids, settings).n_tokens  # every sampled token, the end token included
            wall = time.perf_counter() - t0
        finally:
            sampler.close()
        achieved = 2 * matrix_params * (sum(len(x) for x in ids) + sampled) / wall
        way = "" if compiled == default else "_eager" if not compiled else "_compiled"
        out |= {
            f"engine{way}_start_seconds": round(start_seconds, 1),
            f"engine{way}_sampled_tokens_per_second": round(sampled / wall, 1),
            f"engine{way}_gflops": round(achieved / 1e9, 1),
            f"engine{way}_over_gemm_limit": round(achieved / limit, 2),
        }
    return out | {"cores": len(os.sched_getaffinity(0))}


BENCHES = {
    "eval": bench_eval,
    "attention": bench_attention,
    "overhead": bench_overhead,
    "train": bench_train,
    "run": bench_run,
    "eval_processes": bench_eval_processes,
    "vllm_seeding": bench_vllm_seeding,
    "real_rollout": bench_real_rollout,
    "engine": bench_engine,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(BENCHES), help=f"comma-separated subset of {list(BENCHES)}"
    )
    parser.add_argument("--eval-processes-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--problems", type=int, default=SHARD_PROBLEMS, help=argparse.SUPPRESS)
    parser.add_argument("--real-backend", choices=("hf", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--real-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--real-steps", type=int, default=REAL_STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--real-tokens", type=int, default=REAL_TOKENS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real_backend is not None:  # one backend of bench_real_rollout, in a process of its own
        times = _real_backend(args.real_backend, args.real_steps, args.real_tokens)
        args.real_out.write_text(json.dumps(times))
        return
    if args.eval_processes_worker is not None:  # one process of bench_eval_processes' launches
        _eval_processes_worker(args.eval_processes_worker, args.problems)
        return
    chosen = args.only.split(",")
    unknown = [c for c in chosen if c not in BENCHES]
    if unknown:
        parser.error(f"--only: unknown bench {unknown}; choose from {list(BENCHES)}")
    for name in chosen:
        for key, value in BENCHES[name]().items():
            print(f"{key}: {value}", flush=True)


if __name__ == "__main__":
    main()
