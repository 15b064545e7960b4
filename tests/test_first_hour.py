"""`make first-hour` (launchers/first_hour.py) as CI runs it: the paper path at 1M parameters
(model=tiny_chat) under 2-process torchrun with rollout=vllm, 2 steps and a tiny evaluation, read back
into its summary: a line per step and process with the rollout's, the hand-over's and the rest's times,
each process's peak memory, and each process evaluating its own blocks after the engines."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[1]


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
