"""What a kill, a rerun or a dead tracking server must not do (issue 14): a checkpoint cut short by a kill
is set aside, never resumed from; a rerun that finds no checkpoint starts a new MLflow run instead of
merging into the killed one; an unreachable or corrupt store fails in seconds with one line, before any
model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from omegaconf import OmegaConf
from transformers.trainer_utils import get_last_checkpoint

from sage.tracking import RUN_ID_FILE, start_run
from sage.train.main import set_aside_incomplete_checkpoints


def test_a_checkpoint_cut_short_by_a_kill_is_set_aside(tmp_path):
    rl = tmp_path / "rl"
    done, cut = rl / "checkpoint-1", rl / "checkpoint-2"
    for folder in (done, cut):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
    (done / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    (done / "rng_state.pth").write_bytes(b"rng")
    (cut / "rng_state.pth").write_bytes(b"")  # what a SIGKILL during the save left: no trainer_state.json
    set_aside_incomplete_checkpoints(rl)
    assert get_last_checkpoint(str(rl)) == str(done)
    assert (rl / "checkpoint-2.incomplete" / "model.safetensors").read_bytes() == b"weights"  # kept
    set_aside_incomplete_checkpoints(rl)  # a second pass leaves the complete one alone
    assert done.is_dir()


def cfg(uri: str):
    return OmegaConf.create(
        {
            "seed": 1,
            "tracking": {"enabled": True, "uri": uri, "experiment": "e", "run_name": None, "tags": {}},
        }
    )


def test_a_rerun_without_a_checkpoint_starts_a_new_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    out.mkdir()
    try:
        with start_run(cfg(uri), out, kind="train", resume=False) as tracker:
            first = tracker.run_id
            raise KeyboardInterrupt  # Ctrl-C
    except KeyboardInterrupt:
        pass
    client = MlflowClient(uri)
    assert client.get_run(first).info.status == "KILLED"
    with start_run(cfg(uri), out, kind="train", resume=False) as tracker:
        second = tracker.run_id
    assert second != first and (out / RUN_ID_FILE).read_text() == second
    assert client.get_run(first).info.status == "KILLED"  # the earlier attempt keeps its own record
    with start_run(cfg(uri), out, kind="train", resume=True) as tracker:  # a resume continues the run
        assert tracker.run_id == second


def sage_train(*overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sage.train", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_an_unreachable_or_corrupt_store_fails_in_one_line_before_any_work(tmp_path):
    start = time.monotonic()
    r = sage_train("tracking.uri=http://127.0.0.1:9", f"output_dir={tmp_path / 'a'}")
    elapsed = time.monotonic() - start
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: tracking.uri=http://127.0.0.1:9: the MLflow store cannot be opened")
    assert elapsed < 120 and not (tmp_path / "a").exists()  # nothing built, nothing written

    corrupt = tmp_path / "mlflow.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    r = sage_train(f"output_dir={tmp_path / 'b'}", env={"MLFLOW_TRACKING_URI": f"sqlite:///{corrupt}"})
    assert r.returncode == 2
    last = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1]
    assert last.startswith(f"error: tracking.uri=sqlite:///{corrupt}: the MLflow store cannot be opened")
    assert not (tmp_path / "b").exists()


def test_a_folder_naming_a_run_of_another_store_starts_a_new_run(tmp_path):
    """The base model's evaluation cache is shared by runs logged to different stores."""
    out = tmp_path / "shared"
    out.mkdir()
    with start_run(cfg(f"sqlite:///{tmp_path / 'a.db'}"), out, kind="eval") as tracker:
        in_a = tracker.run_id
    with start_run(cfg(f"sqlite:///{tmp_path / 'b.db'}"), out, kind="eval") as tracker:
        in_b = tracker.run_id
    assert in_b != in_a and (out / RUN_ID_FILE).read_text() == in_b
