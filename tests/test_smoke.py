"""Smoke runs of the real entry point (`python -m sage.train`) on a shrunken testbed, in a tmp dir: the
parameters change, metrics are logged, a checkpoint is written, and `resume=true` continues from it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

# A small base model (seconds to build) and a few RL steps; the real defaults are exercised by `make run`.
SHRINK = [
    "model.source.hidden_size=32",
    "model.source.intermediate_size=64",
    "model.source.num_layers=1",
    "model.source.num_heads=2",
    "model.source.train_steps=20",
    "model.max_completion_length=40",
    "trainer.prompts_per_step=2",
    "trainer.num_generations=4",
    "trainer.save_steps=2",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=6",
]


def sage_train(tmp_path, *overrides, check=True):
    env = {"SAGE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "sage.train", *SHRINK, *overrides],
        capture_output=True, text=True, timeout=900, env=env,
    )
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_train_checkpoint_resume(tmp_path):
    out = tmp_path / "run"
    r = sage_train(tmp_path, "trainer.max_steps=2", f"output_dir={out}", "guide=branch", "guide.threshold=0.5")
    # a table of base vs trained model is printed, and where the outputs are
    assert "| base | arith_heldout |" in r.stdout and "| trained | arith_heldout |" in r.stdout
    assert f"run outputs: {out}" in r.stdout
    assert (out / "rl" / "checkpoint-2").is_dir()
    log = json.loads((out / "train_log.json").read_text())
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for key in ("reward", "reward_std", "kl", "divergence", "entropy", "grad_norm", "guide/q_mean",
                "guide/q_max", "guide/active_frac", "clip_ratio/region_mean", "completions/mean_length", "step_time"):
        assert key in steps[0], key
    assert any(e["guide/active_frac"] > 0 for e in steps)  # the guide fired at threshold 0.5
    final = weights(out / "final")
    ckpt = weights(out / "rl" / "checkpoint-2")
    assert all(torch.equal(final[k], ckpt[k]) for k in final)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["trained/arith_heldout/pass@1"] <= metrics["trained/arith_heldout/pass@4"] <= 1.0

    # a second run into the same folder without resume=true refuses to overwrite what is recorded
    r = sage_train(tmp_path, "trainer.max_steps=4", f"output_dir={out}", check=False)
    assert r.returncode == 2 and "pass resume=true" in r.stderr

    # resume=true continues from checkpoint-2 up to step 4
    r = sage_train(tmp_path, "trainer.max_steps=4", f"output_dir={out}", "resume=true", "guide=branch", "guide.threshold=0.5")
    log = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4]
    assert (out / "rl" / "checkpoint-4").is_dir()
    resumed = weights(out / "final")
    assert any(not torch.equal(resumed[k], final[k]) for k in final)


def test_parameters_change_from_the_base_model(tmp_path):
    out = tmp_path / "run"
    sage_train(tmp_path, "trainer.max_steps=1", f"output_dir={out}", "eval.at_end=false", "divergence=forward_kl")
    base_dir = next((tmp_path / "cache" / "testbed").iterdir())
    base, final = weights(base_dir), weights(out / "final")
    changed = [k for k in final if not torch.equal(base[k], final[k])]
    assert len(changed) >= len(final) // 2, changed
