"""The paper's 7B path at 1M parameters (``model=tiny_chat``): a ChatML base that needs the SFT stage
(LoRA, merged), LoRA RL from the merged model with its training rollouts from the real vLLM engine (its CPU
build) serving the adapter (``rollout=vllm``), and the evaluation of the merged start model and of the
trained adapter through vLLM, through the real entry point, with the same groups and keys as
``model=qwen2.5-math-7b``. The 2-process run of the same path is in tests/test_distributed.py."""

import json
import os
import sys
from pathlib import Path

import prefork
import pytest
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SHRINK = [
    "model=tiny_chat",
    "model.sft.data.n=64",
    "model.sft.args.num_train_epochs=1",
    "trl.max_steps=2",
    "trl.per_device_train_batch_size=8",
    "trl.num_generations=4",
    "eval.n_samples=4",
    "eval.limit=8",
    "rollout=vllm",
    "eval.vllm_cpu_memory_utilization=0.1",
    # the testbed's min_p 0.01 (trl=paper's) with top-p and a temperature other than 1: the engine's
    # log-probs must still be the trainer's
    "trl.top_p=0.9",
    "trl.temperature=0.7",
]


def test_tiny_chat_goes_through_sft_lora_rl_and_evaluates_the_adapter(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out = tmp_path / "run"
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *SHRINK, f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    final = out / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())  # RL trained a LoRA adapter ...
    merged = Path(adapter["base_model_name_or_path"])  # ... on the merged SFT model, not the raw base
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    assert merged.parent.name == "sft"
    tokenizer = json.loads((final / "tokenizer_config.json").read_text())
    assert tokenizer["eos_token"] == "<|im_end|>" and (final / "chat_template.jinja").is_file()
    assert any(
        k.startswith("base_model.model.model.layers.") for k in load_file(final / "adapter_model.safetensors")
    )
    # the batch line counts the chat prompt's tokens (system prompt in ChatML turns), not its messages
    batch = next(line for line in r.stdout.splitlines() if line.startswith("batch:"))
    prompt_tokens = int(batch.split("x (")[1].split(" prompt")[0])
    assert prompt_tokens > 100, batch
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"pass_at_1/base/arith_heldout", "pass_at_4/trained/arith_heldout"} <= set(metrics)
    assert "| trained | arith_heldout |" in r.stdout
    cells = json.loads((out / "eval" / "trained" / "results.json").read_text())["datasets"]
    assert cells["arith_heldout"]["settings"]["backend"] == "vllm"  # the adapter went through vLLM
    # the training rollouts too: an adapter version handed over at start and before each step's rollouts
    assert "rollout=vllm, process 0: 3 adapter hand-overs" in r.stderr + r.stdout
    # the importance-sampling correction compares like with like: a ratio of 1 at every step (it was about
    # 0.83 when vLLM's log-probs were those after min-p's truncation)
    ratios = [
        e["sampling/importance_sampling_ratio/mean"]
        for e in json.loads((out / "train_log.json").read_text())
        if "sampling/importance_sampling_ratio/mean" in e
    ]
    assert len(ratios) == 2 and all(0.95 <= x <= 1.05 for x in ratios), ratios
    # the evaluation's engine starts after the policy and its optimiser are gone
    log = r.stderr + r.stdout
    assert "process 0: the policy and its optimiser were released after RL" in log
    assert log.index("released after RL") < log.index("| trained | arith_heldout |")
