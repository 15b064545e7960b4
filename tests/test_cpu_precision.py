"""The cluster's dtype here (issue 55): a TRL config with ``bf16: true`` (``trl=paper``, the paper models'
SFT args) trains on a CPU with bfloat16 arithmetic under the CPU's bfloat16 autocast, as the cluster trains
under its GPUs' (``sage.trl_checks.cpu_precision``); ``bf16: false`` (``trl=testbed``, the tests that need
exactness) keeps float32. A CPU without bfloat16 arithmetic is refused in one line naming the key, before
any model or MLflow run: it would emulate every product of the step."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from trl import GRPOConfig

from sage.config import ConfigError, register_configs
from sage.hardware import cpu_computes_bfloat16
from sage.objective.divergences import ReverseKL
from sage.objective.guides import NoGuide
from sage.paths import CONF_DIR
from sage.testbed.task import arith_dataset
from sage.train.main import grpo_args
from sage.train.trainer import SageGRPOTrainer
from sage.trl_checks import check_trl, cpu_precision

register_configs()
BF16_CPU = not torch.cuda.is_available() and cpu_computes_bfloat16()
needs_bf16_cpu = pytest.mark.skipif(
    not BF16_CPU, reason="a CPU without CUDA that has bfloat16 arithmetic (AVX512-BF16 or AMX)"
)


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture
def model_path(small_testbed_model):
    return small_testbed_model


def reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


def loss_pass_dtypes(path, tmp, **precision) -> set[torch.dtype]:
    """The dtypes the policy's linear layers produce in one optimiser step's loss passes (the passes with
    gradients), under GRPOConfig ``precision``."""
    args = GRPOConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        beta=0.04,
        use_bias_correction_kl=False,
        report_to="none",
        max_steps=1,
        save_strategy="no",
        gradient_checkpointing=False,
        disable_dropout=True,
        **precision,
    )
    trainer = SageGRPOTrainer(
        model=path,
        reward_funcs=[reward],
        args=args,
        train_dataset=arith_dataset(16, 0),
        divergence=ReverseKL(0.04),
        guide=NoGuide(),
    )
    seen: set[torch.dtype] = set()

    def record(module, inputs, output):
        if torch.is_grad_enabled():
            seen.add(output.dtype)

    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(record)
    trainer.train()
    return seen


@pytest.mark.slow
@needs_bf16_cpu
def test_trl_bf16_trains_in_bfloat16_on_this_cpu_and_false_keeps_float32(model_path, tmp_path):
    on = cpu_precision(composed("trl=paper").trl, "trl")
    assert on == {"use_cpu": True}
    assert loss_pass_dtypes(model_path, tmp_path / "bf16", bf16=True, **on) == {torch.bfloat16}
    assert cpu_precision(composed("trl=testbed").trl, "trl") == {}
    assert loss_pass_dtypes(model_path, tmp_path / "fp32", bf16=False) == {torch.float32}


@needs_bf16_cpu
def test_sage_train_builds_the_papers_args_for_this_cpu(tmp_path):
    """sage-train's own GRPOConfig for trl=paper: bf16 on the CPU; the plan-time check passes it."""
    cfg = composed("model=tiny_chat", "trl=paper", "trl.optim=adamw_torch")
    args = grpo_args(cfg, tmp_path)
    assert args.bf16 and args.use_cpu
    assert check_trl(cfg, processes=1, preset="paper") is None


def test_a_cpu_without_bfloat16_is_refused_in_one_line_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sage.trl_checks.cpu_computes_bfloat16", lambda: False)
    refusal = (
        "{}.bf16=true: this CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX), so every product of "
        "the step would be emulated; set {}.bf16=false to train in float32"
    )
    with pytest.raises(ConfigError) as e:
        check_trl(composed("model=tiny_chat", "trl=paper"), processes=1, preset="paper")
    assert str(e.value) == refusal.format("trl", "trl")
    sft = composed("model=qwen2.5-math-7b", "trl=paper", "trl.bf16=false")
    with pytest.raises(ConfigError) as e:
        cpu_precision(sft.model.sft.args, "model.sft.args")
    assert str(e.value) == refusal.format("model.sft.args", "model.sft.args")
    assert cpu_precision(composed("trl=paper", "trl.bf16=false").trl, "trl") == {}
