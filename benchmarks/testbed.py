"""``make bench``'s sections that time sage-train and sage-eval runs of the testbed (``benchmarks.bench``
lists them): overhead (the guide's and the anchor metrics' share of a step), train (rollout=hf against
rollout=fast), run (a whole default run, cached and cold) and eval_processes (one evaluation by 1 and by 2
processes, each launched as ``python -m benchmarks.bench --eval-processes-worker``)."""

from __future__ import annotations

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

from benchmarks import REPO

OVERHEAD_STEPS, WARMUP_STEPS, OVERHEAD_PAIRS = 10, 2, 3
TRAIN_STEPS, TRAIN_PAIRS = 10, 3
SHARD_PROBLEMS, SHARD_SAMPLES, SHARD_PAIRS = 256, 32, 3


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
