"""The decode attention kernel (sage/kernels/decode_attention.cpp) against the same attention written in
plain torch (masked softmax over a row's prompt keys and its own generated keys), on shapes that exercise
grouped/multi-query heads, left padding, a batch that is not a multiple of the kernel's row block, a cache
with more rows and slots than are live, and scores spread far enough to reach the tails of the kernel's
exp; slots, rows and padding positions it must not read are NaN. Also: bad inputs are refused, a kernel
that does not compile is reported with the compiler's error, and the decoder's "auto" attention falls back
to torch ops with that reason while "kernel" refuses to."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import sage.eval.kernels as kernels
from sage.eval.decode import CompactDecoder
from sage.eval.sampling import HFSampler, SamplingSettings
from sage.testbed.tokenizer import build_tokenizer

NAN = float("nan")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    reason = kernels.decode_attention_unavailable()
    assert reason is None, reason  # CI builds it: a machine that cannot is a failure here, not a skip


def reference(q, prompt_k, prompt_v, real, owner, cache_k, cache_v, end):
    """softmax over [prompt positions (padding excluded) | own slots < end], then the weighted values."""
    b = q.shape[0]
    pk, pv = prompt_k[owner], prompt_v[owner]  # (B, kv, W, D)
    own_k, own_v = cache_k[:end, :b].permute(1, 2, 0, 3), cache_v[:end, :b].permute(1, 2, 0, 3)
    keys, values = torch.cat([pk, own_k], 2), torch.cat([pv, own_v], 2)  # (B, kv, W + end, D)
    scores = torch.einsum("bhgd,bhld->bhgl", q, keys)
    allowed = torch.cat([real[owner], torch.ones(b, end, dtype=torch.bool)], 1)[:, None, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("bhgl,bhld->bhgd", probs, values.nan_to_num(0.0))


def inputs(*, b, kv, g, d, p, w, rows, slots, end, pad, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kv, g, d, generator=gen) * scale
    prompt_k, prompt_v = (torch.randn(p, kv, w, d, generator=gen) for _ in range(2))
    real = torch.ones(p, w, dtype=torch.bool)
    for i, n in enumerate(pad):  # left padding of n positions on prompt i
        real[i, :n] = False
    prompt_k.masked_fill_(~real[:, None, :, None], NAN)  # never read
    prompt_v.masked_fill_(~real[:, None, :, None], NAN)
    cache_k, cache_v = (torch.full((slots, rows, kv, d), NAN) for _ in range(2))
    cache_k[:end, :b] = torch.randn(end, b, kv, d, generator=gen)
    cache_v[:end, :b] = torch.randn(end, b, kv, d, generator=gen)
    owner = torch.sort(torch.randint(p, (b,), generator=gen)).values
    return q, prompt_k, prompt_v, real, owner, cache_k, cache_v, end


CASES = {
    # grouped-query heads, padding on two prompts, 70 rows (two full blocks of 32 and a partial one)
    "gqa_padded": dict(b=70, kv=2, g=2, d=16, p=3, w=5, rows=80, slots=12, end=7, pad=[2, 0, 4]),
    # multi-query, one-token prompts, the first step
    "mqa_first_step": dict(b=9, kv=1, g=4, d=8, p=2, w=1, rows=9, slots=3, end=1, pad=[]),
    # the testbed's shape, every slot written, no padding
    "testbed_full": dict(b=33, kv=4, g=1, d=32, p=4, w=8, rows=40, slots=20, end=20, pad=[]),
    # scores spread over hundreds: most probabilities underflow, the kernel's exp is clamped at -87
    "spread": dict(b=40, kv=2, g=1, d=16, p=2, w=6, rows=40, slots=9, end=9, pad=[3], scale=30.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_torch_attention(case):
    args = inputs(**CASES[case])
    got = torch.ops.sage.decode_attention(*args)
    expected = reference(*args)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)
    # the comparison discriminates: outputs differ across rows far more than the tolerance
    assert expected.std() > 0.05


def test_kernel_refuses_bad_inputs():
    args = list(inputs(**CASES["gqa_padded"]))
    with pytest.raises(RuntimeError, match="float32 contiguous"):
        torch.ops.sage.decode_attention(args[0].double(), *args[1:])
    with pytest.raises(RuntimeError, match="float32 contiguous"):
        torch.ops.sage.decode_attention(args[0].transpose(1, 2), *args[1:])
    with pytest.raises(RuntimeError, match="S >= end >= 1"):
        torch.ops.sage.decode_attention(*args[:-1], 13)  # 12 slots
    with pytest.raises(RuntimeError, match="owner: int64"):
        torch.ops.sage.decode_attention(*args[:4], args[4].int(), *args[5:])


def test_a_kernel_that_does_not_compile_is_reported(tmp_path, monkeypatch):
    broken = tmp_path / "decode_attention.cpp"
    broken.write_text('#error "sage test: this kernel does not compile"\n')
    monkeypatch.setattr(kernels, "SOURCE", broken)
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    reason = kernels.decode_attention_unavailable.__wrapped__()
    assert reason is not None and "this kernel does not compile" in reason
    assert "\n" not in reason


def test_auto_attention_falls_back_with_the_reason_and_kernel_refuses(monkeypatch, caplog):
    from tests.test_decode import RANDOM_MODELS, randomised

    model = randomised(RANDOM_MODELS["qwen2_gqa"]())
    assert CompactDecoder(model).attention == "kernel"
    assert CompactDecoder(model, attention="torch").attention_fallback is None
    with pytest.raises(ValueError, match="'flash' is not one of"):
        CompactDecoder(model, attention="flash")
    monkeypatch.setattr(kernels, "decode_attention_unavailable", lambda: "OSError: no c++ compiler")
    auto = CompactDecoder(model)
    assert (auto.attention, auto.attention_fallback) == ("torch", "OSError: no c++ compiler")
    with pytest.raises(RuntimeError, match="no c\\+\\+ compiler"):
        CompactDecoder(model, attention="kernel")
    sampler = HFSampler(model, build_tokenizer(), batch_size=4)
    s = SamplingSettings(n_samples=2, temperature=1.0, top_p=1.0, max_new_tokens=5, chat=False, seed=0)
    with caplog.at_level(logging.WARNING, logger="sage.eval.sampling"):
        sampler.sample([[5, 6, 7], [8, 9]], s)
        sampler.sample([[5, 6, 7], [8, 9]], s)
    warnings = [r.getMessage() for r in caplog.records if r.name == "sage.eval.sampling"]
    assert len(warnings) == 1 and "no c++ compiler" in warnings[0]  # once per sampler, with the reason


def test_a_lock_file_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    """torch's builder waits for as long as its lock file exists; a build killed mid-way leaves that file, and
    every later evaluation then hung. Under sage's flock the file is stale and goes: the next build (a new
    process, as after a kill) runs, here to its compile error, instead of waiting."""
    import subprocess
    import sys

    broken = tmp_path / "decode_attention.cpp"
    broken.write_text('#error "sage test: this kernel does not compile"\n')
    build = (
        "import sys, sage.eval.kernels as k; from pathlib import Path; k.SOURCE = Path(sys.argv[1]); "
        "print(k.decode_attention_unavailable())"
    )
    env = {**os.environ, "SAGE_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, "-c", build, str(broken)]
    first = subprocess.run(run, env=env, capture_output=True, text=True)
    assert "does not compile" in first.stdout, first.stderr[-2000:]
    (build_dir,) = (tmp_path / "cache" / "kernels").glob("sage_decode_attention_*")
    (build_dir / "lock").touch()  # what a SIGKILLed build leaves
    second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert "does not compile" in second.stdout, second.stderr[-2000:]
    assert not (build_dir / "lock").exists()


def test_a_second_checkout_of_the_same_source_loads_the_build_without_rebuilding(tmp_path):
    """Two checkouts (a worktree, a second clone) at other paths share the cache: the second loads the first's
    library as built, where compiling the source in place made each rewrite torch's ninja file and rebuild.
    A source that needs no torch header keeps the builds short."""
    import subprocess
    import sys

    checkouts = [tmp_path / "a" / "decode_attention.cpp", tmp_path / "b" / "decode_attention.cpp"]
    for source in checkouts:
        source.parent.mkdir()
        source.write_text('extern "C" int sage_test_nothing() { return 0; }\n')
    build = (
        "import sys, sage.eval.kernels as k; from pathlib import Path; k.SOURCE = Path(sys.argv[1]); "
        "print(k.decode_attention_unavailable())"
    )
    env = {**os.environ, "SAGE_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run(
        [sys.executable, "-c", build, str(checkouts[0])], env=env, capture_output=True, text=True
    )
    assert first.stdout.strip() == "None", first.stderr[-2000:]
    (build_dir,) = (tmp_path / "cache" / "kernels").glob("sage_decode_attention_*")
    (library,) = build_dir.glob("*.so")
    built = (library.stat().st_mtime_ns, (build_dir / "build.ninja").read_text())
    second = subprocess.run(
        [sys.executable, "-c", build, str(checkouts[1])], env=env, capture_output=True, text=True
    )
    assert second.stdout.strip() == "None", second.stderr[-2000:]
    assert (library.stat().st_mtime_ns, (build_dir / "build.ninja").read_text()) == built
    assert str(tmp_path / "a") not in built[1]  # the ninja file names the build folder's copy
