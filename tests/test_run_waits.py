"""A multi-process run never waits inside a collective for another job's work (issue 20, item 1).

On a cluster every job of a grid asks for the same SFT model at once: one job builds it for tens of minutes
while the others wait. Their ranks other than the main one used to wait in a collective, whose timeout
(NCCL's watchdog; ``trl.ddp_timeout`` was not even passed to the group sage-train creates) killed every
such job. Here the same situation with gloo, 2 processes and a short timeout: another process holds the
SFT lock for longer than the timeout, and the run waits, then trains."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sage.paths import CONF_DIR, cache_dir, content_key

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def test_the_process_group_takes_its_timeout(tmp_path):
    """A collective that one process reaches late fails after ``distributed.init``'s timeout (sage-train
    passes ``trl.ddp_timeout``), not after the backend's default of many minutes."""
    script = tmp_path / "late.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from sage import distributed
            distributed.init(timeout_s=3)
            if distributed.rank() == 1:
                time.sleep(20)
            start = time.monotonic()
            try:
                distributed.barrier()
                print("rank", distributed.rank(), "passed the barrier", flush=True)
            except Exception as e:
                print("rank", distributed.rank(), f"timed out after {time.monotonic() - start:.0f} s:",
                      type(e).__name__, flush=True)
                raise SystemExit(3)
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*TORCHRUN, str(script)], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    line = next((x for x in out.splitlines() if x.startswith("rank 0 ")), "")
    assert line.startswith("rank 0 timed out after"), out[-3000:]
    assert int(line.split("after ")[1].split(" s")[0]) < 15, line


def sft_folder(overrides: list[str]) -> Path:
    """Where the SFT stage of a sage-train run with ``overrides`` is stored (the lock beside it)."""
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.targets import instantiate_node
    from sage.train.sft import sft_key

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    base = instantiate_node(cfg.model.source)  # the testbed base model (built once, cached)
    return cache_dir() / "sft" / content_key(sft_key(cfg, base))


@pytest.mark.slow
def test_a_run_waits_for_another_jobs_sft_longer_than_its_collective_timeout(tmp_path):
    """Table 7's batch of 1 on 2 processes: the main process trains the SFT stage alone (a batch of 1 cannot
    be shared), and before that waits for another job that holds the SFT lock for 3x the collective
    timeout; the other process waits on the file system. The run then trains, with the effective batch of 1
    (one optimiser step per row)."""
    n_rows = 6
    overrides = [
        "model=tiny_sft",
        f"model.sft.data.seed={time.time_ns() % 10**9}",  # a fresh SFT stage that this run must train
        f"model.sft.data.n={n_rows}",
        "model.sft.args.per_device_train_batch_size=1",
        "trl.max_steps=1",
        "trl.ddp_timeout=15",
        "eval.at_end=false",
        "tracking.enabled=false",
    ]
    final = sft_folder(overrides)
    lock = final.parent / f".{final.name}.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(45)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [*TORCHRUN, "-m", "sage.train.main", *overrides, f"output_dir={tmp_path / 'run'}"],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=tmp_path,
            env=env,
        )
        waited = time.monotonic() - start
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-6000:]
        assert waited > 45  # it did wait for the holder, three times the collective timeout
        assert "the main process trains it alone while the others wait" in log
        info = json.loads((final / "sft_info.json").read_text())
        assert info["batch"] == {"processes": 1, "per_device": 1, "accumulation": 1}
        assert info["optimiser_steps"] == n_rows  # a batch of 1: one step per row, as on one GPU
        assert json.loads((tmp_path / "run" / "final" / "sage_final.json").read_text())["global_step"] == 1
        assert not list(final.parent.glob(f".{final.name}.*.decision"))  # the run's decision file is gone
    finally:
        holder.kill()
        shutil.rmtree(final, ignore_errors=True)
