"""The weights TRL sends to vLLM for a LoRA policy, computed out of place: the frozen base is never written.

TRL 1.16 (``VLLMGeneration._iter_named_params``) merges a peft adapter into the base in place, reads the
weights, then unmerges. In bfloat16 the merge and the unmerge each round, so every sync moves the frozen
base a little, and with it the reference (the adapter disabled): TRL issue #6688. Here a LoRA layer's
weight is ``W + sum_a s_a * B_a @ A_a`` in a new float32 tensor, rounded once to W's dtype, one layer at a
time as vLLM consumes them (extra memory: two float32 copies of one layer), under the names TRL sends.
Nothing else about the sync changes.

Plain LoRA on ``nn.Linear`` (``lora_alpha / r`` or rslora's scaling, read from the layer; ``lora_dropout``
plays no part in a merge) and ``modules_to_save`` are supported. Anything whose merge is not ``W + s*B@A``
(peft's LoRA variants such as DoRA, ``lora_bias``, LoRA on other layer types, other peft methods) raises.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from accelerate.utils import is_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import transpose
from trl.generation.vllm_generation import VLLMGeneration

UNSUPPORTED = "out-of-place vLLM weight sync (rollout=vllm with LoRA) does not support"


def vllm_name(name: str, adapter_prefix: str) -> str | None:
    """The name TRL 1.16 sends a peft model's parameter ``name`` under (its non-FSDP path), or None for the
    parameters it does not send: the adapter's own (merged into the base) and the frozen original of a
    ``modules_to_save`` module (its trained copy is sent instead). ``adapter_prefix``: the peft model's
    ``prefix`` (``lora_``); TRL skips every name that contains it."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if adapter_prefix in name or "original_module" in name:
        return None
    for prefix in ("_checkpoint_wrapped_module.", "modules_to_save.default."):
        name = name.replace(prefix, "")
    return name


def _variant_option(layer: LoraLinear, variant) -> str:
    """The LoraConfig option(s) that selected ``variant`` (e.g. ``use_dora``), from peft's own table."""
    names = [" + ".join(keys) for keys, cls in layer.lora_variants.items() if cls is type(variant)]
    return names[0] if names else type(variant).__name__


def lora_layers(model: torch.nn.Module) -> dict[int, LoraLinear]:
    """Every peft layer of ``model`` by the id of the base weight it adapts. Raises, in one line naming the
    peft option, for an adapter whose merge is not ``W + s * B @ A``: rather than sync other weights than
    the ones the policy computes with, or fall back to the in-place merge."""
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear:
            kind = f"{type(module).__module__}.{type(module).__name__}"
            raise ValueError(f"{UNSUPPORTED} {kind} ({name}): LoRA on nn.Linear only (peft target_modules)")
        for adapter in module.active_adapters:
            if adapter in module.lora_variant:
                option = _variant_option(module, module.lora_variant[adapter])
                raise ValueError(f"{UNSUPPORTED} LoraConfig.{option} ({name})")
            if module.lora_bias.get(adapter, False):
                raise ValueError(f"{UNSUPPORTED} LoraConfig.lora_bias=True ({name})")
        layers[id(module.get_base_layer().weight)] = module
    return layers


def merged_weight(layer: LoraLinear) -> torch.Tensor:
    """What peft's ``merge_adapter`` would write into the layer's base weight, as a new tensor: W plus, for
    each active adapter not already merged, ``scaling * B @ A`` (scaling is lora_alpha / r, or
    lora_alpha / sqrt(r) under rslora, as peft set it). Summed in float32 and rounded once to W's dtype:
    peft's merge of a float32 copy, cast back."""
    weight = layer.get_base_layer().weight.detach()  # (out, in); (in, out) under fan_in_fan_out
    adapters = [
        a for a in layer.active_adapters if a in layer.lora_A.keys() and a not in layer.merged_adapters
    ]
    if not adapters:
        return weight
    merged = weight.to(torch.float32, copy=True)  # a copy even of a float32 base: it is written below
    for adapter in adapters:
        b = layer.lora_B[adapter].weight.detach().float()  # (out, r)
        a = layer.lora_A[adapter].weight.detach().float()  # (r, in)
        delta = transpose(b @ a, layer.fan_in_fan_out)
        delta *= layer.scaling[adapter]  # peft's get_delta_weight: (B @ A) * scaling, the same roundings
        merged += delta
    return merged.to(weight.dtype)


def vllm_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for vLLM's ``load_weights``, in TRL's order and under TRL's names, for a peft model:
    LoRA layers' weights merged out of place (computed as they are consumed), every other parameter as is."""
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        target = vllm_name(name, model.prefix)
        if target is None:
            continue
        layer = layers.get(id(param))
        yield target, param.data if layer is None else merged_weight(layer)


class OutOfPlaceVLLMGeneration(VLLMGeneration):
    """TRL's VLLMGeneration; the only change is ``_iter_named_params`` for a peft model: :func:`vllm_weights`
    instead of merge_adapter / read / unmerge_adapter. Server and colocate modes both read weights here."""

    def _iter_named_params(self):
        if not is_peft_model(self.model):
            yield from super()._iter_named_params()
            return
        # A no-op outside DeepSpeed ZeRO-3; under it every LoRA layer needs its whole base weight, as in TRL.
        with self._dist.gather_params(list(self.model.parameters())):
            yield from vllm_weights(self.model)


def sync_out_of_place(generation: VLLMGeneration) -> None:
    """Make TRL's built ``generation`` (engine included) send out-of-place merged weights from now on.
    GRPOTrainer builds its VLLMGeneration inside ``__init__``, so the subclass is put on the built object
    (it adds no state) rather than building a second engine. Unsupported adapters fail here, before
    training."""
    if is_peft_model(generation.model):
        if generation._dist.is_fsdp:
            raise ValueError(f"{UNSUPPORTED} FSDP with a peft model: use DDP")
        lora_layers(generation.model)
    generation.__class__ = OutOfPlaceVLLMGeneration
