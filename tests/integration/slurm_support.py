"""Helpers the SLURM tests share (imported as ``slurm_support``, never from another test module): a grid
driven to its end as a user types it, and what SLURM and the sweep folder say of its jobs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import prefork

REPO = Path(__file__).resolve().parents[2]


def compose(overrides: list[str]):
    """sage-train's config composed with ``overrides``, Hydra's own node included (a grid's sweeper)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from sage.config import register_configs

    register_configs()  # the schemas the presets extend (sage-train registers them in main())
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides, return_hydra_config=True)


def sweep(env: dict[str, str], *args: str, timeout: float) -> tuple[int, str]:
    """`sage-train -m ...` (as `python -m sage.train`, from the repo like a user) to its end: (exit status,
    stdout + stderr). Forked from the tests' pre-imported interpreter (tests/prefork.py); the jobs it submits
    start their own on the SLURM node."""
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "-m", *args],
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=timeout,
    )
    return r.returncode, r.stdout + r.stderr


def slurm_jobs(sweep_dir: Path) -> list[str]:
    """Array job ids submitit used for this sweep (its folders are named after them; the pickles submitit
    writes there before submitting are named by a uuid, which may start with a digit too)."""
    folders = (p.name.split("_")[0] for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())
    return sorted({name for name in folders if name.isdigit()})


def sacct_states(env: dict[str, str], job_id: str) -> dict[str, str]:
    """{array task: state}; a task whose result is in may still be RUNNING/COMPLETING for a moment."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(line.split("|", 1) for line in out.split())


def final_states(env: dict[str, str], job_id: str, timeout: float = 60) -> dict[str, str]:
    end = time.monotonic() + timeout
    while True:
        states = sacct_states(env, job_id)
        if time.monotonic() > end or not set(states.values()) & {"PENDING", "RUNNING", "COMPLETING"}:
            return states
        time.sleep(1)


def job_folders(sweep_dir: Path) -> list[Path]:
    """The sweep's job folders (each named by its job's overrides: sage.run_folder.job_dir), not the
    grid's ``report`` folder that sage.grid.close_parent writes beside them."""
    return sorted(
        p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "report"
    )
