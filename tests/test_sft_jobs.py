"""A grid's SFT stage runs once, as a job of its own sized to its batch, before the jobs that start from it
(issue 55): which stages a grid needs (``sage.train.sft.sft_stages``), how many processes each can use, and
the local launcher's order, failure and progress lines through the command line. The SLURM launcher's
dependency is tested on a real cluster in tests/integration/test_slurm_sft_job.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import prefork
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from sft_job_args import QUICK_RL, SMALL_SFT, new_stage

from sage.config import register_configs
from sage.train.sft import BUILD_ONLY, DONE_FILE, cached_stage, sft_stages, stage_identity, stage_processes

REPO = Path(__file__).resolve().parents[1]
register_configs()


def compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize(
    ("per_device", "accumulation", "processes", "expected"),
    [
        (1, 1, 8, 1),  # Table 7's batch of one row: one GPU
        (2, 4, 8, 8),  # 8 rows split over 8 processes
        (4, 3, 8, 6),  # 12 rows: 6 processes of 2 rows share them, 8 cannot
        (8, 1, 1, 1),
        (1, 64, 8, 8),
    ],
)
def test_an_sft_job_asks_for_the_processes_its_batch_can_use(per_device, accumulation, processes, expected):
    args = OmegaConf.create(
        {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation}
    )
    assert stage_processes(args, processes) == expected


def test_a_grid_needs_one_sft_job_per_stage_the_cache_lacks(monkeypatch, tmp_path):
    """Jobs that differ only outside the model share one stage; another SFT setting is a second stage; a model
    without SFT needs none; a stage in the cache needs no job."""
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))  # empty: no base model, no SFT stage
    jobs = [
        [*SMALL_SFT, "seed=1"],
        ["model=tiny", "seed=1"],
        [*SMALL_SFT, "seed=2", "resume=auto"],
        [*SMALL_SFT, "model.sft.args.learning_rate=1e-3", "seed=1"],
    ]
    stages = sft_stages(compose_train, jobs, processes=8)
    assert [s.dependents for s in stages] == [[0, 2], [3]]
    first = stages[0]
    assert first.processes == 8  # the testbed's SFT batch of 8 rows splits over 8 processes
    assert first.model == " ".join(SMALL_SFT)
    # the first dependent's command, building only the stage, in the sweep dir's .sft/ folder
    assert first.overrides == [
        *SMALL_SFT,
        "seed=1",
        *BUILD_ONLY,
        f"hydra.sweep.subdir=.sft/{first.identity[:16]}",
    ]
    assert (
        stage_identity(compose_train(jobs[0])) == stage_identity(compose_train(jobs[2])) != stages[1].identity
    )

    # the stage of jobs 0 and 2 built: a base model folder and the SFT folder its key names (constructed, not
    # trained: what is checked is that the driver finds them without building or fetching anything)
    cfg = compose_train(jobs[0])
    base = tmp_path / "cache" / "testbed"
    from sage.paths import content_key
    from sage.targets import instantiate_node
    from sage.testbed.model import BUILD_INFO_FILE
    from sage.train.sft import sft_key

    with pytest.MonkeyPatch.context() as mp:  # where build_tiny_model would put the base model
        made = []
        mp.setattr(
            "sage.durable.build_once", lambda final, marker, build, processes: made.append(final) or final
        )
        folder = Path(instantiate_node(cfg.model.source))
    assert made and folder.parent == base
    folder.mkdir(parents=True)
    (folder / BUILD_INFO_FILE).write_text("{}")
    assert cached_stage(cfg) is None  # the base model is there, its SFT stage is not
    sft = tmp_path / "cache" / "sft" / content_key(sft_key(cfg, str(folder)))
    sft.mkdir(parents=True)
    (sft / DONE_FILE).write_text("{}")
    assert cached_stage(cfg) == sft
    assert [s.dependents for s in sft_stages(compose_train, jobs, processes=8)] == [[3]]


def sage_train(*args: str, timeout: float = 900) -> tuple[int, str]:
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return r.returncode, r.stdout + r.stderr


def job_folders(sweep: Path) -> list[Path]:
    return sorted(
        p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "report"
    )


@pytest.mark.slow
def test_a_local_grid_builds_its_sft_stage_first_once_and_says_how_each_job_ended(tmp_path):
    """A 2-job grid of a model whose SFT stage is not cached: the stage is built by one job of its own before
    either RL job starts (each of them finds it in the cache), and the driver prints a line as each job ends,
    before the grid's end."""
    sweep = tmp_path / "grid"
    stage = [*SMALL_SFT, new_stage()]
    tracked = [o for o in QUICK_RL if o != "tracking.enabled=false"]  # the grid's answer at its end
    rc, log = sage_train(
        "-m", "hydra/launcher=local", *stage, "seed=1,2", *tracked, f"hydra.sweep.dir={sweep}"
    )
    assert rc == 0, log[-4000:]
    lines = log.splitlines()

    def first(said) -> int:
        found = [i for i, ln in enumerate(lines) if said(ln)]
        assert found, log[-4000:]
        return found[0]

    answer = first(lambda ln: ln.startswith("grid '") and ln.endswith("' finished"))
    submitted = first(lambda ln: "sft: job " in ln and "builds the SFT stage of" in ln)
    built = first(lambda ln: "built the SFT stage of model=tiny_chat" in ln)
    started = [
        i for i, ln in enumerate(lines) if ln.rstrip().endswith(")") and "] started (submitit id" in ln
    ]
    ended = [i for i, ln in enumerate(lines) if "] COMPLETED after " in ln]
    assert len(started) == 2 and len(ended) == 2, log[-4000:]
    assert submitted < built < min(started) and max(ended) < answer, log[-4000:]
    assert "#0 [seed=1] COMPLETED after " in lines[ended[0]] + lines[ended[1]]
    # built once: by the SFT job, in the sweep dir's .sft/ folder; both RL jobs found it in the cache
    (sft_job,) = (sweep / ".sft").iterdir()
    assert "SFT stage trained on 1 process(es)" in (sft_job / "main.log").read_text()
    assert len(job_folders(sweep)) == 2
    assert not (sweep / ".submitit" / "%j").exists()  # submitit's folder pattern, made literally, is removed
    for job in job_folders(sweep):
        main_log = (job / "main.log").read_text()
        assert "SFT stage already done" in main_log and "SFT stage trained" not in main_log
        assert json.loads((job / "metrics.json").read_text())["train/steps"] == 1  # the RL step ran


@pytest.mark.slow
def test_a_failed_sft_job_ends_the_local_grid_in_one_line_and_no_rl_job_runs(tmp_path):
    sweep = tmp_path / "grid"
    # no SFT row fits 8 tokens: the stage fails inside its job, after the config checks
    failing = [*SMALL_SFT, "model.sft.args.max_length=8", new_stage()]
    rc, log = sage_train(
        "-m", "hydra/launcher=local", *failing, "seed=1,2", *QUICK_RL, f"hydra.sweep.dir={sweep}"
    )
    assert rc == 1, log[-4000:]
    last = log.strip().splitlines()[-1]
    assert (
        last.startswith("error: the SFT job ") and "; its 2 dependent job(s) did not run (its log: " in last
    ), log
    assert "no SFT row fits" in last
    assert job_folders(sweep) == []  # neither RL job started
    assert " started (submitit id" not in log
