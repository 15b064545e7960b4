"""What this machine can compute, probed: a CUDA GPU, a CPU with bfloat16 arithmetic, an installed package,
and the dtype a vLLM engine therefore serves in. The rules that depend on the machine (``sage.config``'s
checks of the vLLM engine and the 8-bit optimisers) ask here."""

from __future__ import annotations


def cuda_available() -> bool:
    """Whether a CUDA GPU is visible."""
    import torch

    return torch.cuda.is_available()


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (without importing it: vLLM's import takes seconds)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic, by the test vLLM's CPU build uses to pick its kernels
    (x86: AVX512-BF16, which every AMX CPU has too). Other architectures are trusted, as vLLM trusts them."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    return bool(torch.cpu._is_avx512_bf16_supported())


def engine_dtype(engine: str, model_dtype: str) -> str:
    """The dtype a vLLM engine serves the model in: ``engine`` (``model.engine_dtype``) as set, or for
    ``auto`` bfloat16 where this machine computes it, else ``model_dtype``. Engines run in bfloat16 on the
    cluster: an engine in the same dtype here meets the same engine/trainer mismatch in the
    importance-sampling correction, and the CPU's bfloat16 matrix products are the faster ones."""
    import torch

    if str(engine) != "auto":
        return str(engine)
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else str(model_dtype)
    return "bfloat16" if cpu_computes_bfloat16() else str(model_dtype)


def sampling_dtype(model_cfg, eval_cfg) -> str:
    """The dtype the evaluation samples in: the engine's under ``eval.backend=vllm``, else the model's."""
    model_dtype = str(getattr(model_cfg.dtype, "value", model_cfg.dtype))
    if eval_cfg.backend == "vllm":
        return engine_dtype(
            str(getattr(model_cfg.engine_dtype, "value", model_cfg.engine_dtype)), model_dtype
        )
    return model_dtype
