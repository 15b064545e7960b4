"""C++ kernels of the CPU evaluator, compiled on first use by torch's extension builder (a C++ compiler
with OpenMP, and ninja) into ``<sage cache>/kernels`` and registered as ``torch.ops.sage.*``.

One kernel so far, ``decode_attention`` (``decode_attention.cpp``): the attention of a decode step of
:class:`sage.eval.decode.CompactDecoder`. A build is keyed by the source, the compiler flags and the torch
version, so an edited kernel or another torch never loads a stale library; it compiles a copy of the source
kept in its folder, so checkouts at other paths with the same source share it without rebuilding. Concurrent
jobs on a cold cache build it once: each takes the build folder's flock (``sage.durable.folder_lock``) before
torch's builder runs.
Torch's own lock is a file made with O_EXCL that a killed build leaves behind, after which every later
build waits on it forever; under the flock no other build is alive, so such a file is stale and removed."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")


def compiler_flags() -> list[str]:
    """-O3 with OpenMP (torch's ``parallel_for`` in a header is a serial loop without it), the reordering
    of float sums that lets the compiler vectorise the dot products, and AVX2/FMA when torch itself runs
    its AVX2 kernels on this CPU."""
    flags = ["-O3", "-fopenmp"]
    flags += ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    if torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512")):
        flags += ["-mavx2", "-mfma"]
    return flags


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs ``ninja`` from PATH; the one pip installed next to this interpreter is not on
    it when a venv's scripts are run without activating the venv."""
    here = str(Path(sys.executable).parent)
    if shutil.which("ninja") is not None or not (Path(here) / "ninja").exists():
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = here + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


@functools.cache
def decode_attention_unavailable() -> str | None:
    """None once ``torch.ops.sage.decode_attention`` is loaded (built on first use on a machine, then cached),
    else the reason it cannot be (the compiler's error line, else the builder's first line)."""
    from torch.utils.cpp_extension import load

    from sage.durable import folder_lock
    from sage.paths import cache_dir

    flags = compiler_flags()
    code = SOURCE.read_bytes()
    key = hashlib.sha256(code + " ".join([*flags, torch.__version__]).encode()).hexdigest()
    name = f"sage_decode_attention_{key[:12]}"
    build_dir = cache_dir() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        log.info("building the decode attention kernel into %s (once per machine)", build_dir)
    try:
        with folder_lock(build_dir), _ninja_on_path():
            stale = build_dir / "lock"  # torch.utils.file_baton's lock file, left by a killed build
            if stale.exists():
                log.warning("removing the lock file of an interrupted kernel build: %s", stale)
                stale.unlink()
            # the build compiles its own copy of the source: torch's builder writes the source's path into
            # its ninja file, so two checkouts sharing this cache (a worktree, a second clone) would each
            # rewrite it and rebuild the kernel in turn; the key already names the content
            source = build_dir / SOURCE.name
            if not source.is_file() or source.read_bytes() != code:
                partial = source.with_name(source.name + ".partial")
                partial.write_bytes(code)
                partial.replace(source)
            load(
                name=name,
                sources=[str(source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as err:  # the builder raises RuntimeError/OSError/CalledProcessError with the cause
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line]  # the compiler's diagnostic, if any
        return f"{type(err).__name__}: {(errors or lines or ['no message'])[0]}"
    return None
