"""Issue 47: ``trl.max_steps=1`` trains nothing (warm-up puts the learning rate at 0 for its one step), and
its final/ was reported as a trained model. sage-train now says so in one line and tags the run;
sage-report notes it."""

from __future__ import annotations

import json
import os
import sys

import prefork
import pytest
import torch
from safetensors.torch import save_file

from sage.train.untrained import UNTRAINED_TAG, WARNING, unchanged


def weights(folder, tensors, name="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name))
    return folder


def test_final_equals_start_is_told_from_the_weights(tmp_path):
    w = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}
    start = weights(tmp_path / "start", w)
    assert unchanged(str(start), weights(tmp_path / "same", dict(w))) is True
    # saved in the dtype training cast it to: still the start model
    half = {k: v.to(torch.bfloat16) for k, v in w.items()}
    assert unchanged(str(start), weights(tmp_path / "bf16", half)) is True
    assert unchanged(str(start), weights(tmp_path / "moved", {**w, "b": torch.ones(4) * 1.001})) is False
    assert unchanged(str(start), weights(tmp_path / "other", {"c": torch.ones(1)})) is None
    assert unchanged(str(start), tmp_path / "empty") is None
    # a LoRA adapter is the start model exactly when every B is zero (its update B @ A is zero)
    lora = {"x.lora_A.weight": torch.randn(2, 3), "x.lora_B.weight": torch.zeros(3, 2)}
    adapter = weights(tmp_path / "adapter", lora, "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text("{}")
    assert unchanged(str(start), adapter) is True
    weights(adapter, {**lora, "x.lora_B.weight": torch.full((3, 2), 1e-3)}, "adapter_model.safetensors")
    assert unchanged(str(start), adapter) is False


@pytest.mark.slow
def test_a_one_step_run_says_in_one_line_that_nothing_was_trained(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "run"
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "trl.max_steps=1", "eval.at_end=false"]
        + [f"tracking.uri={store}", f"output_dir={out}"],
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if WARNING in ln]
    assert len(said) == 1 and said[0].endswith(f"{WARNING} ({out / 'final'})"), said
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert MlflowClient(store).get_run(run_id).data.tags.get(UNTRAINED_TAG) == "true"
    # the run's metrics.json says it too, and keeps saying it when the finished run is run again
    assert json.loads((out / "metrics.json").read_text())["untrained"] is True
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "trl.max_steps=1", "eval.at_end=false", "resume=true"]
        + [f"tracking.uri={store}", f"output_dir={out}"],
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["untrained"] is True


def test_the_report_notes_an_untrained_run(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    exp = client.create_experiment("untrained")
    ids = []
    for seed in (0, 1):
        tags = {"sage.kind": "train", "seed": str(seed), "method": "grpo", "base_model": "/start"}
        if seed == 1:
            tags[UNTRAINED_TAG] = "true"
        run_id = client.create_run(exp, tags=tags).info.run_id
        for label, value in (("base", 0.3), ("trained", 0.4)):
            client.log_metric(run_id, f"pass_at_1/{label}/arith_heldout", value)
        client.set_terminated(run_id)
        ids.append(run_id)
    args = ["--tracking-uri", store, "--experiment", "untrained", "--out", str(tmp_path / "r.md")]
    r = prefork.run(
        [sys.executable, "-m", "analysis.report", *args],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = (
        f"untrained: GRPO seed 1 (run {ids[1]}): final/ equals the start model, so its trained numbers are "
        "the start model's (learning rate 0 throughout?)"
    )
    assert f"note: {line}" in r.stderr.splitlines() and f"- {line}" in (tmp_path / "r.md").read_text()
    assert ids[0] not in "".join(ln for ln in r.stderr.splitlines() if "untrained" in ln)
