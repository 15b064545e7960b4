"""Multi-process runs (``torchrun``, or the SLURM launcher's several tasks per node): which process does what.

Every process runs sage-train with the same config. Training (the SFT stage and RL) is collective:
transformers/accelerate wrap the model in DDP and each process takes its share of every batch. Whatever
writes a record happens once, on the main process: the MLflow run, the merged SFT model, ``final/``,
the evaluation and its files. The other processes wait at a barrier where they need that result.
Outside a multi-process launch every helper here is a no-op (one process is the main one).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

_TOKEN: str | None = None


def world_size() -> int:
    """Processes of this run, as the launcher (torchrun, SLURM tasks through submitit) declares them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init(timeout_s: float) -> None:
    """Join the launcher's process group before anything collective (gloo on CPUs, NCCL on GPUs), with a
    collective timeout of ``timeout_s`` seconds (sage-train passes ``trl.ddp_timeout``).

    The group is created here, before the Trainer exists, so the Trainer's own ``ddp_timeout`` would be
    ignored (it only applies to a group it creates): without passing it, NCCL's default watchdog would
    apply. transformers' Trainer joins a CPU process group only when told it runs on the CPU; without that
    flag every process of a CPU launch would train alone, on its own copy of the data, with no error."""
    global _TOKEN
    if world_size() == 1 or initialized():
        return
    import torch
    from accelerate import PartialState

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_s))
    # every process starts together here, so this collective waits for no other job's work
    _TOKEN = broadcast(uuid.uuid4().hex)


def run_token() -> str:
    """An id shared by the processes of this run and by no other run (``init`` draws it); what a
    process names the files it leaves for its own run's other processes with."""
    if _TOKEN is None:
        raise RuntimeError("run_token() before distributed.init() of a multi-process run")
    return _TOKEN


def wait_for_file(path: Path, what: str, poll_s: float = 2.0) -> str:
    """Wait, outside any collective, until ``path`` exists; return its text.

    A process that waits on another job's work (a shared SFT model or base model another job is building)
    waits here, on the file system, never inside a collective: a collective has the group's timeout
    (``trl.ddp_timeout``), and a build by another job can last longer than any timeout worth setting. If
    this run's main process dies, the launcher (torchrun, srun) stops the others.

    The first polls come fast and back off to ``poll_s``: the main process's decision on work already done
    (a cached model, a finished evaluation cell) is written within milliseconds, and a fixed poll would
    leave every other process idle for half of ``poll_s`` on average, once per cell of every evaluation."""
    delay = 0.005
    while True:
        try:
            return path.read_text()
        except FileNotFoundError:
            time.sleep(delay)
            delay = min(poll_s, delay * 2)
        except OSError as e:
            raise RuntimeError(f"waiting for {what}: cannot read {path}: {e}") from e


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


def gather(value: Any) -> list[Any] | None:
    """Every process's ``value`` (any picklable object) in rank order, on the main process; None on the
    others. Outside a multi-process run: ``[value]``."""
    if not initialized():
        return [value]
    import torch.distributed as dist

    box = [None] * dist.get_world_size() if is_main() else None
    dist.gather_object(value, box, dst=0)
    return box
