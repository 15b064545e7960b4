"""sage.vllm_worker's CPU LoRA ops against vLLM's own (``vllm.lora.ops.torch_ops``), which they replace: the
same outputs for every case the ops' contract covers, and installed where vLLM's CPU LoRA path calls them."""

import pytest
import torch

pytest.importorskip("vllm")

from sage import vllm_worker  # noqa: E402  (installs the ops)

pytestmark = pytest.mark.vllm

TOKENS, IN, OUT, RANK, ADAPTERS = 37, 24, 40, 8, 3


def cases():
    g = torch.Generator().manual_seed(0)
    one = torch.full((TOKENS,), 1)
    mixed = torch.randint(-1, ADAPTERS, (TOKENS,), generator=g)  # -1: vLLM's "no adapter" index
    for indices in (one, mixed):
        for stacked in (False, True):  # vLLM stacks weights as [adapters, 1, out, in]
            yield g, indices, stacked


def weights(g, out, inp, stacked):
    w = torch.randn(ADAPTERS, out, inp, generator=g)
    return w[:, None] if stacked else w


@pytest.mark.parametrize("g,indices,stacked", list(cases()))
def test_shrink_matches_vllms_op(g, indices, stacked):
    x, w = torch.randn(TOKENS, IN, generator=g), weights(g, RANK, IN, stacked)
    ours, theirs = torch.zeros(TOKENS, RANK + 2), torch.zeros(TOKENS, RANK + 2)
    vllm_worker.bgmv_shrink(x, w, ours, indices, 0.5)
    vllm_worker.REPLACED["bgmv_shrink"](x, w, theirs, indices, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g,indices,stacked", list(cases()))
@pytest.mark.parametrize("add_inputs", [False, True])
@pytest.mark.parametrize("out_width", [OUT, OUT - 3])  # the model's output narrower than the adapter's
def test_expand_matches_vllms_op(g, indices, stacked, add_inputs, out_width):
    x, w = torch.randn(TOKENS, RANK, generator=g), weights(g, OUT, RANK, stacked)
    start = torch.randn(TOKENS, out_width, generator=g)
    ours, theirs = start.clone(), start.clone()
    vllm_worker.bgmv_expand(x, w, ours, indices, add_inputs)
    vllm_worker.REPLACED["bgmv_expand"](x, w, theirs, indices, add_inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g,indices,stacked", list(cases()))
@pytest.mark.parametrize("add_inputs", [False, True])
def test_expand_slice_matches_vllms_op(g, indices, stacked, add_inputs):
    x, w = torch.randn(TOKENS, RANK, generator=g), weights(g, OUT, RANK, stacked)
    start = torch.randn(TOKENS, OUT + 16, generator=g)
    ours, theirs = start.clone(), start.clone()
    vllm_worker.bgmv_expand_slice(x, w, ours, indices, 10, OUT, add_inputs)
    vllm_worker.REPLACED["bgmv_expand_slice"](x, w, theirs, indices, 10, OUT, add_inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_installed_where_vllms_cpu_lora_path_calls_them():
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in vllm_worker.OPS:
        assert getattr(punica_cpu, name) is getattr(vllm_worker, name)
        assert getattr(lora_ops, name) is getattr(vllm_worker, name)  # what lora_ops' sgmv_* ops call
        assert vllm_worker.REPLACED[name] is not getattr(vllm_worker, name)
