"""The GPU memory plan of a paper run (sage.train.memory): parameter counts against transformers and peft,
each term against its hand-computed bytes, and every paper model composed with trl=paper rollout=vllm
planned to fit an 80 GiB GPU."""

import subprocess
import sys

import pytest
import torch

from sage.train.memory import GIB, Architecture, Batch, estimate

SMALL = Architecture(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=300,
    tie_word_embeddings=False,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def small_model(tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = SMALL.__dict__ | {"tie_word_embeddings": tied}
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**arch)), Architecture(**arch)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_match_transformers_and_peft(tied):
    from peft import LoraConfig, get_peft_model

    model, arch = small_model(tied)
    # Qwen2's q/k/v projections carry biases, which the plan leaves out (a few thousand of billions)
    biases = arch.num_hidden_layers * (arch.hidden_size + 2 * arch.kv_size)
    assert arch.parameters() + biases == sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert arch.lora_parameters(8, TARGETS) == trainable


def test_estimate_terms_by_hand():
    batch = Batch(
        micro=2, accumulation=4, processes=1, num_generations=8, prompt_tokens=10, completion_tokens=30
    )
    p, h, kv, i, v, n_layers = SMALL.parameters(), 64, 16, 160, 300, 3
    lora = SMALL.lora_parameters(8, ["q_proj"])
    assert lora == 3 * 8 * (64 + 64)
    parts = estimate(
        SMALL,
        batch,
        lora=(8, ["q_proj"]),
        beta=0.05,
        optim="adamw_8bit",
        gradient_checkpointing=True,
        vllm_fraction=0.5,
        gpu_gib=80,
    )
    assert parts["weights"] * GIB == pytest.approx(2 * p)  # frozen bf16 base
    assert parts["trainable_state"] * GIB == pytest.approx(
        lora * (4 + 4 + 2)
    )  # fp32 copy, grad, 8-bit moments
    assert parts["reference"] == 0  # the adapter disabled is the reference
    layer = 2 * 40 * (4 * h + 2 * kv + 3 * i) * 2 * 2
    assert parts["activations"] * GIB == pytest.approx(2 * 40 * h * 2 * n_layers + layer)
    assert parts["logits"] * GIB == pytest.approx(2 * 30 * v * 2 * 2 + 30 * v * 4)
    assert parts["vllm"] == 40
    full = estimate(
        SMALL,
        batch,
        lora=None,
        beta=0.05,
        optim="adamw_torch",
        gradient_checkpointing=False,
        vllm_fraction=0.0,
        gpu_gib=80,
    )
    # float32 master weights, fp32 grad + two fp32 moments, a bf16 reference copy
    assert full["weights"] * GIB == pytest.approx(4 * p)
    assert full["trainable_state"] * GIB == pytest.approx(p * (4 + 8))
    assert full["reference"] * GIB == pytest.approx(2 * p)
    assert full["activations"] * GIB == pytest.approx(layer * (n_layers + 1))
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k not in ("total", "gpu")))


def plan(capsys, *overrides) -> tuple[int, str, str]:
    """``python -m sage.train.memory <overrides>``, in this process: (exit code, stdout, stderr)."""
    from sage.train.memory import main

    code = main(list(overrides))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "model, completion",
    [
        ("qwen2.5-math-7b", 2048),
        ("r1-distill-qwen-7b", 8192),
        ("qwen2.5-math-1.5b-instruct", 2048),
        ("qwen2.5-3b-instruct", 2048),
    ],
)
def test_each_paper_model_fits_an_80_gib_gpu(capsys, model, completion):
    code, out, err = plan(
        capsys, f"model={model}", "trl=paper", "rollout=vllm", "data=dapo_math_17k", "gpu_gib=80"
    )
    assert code == 0, out + err[-2000:]
    lines = out.strip().splitlines()
    assert lines[1].startswith("batch: 1 completions per forward pass x 64 accumulation steps x 1 processes")
    assert (
        "(8 prompts x 8 generations)" in lines[1] and f"(1024 prompt + {completion} completion)" in lines[1]
    )
    assert "of 80.0 GiB, fits" in lines[2] and "vllm 40.0" in lines[2]


def test_a_micro_batch_that_does_not_fit_exits_1(capsys):
    code, out, _ = plan(
        capsys, "model=r1-distill-qwen-7b", "trl=paper", "rollout=vllm", "trl.per_device_train_batch_size=8"
    )
    assert code == 1
    assert "DOES NOT FIT" in out


def test_unknown_model_without_config_is_one_line(capsys):
    code, _, err = plan(
        capsys, "model=qwen2.5-math-7b", "model.source.repo_id=some/unknown-model", "trl=paper"
    )
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [err.strip().splitlines()[0]]  # one line
    assert err.startswith("error: model.source.repo_id='some/unknown-model'")


def test_the_command_line_runs_as_a_module():
    r = subprocess.run(
        [sys.executable, "-m", "sage.train.memory", "model=qwen2.5-math-7b", "trl=paper", "rollout=vllm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and ", fits (" in r.stdout, r.stderr[-2000:]
