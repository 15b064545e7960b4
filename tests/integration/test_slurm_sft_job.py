"""On a real SLURM cluster (scripts/slurm_cluster.sh), a grid whose jobs start from an SFT stage the cache
lacks submits that stage as one job of its own first, and its jobs with a dependency on it (``afterok``):
neither starts before it ends and the stage is built once (issue 55). A failed SFT job ends the grid in
one line with no RL job run; with the stage cached, no SFT job is submitted."""

from __future__ import annotations

import subprocess
from datetime import datetime

import pytest
from sft_job_args import QUICK_RL, SMALL_SFT, new_stage
from slurm_support import final_states, job_folders, slurm_jobs, sweep


def sacct(env: dict[str, str], job_id: str, fields: str) -> list[list[str]]:
    """sacct's rows (-X: the allocations, not their steps) of a job or an array, split on |."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", fields],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def when(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.integration
def test_a_grid_submits_its_sft_stage_first_and_its_jobs_after_it(slurm_cluster, tmp_path):
    """Cold cache: 3 jobs (the SFT job and a 2-task array that depends on it); the array's tasks start after
    the SFT job ends, and only the SFT job trains the stage. The same grid again: the stage is cached, so no
    SFT job."""
    stage = [*SMALL_SFT, new_stage()]
    sweep_dir = tmp_path / "cold"
    rc, log = sweep(
        slurm_cluster,
        "hydra/launcher=slurm",
        *stage,
        "seed=1,2",
        *QUICK_RL,
        f"hydra.sweep.dir={sweep_dir}",
        # the driver sees a job start only at a poll: at the default (30 s) a quick RL job can start and end
        # between two, and is then reported ended with no start line (launchers/submitit.py::_collect)
        "hydra.launcher.status_poll_max_s=1",
        timeout=900,
    )
    assert rc == 0, log[-4000:]
    sft_id, array = sorted(slurm_jobs(sweep_dir), key=int)  # submitted first, so its id is the lower
    assert f"sft: job {sft_id} builds the SFT stage of model=tiny_chat" in log, log[-4000:]
    final_states(slurm_cluster, array)  # a task whose result is in may still be RUNNING for a moment
    ((_, sft_state, sft_end),) = sacct(slurm_cluster, sft_id, "JobID,State,End")
    tasks = sacct(slurm_cluster, array, "JobID,State,Start")
    assert sft_state == "COMPLETED" and len(tasks) == 2, (sft_state, tasks)
    for _, state, start in tasks:
        assert state == "COMPLETED" and when(start) >= when(sft_end), (sft_end, tasks)
    # the dependency, as submitit asked the scheduler for it
    scripts = [p.read_text() for p in (sweep_dir / ".submitit").rglob("*.sh")]
    assert any(f"#SBATCH --dependency=afterok:{sft_id}" in text for text in scripts), scripts
    # built once, by the SFT job; each RL job found it in the cache
    (sft_folder,) = (sweep_dir / ".sft").iterdir()
    assert "SFT stage trained on 1 process(es)" in (sft_folder / "main.log").read_text()
    assert len(job_folders(sweep_dir)) == 2
    for job in job_folders(sweep_dir):
        main_log = (job / "main.log").read_text()
        assert "SFT stage already done" in main_log and "SFT stage trained" not in main_log
    # a line per job as it started (with its node) and as it ended
    assert log.count("] started on ") == 2 and log.count("] COMPLETED after ") == 2, log[-4000:]

    warm = tmp_path / "warm"
    rc, log = sweep(
        slurm_cluster,
        "hydra/launcher=slurm",
        *stage,
        "seed=1,2",
        *QUICK_RL,
        f"hydra.sweep.dir={warm}",
        timeout=600,
    )
    assert rc == 0, log[-4000:]
    assert "builds the SFT stage" not in log and not (warm / ".sft").exists()
    assert len(slurm_jobs(warm)) == 1  # the grid's array alone


@pytest.mark.integration
def test_a_failed_sft_job_ends_the_grid_in_one_line_and_no_rl_job_runs(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "failing"
    # no SFT row fits 8 tokens: the stage fails inside its job, after the config checks
    failing = [*SMALL_SFT, "model.sft.args.max_length=8", new_stage()]
    rc, log = sweep(
        slurm_cluster,
        "hydra/launcher=slurm",
        *failing,
        "seed=1,2",
        *QUICK_RL,
        f"hydra.sweep.dir={sweep_dir}",
        timeout=600,
    )
    assert rc == 1, log[-4000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: the SFT job ") and "; its 2 dependent job(s) did not run" in last, log[
        -4000:
    ]
    assert "no SFT row fits" in last
    sft_id, array = sorted(slurm_jobs(sweep_dir), key=int)
    # the scheduler itself counts the SFT job failed, so the afterok jobs are cancelled without the driver
    assert final_states(slurm_cluster, sft_id) == {sft_id: "FAILED"}
    tasks = sacct(slurm_cluster, array, "JobID,State,Start")
    # an array cancelled before any task ran is one row (<id>_[0-1...]) in sacct
    assert tasks and all(state.startswith("CANCELLED") for _, state, _ in tasks), tasks
    assert all(start in ("None", "Unknown", "") for _, _, start in tasks), tasks  # never started
    assert job_folders(sweep_dir) == []
