"""The SFT stage: its LoRA adapter is merged, and the merged SFT model is both the RL start point and the
reference policy (not the pre-SFT base, the known LoRA pitfall), with LoRA RL and with full fine-tuning."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from sage.config import register_configs
from sage.objective.divergences import ReverseKL
from sage.objective.guides import NoGuide
from sage.testbed.model import build_tiny_model
from sage.testbed.task import arith_dataset
from sage.train.main import grpo_args, lora_config
from sage.train.sft import run_sft
from sage.train.trainer import SageGRPOTrainer

pytestmark = pytest.mark.slow
CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def cfg(tmp_path, lora: bool):
    overrides = [
        "model=tiny_sft",
        "model.sft.data.n=64",
        "model.sft.args.max_steps=4",
        "model.sft.args.learning_rate=5e-3",
        "trl.max_steps=1",
        "trl.per_device_train_batch_size=4",
        "trl.num_generations=2",
    ]
    if not lora:
        overrides += ["model.lora=null"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def base_weights(model):
    """The frozen (non-LoRA) weights of a peft model, keyed like a plain model's state dict."""
    sd = model.get_base_model().state_dict()
    return {k.replace(".base_layer", ""): v for k, v in sd.items() if "lora_" not in k}


@pytest.mark.parametrize("lora", [True, False])
def test_sft_output_is_start_and_reference(tmp_path, lora):
    c = cfg(tmp_path, lora)
    base = build_tiny_model()
    merged = run_sft(c, base, tmp_path / "sft", lora_config(c))
    w_base, w_sft = load_file(f"{base}/model.safetensors"), load_file(f"{merged}/model.safetensors")
    assert any(not torch.equal(w_base[k], w_sft[k]) for k in w_sft)  # SFT changed the model
    assert (
        run_sft(c, base, tmp_path / "sft", lora_config(c)) == merged
    )  # a resumed run reuses the finished SFT stage

    trainer = SageGRPOTrainer(
        model=merged,
        args=grpo_args(c, tmp_path / "rl"),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=arith_dataset(8, 0),
        peft_config=lora_config(c),
        divergence=ReverseKL(beta=0.05),
        guide=NoGuide(),
    )
    if lora:
        # TRL's reference for a fresh adapter = the adapter disabled = these frozen weights
        assert trainer.ref_model is None
        ref = base_weights(trainer.model)
    else:
        ref = trainer.ref_model.state_dict()
    for k, v in w_sft.items():
        assert torch.equal(ref[k].cpu(), v), k  # the reference is the SFT model ...
    assert any(not torch.equal(ref[k].cpu(), w_base[k]) for k in w_base)  # ... not the pre-SFT base
