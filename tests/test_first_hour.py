"""`make first-hour` (launchers/first_hour.py) as CI runs it: the paper path at 1M parameters
(model=tiny_chat) under 2-process torchrun with rollout=vllm, 2 steps and a tiny evaluation, read back
into its summary: a line per step and process with the rollout's, the hand-over's and the rest's times,
each process's peak memory, and each process evaluating its own blocks after the engines.

And its plan for a paper model on a node of 8 GPUs, composed here without running it (issue 46, item 4):
the SFT stage shrunk to one epoch of a few hundred rows, the evaluation shrunk and cut into a block per
process, the user's batch override passed through, each key once (a user's own value wins), and the
expected wall time printed before anything expensive starts."""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launchers.first_hour import (
    SFT_ROWS,
    SHORT,
    TINY,
    evaluation_size,
    first_hour_overrides,
    key_of,
    main,
)

REPO = Path(__file__).resolve().parents[1]
PAPER_7B = ["model=qwen2.5-math-7b", "trl=paper", "data=dapo_math_17k", "trl.gradient_accumulation_steps=8"]


@pytest.mark.slow
@pytest.mark.vllm
def test_first_hour_reports_times_memory_and_shares_per_process(tmp_path):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    r = subprocess.run(
        [sys.executable, "-m", "launchers.first_hour", "--processes", "2"],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    summary = r.stdout.split("first hour:", 1)[1]
    for step in (1, 2):
        for rank in (0, 1):
            assert re.search(
                rf"step {step}, process {rank}: rollout [\d.]+s, adapter hand-over [\d.]+s, rest [\d.]+s",
                summary,
            ), summary
    assert re.search(r"process 0: peak [\d.]+ GiB \(process RSS\)", summary)
    assert re.search(r"process 1: peak [\d.]+ GiB \(process RSS\)", summary)
    assert "every process evaluated its own blocks: yes process 0: 1 of 2" in summary, summary
    assert "process 1: 1 of 2" in summary


def test_a_run_whose_group_broke_is_reported():
    """The summary says NO when a process evaluated everything alone (the defect of a torn-down group)."""
    from launchers.first_hour import summary

    steps = "".join(
        f"step 1, process {rank}: rollout 1.00s, adapter hand-over 0.050s, rest 2.00s; "
        "peak memory 1.00 GiB (process RSS)\n"
        for rank in (0, 1)
    )
    alone = steps + "process 0 of 1: 2 of 2 blocks\nprocess 0 of 1: 2 of 2 blocks\n"
    lines, sound = summary(alone, 2, None)
    assert not sound and any(line.startswith("every process evaluated its own blocks: NO") for line in lines)
    sharded = steps + "process 0 of 2: 1 of 2 blocks\nprocess 1 of 2: 1 of 2 blocks\n"
    lines, sound = summary(sharded, 2, None)
    assert sound, lines


def test_the_plan_of_a_paper_model_on_8_gpus_shrinks_sft_and_evaluation(capsys, monkeypatch):
    """The README's command with --plan-only: the plan and the expected wall time are printed, and the
    sage-train command it would run has the SFT stage cut to one epoch of SFT_ROWS rows (Table 7's batch of
    one row: max_steps, since the hub data takes no size), the short evaluation sized for 8 processes, the
    user's accumulation and every key once."""
    from sage.eval.evaluate import problem_blocks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(["--processes", "8", "--plan-only", *PAPER_7B])
    out = capsys.readouterr().out
    assert "memory estimate per GPU: " in out, out
    assert "model.sft.args.max_steps=256 optimiser steps" in out, out
    assert re.search(
        r"^expected wall time: about \d+ min \(start ~[\d.]+ min, SFT ~[\d.]+ min, 2 RL steps ~[\d.]+ min, "
        r"evaluation ~[\d.]+ min\)$",
        out,
        re.M,
    ), out
    assert "expected wall time: an estimate, not a measurement, for an 80 GB GPU" in out
    assert "SFT 256 rows x ~1024 tokens on 1 process(es)" in out
    # the wall time line comes before the command: nothing has run when it is printed
    assert out.index("expected wall time: about") < out.index("would run: ")
    # Table 7's batch of one row: the SFT stage is built first on one process, as a grid's SFT job is
    (build,) = [line for line in out.splitlines() if line.startswith("would build ")]
    assert build.startswith(
        "would build the SFT stage first, as a job of its own on 1 process(es): its batch cannot use 8: "
        "torchrun --standalone --nproc_per_node=1 -m sage.train.main "
    ), build
    assert build.endswith("trl.max_steps=0 eval.at_end=false tracking.enabled=false")
    assert out.index("would build ") < out.index("would run: ")
    command = [line for line in out.splitlines() if line.startswith("would run: ")]
    assert len(command) == 1
    words = command[0].split()
    assert words[2:6] == ["torchrun", "--standalone", "--nproc_per_node=8", "-m"]
    overrides = words[words.index("sage.train.main") + 1 :]
    repeated = [k for k, n in Counter(map(key_of, overrides)).items() if n > 1]
    assert not repeated, overrides
    assert overrides[:4] == PAPER_7B
    for expected in (
        f"model.sft.args.max_steps={SFT_ROWS}",
        "model.sft.args.num_train_epochs=1",
        "rollout=vllm",
        "trl.max_steps=2",
        "eval.n_samples=256",
        "eval.ks=[1,256]",
        "eval.limit=29",
        "eval.seeds=[0]",
        "eval.max_new_tokens=8",
        "eval.perplexity_cap=0",
    ):
        assert expected in overrides, (expected, overrides)
    assert any(o.startswith("output_dir=outputs/first_hour/") for o in overrides)
    # every cell of the paper suite (aime 60, amc23 40, math500_l5 134, minerva 272) has a block per process
    for problems in (60, 40, 134, 272):
        assert len(problem_blocks(min(problems, 29), 256)) >= 8


def test_the_users_own_values_win_once():
    """A key the user names is theirs: the first hour adds none of its own for it (Hydra would take the
    last one), and shrinks the rest."""
    given = ["model=tiny_chat", "model.sft.data.n=50", "trl.max_steps=3", "eval.n_samples=64"]
    overrides = first_hour_overrides(given, 2)
    assert overrides[: len(given)] == given
    assert Counter(map(key_of, overrides)).most_common(1)[0][1] == 1, overrides
    assert "model.sft.args.num_train_epochs=1" in overrides
    # the user's 64 samples: the fewest problems that give each of 2 processes a block, ks within them
    assert "eval.limit=17" in overrides and "eval.ks=[1,64]" in overrides
    # the 7B model's SFT data takes no size: its rows are cut by max_steps, unless the user sets it
    mine = first_hour_overrides(["model=qwen2.5-math-7b", "model.sft.args.max_steps=10"], 8)
    assert [o for o in mine if key_of(o) == "model.sft.args.max_steps"] == ["model.sft.args.max_steps=10"]


def test_the_default_is_the_tiny_chat_path_ci_runs():
    assert first_hour_overrides([], 2) == TINY + SHORT


@pytest.mark.parametrize("processes", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("smallest", [None, 40, 200, 10_000])
def test_every_process_has_a_block_of_every_cell(processes, smallest):
    from sage.eval.evaluate import problem_blocks

    samples, limit = evaluation_size(processes, smallest)
    problems = limit if smallest is None else min(limit, smallest)
    assert len(problem_blocks(problems, samples)) >= max(processes, 2)
    if processes == 2:
        assert (samples, limit) == (32, 33)  # SHORT's
