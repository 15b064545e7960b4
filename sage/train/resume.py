"""What a resume may continue from: a checkpoint whole on disk (``checkpoint_problem``), trained on as many
processes as the resume has (``check_resume_processes``).

An optimiser step takes ``trl.per_device_train_batch_size`` x processes x ``trl.gradient_accumulation_steps``
completions, and the ``trl.*`` keys of a run folder may not change on resume (``sage.run_folder``), so
another number of processes would change the run's batch from one step to the next. The Trainer itself
only notes, in a log line, that it found no RNG file for a process. The number of processes a checkpoint
was trained on is read from the RNG states the Trainer saved in it: ``rng_state.pth`` on one process,
``rng_state_<rank>.pth`` on each of several.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from sage import distributed
from sage.errors import ConfigError


def checkpoint_problem(folder: Path) -> str | None:
    """Why a Trainer checkpoint folder cannot be resumed from, read without loading it; None if it can."""
    import zipfile

    from sage.eval.checkpoint import weight_file_problem

    try:
        if not json.loads((folder / "trainer_state.json").read_text()):
            return "trainer_state.json is empty"
        for f in sorted(folder.iterdir()):
            if not f.is_file():
                continue
            problem = weight_file_problem(f) if f.suffix == ".safetensors" or f.stat().st_size == 0 else None
            if problem is None and f.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(f):
                problem = f"{f.name} is not a whole torch file"  # torch.save writes a zip archive
            if problem is not None:
                return problem
    except (OSError, ValueError):
        return "trainer_state.json is missing or unreadable (killed while saving?)"
    return None


def checkpoint_processes(folder: Path) -> int | None:
    """How many processes trained the Trainer checkpoint ``folder``; None where it holds no RNG state
    (``trl.save_only_model=true``)."""
    if (folder / "rng_state.pth").is_file():
        return 1
    return len(list(folder.glob("rng_state_*.pth"))) or None


def check_resume_processes(cfg: DictConfig) -> None:
    """Refuse, in one line, a resume into ``output_dir`` on another number of processes than its last whole
    checkpoint was trained on. Read by every process from the folder, before the process group exists."""
    from sage.config import Resume, resume_mode

    if resume_mode(cfg.resume) is Resume.false or not cfg.output_dir:
        return  # resume=false refuses a folder with checkpoints on its own; no output_dir: a new folder
    out = Path(cfg.output_dir).resolve()
    whole = [
        d
        for d in (out / "rl").glob("checkpoint-*")
        if d.is_dir() and d.name.removeprefix("checkpoint-").isdigit() and checkpoint_problem(d) is None
    ]
    if not whole:
        return
    last = max(whole, key=lambda d: int(d.name.removeprefix("checkpoint-")))
    then, now = checkpoint_processes(last), distributed.world_size()
    if then is None or then == now:
        return
    per_process = cfg.trl.per_device_train_batch_size * cfg.trl.gradient_accumulation_steps
    raise ConfigError(
        f"output_dir={out}: {last.name} was trained on {then} process(es) ({per_process * then} completions "
        f"per optimiser step), this run has {now} ({per_process * now}): a resume keeps the run's batch; "
        f"resume on {then} process(es), or choose another output_dir"
    )
