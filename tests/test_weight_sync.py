"""rollout=vllm with LoRA: what SageGRPOTrainer sends to vLLM is W + s * B @ A computed out of place
(sage.train.weight_sync), so the frozen bfloat16 base, and with it the reference (the adapter disabled), stay
bit-identical over any number of syncs. TRL's own in-place merge_adapter / unmerge_adapter moves them
(TRL issue #6688). The weights sent are peft's merge, under exactly the names TRL sends.

No engine is started: TRL's ``VLLMGeneration._init_vllm`` is replaced by a receiver standing in for the
colocated engine's ``load_weights``; the trainer, its VLLMGeneration and ``sync_weights`` are the real ones.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig
from trl.generation.vllm_generation import VLLMGeneration

from sage.objective.divergences import ReverseKL
from sage.objective.guides import NoGuide
from sage.testbed.model import build_tiny_model
from sage.testbed.task import arith_dataset
from sage.train.trainer import SageGRPOTrainer
from sage.train.weight_sync import OutOfPlaceVLLMGeneration

CYCLES = 500  # syncs, i.e. optimiser steps of a run with rollout=vllm
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        train_steps=3,
        n_train_problems=64,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )


class Receiver:
    """The colocated engine as TRL's ``sync_weights`` reaches it (``llm.reset_prefix_cache`` and
    ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``) and as SageGRPOTrainer
    reaches its sampler (``...model_runner.sampler``). Keeps a copy of each
    tensor, as vLLM copies it into its own buffers (TRL's in-place path hands over the live parameter, which
    it unmerges right after)."""

    def __init__(self):
        from vllm.v1.sample.sampler import Sampler

        self.sent: dict[str, torch.Tensor] = {}
        # vLLM's own sampler, which SageGRPOTrainer makes return the trainer's log-probs (sage.vllm_worker)
        self.sampler = Sampler(logprobs_mode="processed_logprobs")
        runner = SimpleNamespace(model=self, sampler=self.sampler)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )

    def load_weights(self, weights):
        for name, tensor in weights:
            self.sent[name] = tensor.clone()

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def no_engine(monkeypatch):
    def init(generation):
        generation.llm = Receiver()

    monkeypatch.setattr(VLLMGeneration, "_init_vllm", init)


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def make_trainer(path, tmp, **lora) -> SageGRPOTrainer:
    """rollout=vllm's trainer on a bfloat16 base (LoRA keeps the frozen base in model.dtype), rank 8 on every
    projection, and a trained adapter: B != 0 (peft starts it at 0) and trained modules_to_save copies."""
    args = GRPOConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        beta=0.04,
        use_bias_correction_kl=False,
        report_to="none",
        max_steps=1,
        bf16=False,
        use_vllm=True,
        vllm_mode="colocate",
        model_init_kwargs={"dtype": "bfloat16"},
    )
    config = dict(
        r=8, lora_alpha=16, target_modules=PROJECTIONS, modules_to_save=["norm"], task_type="CAUSAL_LM"
    )
    trainer = SageGRPOTrainer(
        model=path,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=arith_dataset(16, 0),
        peft_config=LoraConfig(**{**config, **lora}),
        divergence=ReverseKL(0.04),
        guide=NoGuide(),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(0.02 * torch.randn(param.shape, generator=gen).to(param.dtype))
    return trainer


def frozen(model) -> dict[str, torch.Tensor]:
    """The frozen base: every parameter but the adapter's and modules_to_save's trained copies."""
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if "lora_" not in n and "modules_to_save" not in n
    }


def logits(model, adapter: bool) -> torch.Tensor:
    ids = torch.arange(16).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        if adapter:
            return model(input_ids=ids).logits
        with model.disable_adapter():  # TRL's reference for a peft policy
            return model(input_ids=ids).logits


def run_syncs(trainer, cycles: int) -> dict[str, torch.Tensor]:
    """``cycles`` of TRL's ``sync_weights``; what the last one sent, by name, in the order sent."""
    receiver = trainer.vllm_generation.llm
    for _ in range(cycles):
        receiver.sent = {}
        trainer.vllm_generation.sync_weights()
    return receiver.sent


def test_out_of_place_sync_leaves_base_and_reference_bit_identical(model_path, tmp_path, no_engine):
    trainer = make_trainer(model_path, tmp_path)
    model = trainer.model
    base, reference, policy = frozen(model), logits(model, adapter=False), logits(model, adapter=True)

    sent = run_syncs(trainer, CYCLES)

    after = frozen(model)
    assert after.keys() == base.keys()
    changed = [n for n in base if not torch.equal(base[n], after[n])]
    assert changed == []
    assert torch.equal(logits(model, adapter=False), reference)
    assert torch.equal(logits(model, adapter=True), policy)
    # the adapter was not a no-op: what was sent differs from the base wherever LoRA sits
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], base[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    assert type(trainer.vllm_generation) is OutOfPlaceVLLMGeneration
    # the colocated engine's sampler returns the trainer's log-probs (before truncation, at the temperature)
    assert trainer.vllm_generation.llm.sampler.sample.__func__.__name__ == "tempered_sample"


def test_trl_in_place_sync_moves_base_and_reference(model_path, tmp_path, no_engine):
    """The same loop through TRL's own VLLMGeneration: the bug this module works around, and proof that
    the test above can fail."""
    trainer = make_trainer(model_path, tmp_path)
    trainer.vllm_generation.__class__ = VLLMGeneration  # undo SageGRPOTrainer's change: TRL 1.16 as shipped
    model = trainer.model
    base, reference = frozen(model), logits(model, adapter=False)

    run_syncs(trainer, CYCLES)

    after = frozen(model)
    lora_weights = [n for n in base if ".base_layer.weight" in n]
    changed = [n for n in lora_weights if not torch.equal(base[n], after[n])]
    assert changed, "TRL's in-place merge/unmerge left the bfloat16 base intact: is TRL issue #6688 fixed?"
    assert not torch.equal(logits(model, adapter=False), reference)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_sent_weights_are_peft_merge_under_trl_names(model_path, tmp_path, no_engine, use_rslora):
    trainer = make_trainer(model_path, tmp_path, use_rslora=use_rslora)
    model = trainer.model
    # peft's own merge of a float32 copy, rounded once to bfloat16: the most accurate merged model
    merged = copy.deepcopy(model).float().merge_and_unload()
    expected = {n: p.detach().to(torch.bfloat16) for n, p in merged.named_parameters()}

    ours = run_syncs(trainer, 1)
    trainer.vllm_generation.__class__ = VLLMGeneration
    theirs = run_syncs(trainer, 1)  # TRL's first sync, before any unmerge has rounded the base

    assert list(ours) == list(theirs)  # the same names, in the same order
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor.float(), expected[name].float(), rtol=2**-7, atol=0, msg=name)
        # on a clean base TRL's merge rounds W + s * B @ A (float32) once, as we do: the very same bits
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize(
    ("lora", "option"),
    [
        (dict(use_dora=True), "LoraConfig.use_dora"),
        (dict(lora_bias=True), "LoraConfig.lora_bias=True"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules"),
    ],
)
def test_adapters_the_out_of_place_merge_cannot_compute_fail_at_start(
    model_path, tmp_path, no_engine, lora, option
):
    with pytest.raises(ValueError, match=option) as info:
        make_trainer(model_path, tmp_path, **lora)
    assert "\n" not in str(info.value)
