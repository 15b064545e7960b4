"""A 2-process ``torchrun`` run on this CPU (gloo): the SFT stage and RL train on both processes, and the
run leaves exactly one MLflow run, one merged SFT model, one ``final/`` and one evaluation, with as many
prompts per optimiser step as the same run on one process."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sage.paths import cache_dir

BATCH = re.compile(r"^batch: .*$", re.MULTILINE)


def sage_train(tmp_path: Path, *overrides: str, processes: int) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        if processes > 1
        else [sys.executable]
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*launcher, "-m", "sage.train.main", *overrides],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.slow
def test_torchrun_two_processes_record_once(tmp_path):
    from mlflow import MlflowClient

    # a fresh SFT stage (its own data seed), so that this run trains and merges it
    sft_seed = random.randrange(10**6, 10**7)
    common = [
        "model=tiny_sft",
        f"model.sft.data.seed={sft_seed}",
        "model.sft.data.n=32",
        "trl.max_steps=2",
        "eval.n_samples=4",
        "eval.limit=8",
        "eval.perplexity_cap=0",
    ]
    out = tmp_path / "run"
    try:
        r = sage_train(
            tmp_path, *common, "trl.per_device_train_batch_size=32", f"output_dir={out}", processes=2
        )
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-5000:]

        # one merged SFT model, trained on both processes with one process's effective batch (SFTConfig's 8
        # rows per step: 4 per process), so with as many optimiser steps as on one process (32 rows / 8)
        assert (
            log.count("SFT stage trained on 2 process(es) (4 rows per forward pass x 1 accumulation") == 1
        ), log[-5000:]
        merged = [
            p.parent
            for p in (cache_dir() / "sft").glob("*/sft_info.json")
            if json.loads(p.read_text())["key"]["data"].get("seed") == sft_seed
        ]
        assert len(merged) == 1
        info = json.loads((merged[0] / "sft_info.json").read_text())
        assert info["optimiser_steps"] == 4 and info["key"]["effective_batch"] == 8
        # (only this build's: a build killed in another test may have left its own, removed by its next build)
        left = list((cache_dir() / "sft").glob(f".tmp-{merged[0].name}-*"))
        assert not left, "a temporary SFT folder was left behind"

        # RL on 2 processes with the one-process step: 64 completions = 8 prompts x 8 generations
        (line,) = BATCH.findall(r.stdout)
        assert "32 completions per forward pass x 1 accumulation steps x 2 processes = 64 completions" in line
        assert "(8 prompts x 8 generations) per optimiser step" in line

        # one MLflow run, finished, with one value per training step
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("sage").experiment_id])
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]

        # one final/, one evaluation of the trained model, one table
        assert json.loads((out / "final" / "sage_final.json").read_text())["global_step"] == 2
        assert (out / "final" / "adapter_config.json").is_file()
        cells = (out / "eval" / "trained" / "arith_heldout").iterdir()
        assert len([c for c in cells if not c.name.startswith(".")]) == 1  # one cell (and its lock)
        assert r.stdout.count("| trained | arith_heldout |") == 1
        assert not (out / "final.partial").exists()
    finally:
        for folder in merged if "merged" in locals() else []:
            shutil.rmtree(folder, ignore_errors=True)

    # the same run on one process: the same prompts per optimiser step
    one = sage_train(
        tmp_path,
        *common,
        "eval.at_end=false",
        "tracking.enabled=false",
        f"output_dir={tmp_path / 'one'}",
        processes=1,
    )
    assert one.returncode == 0, (one.stdout + one.stderr)[-3000:]
    (single,) = BATCH.findall(one.stdout)
    assert "64 completions per forward pass x 1 accumulation steps x 1 processes = 64 completions" in single
    assert "(8 prompts x 8 generations) per optimiser step" in single
