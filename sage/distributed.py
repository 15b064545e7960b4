"""Multi-process runs (``torchrun``, or the SLURM launcher's several tasks per node): which process does what.

Every process runs sage-train with the same config. Training (the SFT stage and RL) is collective:
transformers/accelerate wrap the model in DDP and each process takes its share of every batch. Whatever
writes a record happens once, on the main process: the MLflow run, the merged SFT model, ``final/``,
the evaluation and its files. The other processes wait at a barrier where they need that result.
Outside a multi-process launch every helper here is a no-op (one process is the main one).
"""

from __future__ import annotations

import os
from typing import Any


def world_size() -> int:
    """Processes of this run, as the launcher (torchrun, SLURM tasks through submitit) declares them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init() -> None:
    """Join the launcher's process group before anything collective (gloo on CPUs, NCCL on GPUs).

    transformers' Trainer joins a CPU process group only when told it runs on the CPU; without that flag
    every process of a CPU launch would train alone, on its own copy of the data, with no error."""
    if world_size() == 1 or initialized():
        return
    import torch
    from accelerate import PartialState

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    PartialState(cpu=cpu)


def rank() -> int:
    if initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if initialized():
        import torch.distributed as dist

        dist.barrier()


def broadcast(value: Any) -> Any:
    """The main process's ``value`` (any picklable object), on every process."""
    if not initialized():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
