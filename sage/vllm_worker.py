"""What sage adds to vLLM's worker processes: the seeding RPC (:class:`VllmSeeding`), and vLLM's CPU LoRA
ops computed with one matrix product per adapter instead of one weight copy per token.

vLLM imports this module in each worker, to load :class:`VllmSeeding` (``worker_extension_cls``), and
importing it installs the ops there (:func:`install`); an engine that runs in the calling process
(``external_launcher``) installs them through :func:`sage.vllm_engine.build_llm`.

vLLM's CPU build applies LoRA through ``vllm.lora.ops.torch_ops``: each ``bgmv_*`` op gathers the adapter's
weight matrix once per token (``lora_b_weights[indices]``, a ``[tokens, out, rank]`` copy) and multiplies
token by token. A prefill of a training rollout's group (thousands of tokens) copies the up-projection's
LoRA matrix thousands of times per layer, which made vLLM's rollouts slower than transformers' ``generate``
on the same adapter (``make bench ARGS="--only real_rollout"``). The ops below compute the same products
with one matrix product per distinct adapter index in the batch (a rollout batch has one), and keep the
ops' contract: the same index semantics (a negative index picks from the end, as tensor indexing does), the
same padding and ``add_inputs`` rules.

:func:`install` puts them in place of vLLM's in the two modules that call them (``lora_ops``, whose
``sgmv_*`` ops call the ``bgmv_*`` ones, and ``punica_cpu``). CUDA builds use Triton kernels, not these ops.
"""

from __future__ import annotations

import torch

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
REPLACED: dict[str, object] = {}
"""vLLM's own ops, as :func:`install` found them (tests compare against them)."""


class VllmSeeding:
    """Mixed into vLLM's workers (``worker_extension_cls``), so that ``collective_rpc("sage_reseed", ...)``
    reseeds the generators that draw the sampling noise of every request without a seed of its own."""

    def sage_reseed(self, seed: int) -> None:
        from vllm.utils.torch_utils import set_random_seed

        set_random_seed(seed)


def per_adapter_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype
) -> torch.Tensor:
    """``out[t] = weights[indices[t]] @ inputs[t]`` for every token ``t`` (``weights``:
    ``[adapters, out, in]`` or ``[adapters, 1, out, in]``), as one matrix product per distinct index."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    values = torch.unique(indices).tolist()
    if len(values) == 1:
        return inputs @ weights[values[0]].to(dtype).T
    out = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for value in values:
        rows = indices == value
        out[rows] = inputs[rows] @ weights[value].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    # the adapter and the model may pad the output differently
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
):
    outputs = per_adapter_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def install() -> None:
    """Use these ops in vLLM's CPU LoRA path (module docstring). A vLLM without that path is left as is."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return
    for name in OPS:
        REPLACED.setdefault(name, getattr(lora_ops, name, None))
    for module in (lora_ops, punica_cpu):
        for name in OPS:
            if not hasattr(module, name):
                raise RuntimeError(
                    f"vLLM's {module.__name__} has no {name}: sage.vllm_cpu_lora needs updating"
                )
            setattr(module, name, globals()[name])


install()
