"""``make bench`` (benchmarks/bench.py): its sections are the ones ``--only`` accepts, and the train section,
shrunk, times rollout=hf and rollout=fast in alternating runs and reports their ratio."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import REPO, bench, testbed


def test_only_names_every_section_and_refuses_others():
    assert list(bench.BENCHES) == [
        "eval",
        "attention",
        "overhead",
        "train",
        "run",
        "eval_processes",
        "vllm_seeding",
        "real_rollout",
        "engine",
    ]
    assert all(f"- {name}:" in bench.__doc__ for name in bench.BENCHES)
    command = [sys.executable, "-m", "benchmarks.bench", "--only", "train,nope"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "unknown bench ['nope']" in r.stderr and "'train'" in r.stderr


@pytest.mark.slow
def test_train_section_times_both_rollouts_in_alternating_runs(monkeypatch):
    runs = []
    sage_train = testbed._sage_train

    def recording(overrides, env=None):
        runs.append(overrides)
        return sage_train(overrides, env)

    monkeypatch.setattr(testbed, "_sage_train", recording)
    # small runs (2 prompts x 4 generations, short completions): what is checked is which runs the section
    # starts, in what order, and what it reports from their logs, not their speed
    shrink = ("trl.per_device_train_batch_size=8", "trl.num_generations=4", "model.max_completion_length=16")
    # one timed step per run, after the bench's warm-up steps
    out = testbed.bench_train(steps=testbed.WARMUP_STEPS + 1, pairs=2, overrides=shrink)
    chosen = [next(o for o in r if o.startswith("rollout=")) for r in runs]
    assert chosen == ["rollout=hf", "rollout=fast"] * 2
    assert all(set(shrink) <= set(r) and "eval.at_end=false" in r for r in runs)
    assert set(out) == {
        "train_step_seconds_hf",
        "train_step_seconds_fast",
        "train_step_speedup",
        "train_step_speedup_range",
        "train_completion_tokens_hf",
        "train_completion_tokens_fast",
    }
    assert out["train_step_seconds_hf"] > 0 and out["train_step_seconds_fast"] > 0
    low, high = (float(x) for x in out["train_step_speedup_range"].split("-"))
    assert 0 < low <= out["train_step_speedup"] <= high  # the median of the two pairs' ratios
    assert out["train_completion_tokens_hf"] > 0 and out["train_completion_tokens_fast"] > 0


@pytest.mark.slow
def test_eval_processes_section_times_one_and_two_process_evaluations(monkeypatch):
    launches = []
    run = testbed._eval_processes_run

    def recording(processes, problems):
        launches.append((processes, problems))
        return run(processes, problems)

    monkeypatch.setattr(testbed, "_eval_processes_run", recording)
    out = testbed.bench_eval_processes(pairs=1, problems=64)  # 64 x 32 samples: 2 blocks, one per process
    assert launches == [(1, 64), (2, 64)]
    one, two = out["eval_seconds_1_process"], out["eval_seconds_2_processes"]
    assert one > 0 and two > 0 and out["eval_1_over_2_processes"] == pytest.approx(one / two, abs=0.02)
    assert out["eval_cpu_seconds_1_process"] > 0 and out["eval_cpu_seconds_2_processes"] > 0
