"""What sage adds to vLLM's worker processes: the seeding RPC (:class:`VllmSeeding`), the sampled tokens'
log-probs of the distribution the trainer computes (:func:`use_tempered_logprobs`), and vLLM's CPU LoRA ops
computed with one matrix product per adapter instead of one weight copy per token.

Log-probs for the importance-sampling correction. TRL's training side computes ``log_softmax(logits / T)``:
the policy at the sampling temperature, untruncated. vLLM offers the sampled token's log-prob either raw
(before temperature) or processed (after temperature AND after min-p, top-p and top-k have removed and
renormalised mass). Neither is the trainer's distribution: under ``min_p`` the processed log-prob of every
sampled token is higher by ``-log(1 - m_t)`` (``m_t`` the mass removed), so each ratio is below 1 and a
sequence-level correction shrinks the whole policy gradient; the raw one differs at any ``T != 1``.
:func:`use_tempered_logprobs` makes one engine's sampler return ``log_softmax(logits / T)`` of the logits it
samples from (after vLLM's logits processors, e.g. a repetition penalty, before temperature), computed before
truncation: at equal weights the ratio is 1 up to numerics, so the correction sees only what it is for (the
engine's and the trainer's arithmetic, bf16 against fp32, and policy lag), and truncation stays a choice of
the sampler, as in TRL's own generation.

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

import types

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

    def sage_tempered_logprobs(self) -> bool:
        """:func:`use_tempered_logprobs` on this worker's sampler."""
        use_tempered_logprobs(self.model_runner.sampler)
        return True


SAMPLING_EPS = 1e-5  # vLLM's own: a temperature below it is greedy, for which the log-probs are at T = 1


def tempered_sample(self, logits, sampling_metadata, logprobs_mode_override=None):
    """vLLM V1 ``Sampler.sample`` that returns, when log-probs are asked for, ``log_softmax(logits / T)``
    per request (module docstring) in place of its processed log-probs. ``logits`` arrive after the logits
    processors and before temperature, which vLLM then applies in place: they are read first."""
    wanted = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
    tempered = None
    if wanted:
        temperature = sampling_metadata.temperature  # None when every request is greedy
        scaled = logits.float()
        if temperature is not None:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
            scaled = scaled / temperature.unsqueeze(1)
        tempered = scaled.log_softmax(dim=-1)
    sampled, processed = type(self).sample(self, logits, sampling_metadata, logprobs_mode_override)
    return sampled, tempered if wanted else processed


def use_tempered_logprobs(sampler) -> None:
    """Make vLLM's V1 sampler ``sampler`` (one engine's) return the sampled tokens' log-probs at the
    sampling temperature before truncation (:func:`tempered_sample`). Refuses another sampler: vLLM's V2
    model runner samples in other code, which this does not reach (sage builds its engines on V1, the code
    the CPU build runs)."""
    from vllm.v1.sample.sampler import Sampler

    if type(sampler) is not Sampler:
        raise RuntimeError(
            f"sage's importance-sampling log-probs need vLLM's V1 sampler, this engine has "
            f"{type(sampler).__module__}.{type(sampler).__name__}: set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    sampler.sample = types.MethodType(tempered_sample, sampler)


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
    """Use these ops in vLLM's CPU LoRA path (module docstring), on a CPU platform only (a CUDA engine
    uses Punica's Triton kernels). A vLLM without that path is left as is."""
    if torch.cuda.is_available():
        return
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
                raise RuntimeError(f"vLLM's {module.__name__} has no {name}: sage.vllm_worker needs updating")
            setattr(module, name, globals()[name])


install()
