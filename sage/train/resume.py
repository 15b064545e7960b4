"""Whether and how a sage-train run resumes in its folder: ``plan_resume`` decides it from the config and
what the folder holds, before anything in it changes; ``sage.train.main.train_in`` carries the plan out.

A resume continues from a checkpoint whole on disk (``checkpoint_problem``; one that is not is set aside,
``set_aside_incomplete_checkpoints``), trained on as many processes as the resume has
(``processes_refusal``). An optimiser step takes ``trl.per_device_train_batch_size`` x processes x
``trl.gradient_accumulation_steps`` completions, and the ``trl.*`` keys of a run folder may not change on
resume (``sage.run_folder``), so another number of processes would change the run's batch from one step to
the next. The Trainer itself only notes, in a log line, that it found no RNG file for a process. The number
of processes a checkpoint was trained on is read from the RNG states the Trainer saved in it:
``rng_state.pth`` on one process, ``rng_state_<rank>.pth`` on each of several.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from sage import distributed
from sage.errors import ConfigError

if TYPE_CHECKING:
    from sage.config import Resume

log = logging.getLogger(__name__)

FINAL_FILE = "sage_final.json"


@dataclass(frozen=True)
class ResumePlan:
    """What a run does with what its folder holds (``plan_resume``)."""

    resume: Resume  # ``resume=`` as given
    refusal: (
        str | None
    )  # the one line that stops the run before anything in its folder changes; None: it runs
    checkpoint: Path | None  # RL continues from this whole checkpoint; None: from the start model
    final_step: int  # the step the folder's complete ``final/`` was saved at; -1: it has none
    reached: int  # the step the folder's model has trained to (final/ or a checkpoint); -1: none
    final_done: bool  # final/ is complete at trl.max_steps (> 0): RL is not run again, final/ is evaluated
    continue_run: bool  # the folder's MLflow run is continued (``start_run``'s resume); else a new one starts
    check_kept: bool  # the continued MLflow run must not have been deleted: checked in the store before work


def plan_resume(cfg: DictConfig, out: Path, processes: int) -> ResumePlan:
    """What a run of ``cfg`` on ``processes`` processes does in its folder ``out``; it only reads files.

    The run is refused, first reason first, when its last whole checkpoint was trained on another number of
    processes (``processes_refusal``); when the folder holds a run of another config, whatever ``resume``
    says (``sage.run_folder.check_identity``: a finished run without checkpoints would otherwise skip RL and
    report its old model under the new config); ``resume=true`` with no checkpoint; ``resume=false`` with
    one; a ``trl.max_steps`` below the step the folder's model has reached (a run is extended, never
    shortened: its model has already taken the steps a smaller trl.max_steps would stop before, so neither
    the model nor train/steps could match that config).

    The MLflow run of an earlier attempt is continued only with its work: a checkpoint, or a finished
    final/ (a base row, max_steps=0, has no checkpoint: its finished work is its metrics.json, and a rerun
    of its grid continues its MLflow run rather than recording the start model a second time)."""
    from sage.config import Resume, resume_mode
    from sage.run_folder import check_identity

    resume = resume_mode(cfg.resume)
    rl_dir = out / "rl"
    last = last_whole_checkpoint(rl_dir)
    final = final_step(out / "final")
    reached = max(final, checkpoint_step(last) if last is not None else -1)
    max_steps = cfg.trl.max_steps
    results_kept = resume != Resume.false and (out / "metrics.json").is_file()
    try:
        check_identity(cfg, out)
        other_config = None
    except ConfigError as e:
        other_config = str(e)
    refusals = [
        processes_refusal(cfg, out, processes),
        other_config,
        resume == Resume.true
        and last is None
        and f"resume=true but {rl_dir} holds no checkpoint-*/ folder to resume from",
        resume == Resume.false
        and last is not None
        and (
            f"{out} already holds checkpoints; pass resume=true (or auto) to continue "
            "or choose another output_dir"
        ),
        max_steps < reached
        and (
            f"trl.max_steps={max_steps} is below step {reached}, which the model in {out} has already "
            f"trained to: a run can be extended, not shortened; give trl.max_steps >= {reached}, or "
            "another output_dir"
        ),
    ]
    return ResumePlan(
        resume=resume,
        refusal=next((r for r in refusals if r), None),
        checkpoint=last,
        final_step=final,
        reached=reached,
        final_done=max_steps > 0 and final >= max_steps,
        continue_run=last is not None or final >= 0 or (max_steps == 0 and results_kept),
        check_kept=reached >= 0 or results_kept,
    )


def final_record(final: Path) -> dict:
    """What a complete ``final/`` records of itself (``global_step``; ``untrained``: true when its weights
    are the start model's); empty if there is none."""
    marker = final / FINAL_FILE
    return json.loads(marker.read_text()) if marker.is_file() else {}


def final_step(final: Path) -> int:
    """The optimiser step a complete ``final/`` was saved at; -1 if there is none."""
    return final_record(final).get("global_step", -1)


def checkpoint_step(folder: Path) -> int:
    """The optimiser step of a Trainer checkpoint folder ``checkpoint-<step>``."""
    return int(folder.name.removeprefix("checkpoint-"))


def _is_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and folder.name.removeprefix("checkpoint-").isdigit()


def last_whole_checkpoint(rl_dir: Path) -> Path | None:
    """The last ``checkpoint-<step>/`` in ``rl_dir`` that a resume can continue from; None if none can."""
    whole = [d for d in rl_dir.glob("checkpoint-*") if _is_checkpoint(d) and checkpoint_problem(d) is None]
    return max(whole, key=checkpoint_step, default=None)


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


def processes_refusal(cfg: DictConfig, out: Path, processes: int) -> str | None:
    """The one line refusing a resume into ``out`` on another number of processes than its last whole
    checkpoint was trained on; None where the run may go on."""
    from sage.config import Resume, resume_mode

    if resume_mode(cfg.resume) is Resume.false:
        return None  # resume=false refuses a folder with checkpoints on its own
    last = last_whole_checkpoint(out / "rl")
    then = checkpoint_processes(last) if last is not None else None
    if then is None or then == processes:
        return None
    per_process = cfg.trl.per_device_train_batch_size * cfg.trl.gradient_accumulation_steps
    return (
        f"output_dir={out}: {last.name} was trained on {then} process(es) ({per_process * then} completions "
        f"per optimiser step), this run has {processes} ({per_process * processes}): a resume keeps the "
        f"run's batch; resume on {then} process(es), or choose another output_dir"
    )


def check_resume_processes(cfg: DictConfig) -> None:
    """``processes_refusal`` for ``output_dir`` as a ConfigError, read by every process from the folder
    before the process group exists (a torchrun of another size would wait in it for processes that never
    come). No output_dir: a new folder."""
    if not cfg.output_dir:
        return
    refusal = processes_refusal(cfg, Path(cfg.output_dir).resolve(), distributed.world_size())
    if refusal is not None:
        raise ConfigError(refusal)


def set_aside_incomplete_checkpoints(rl_dir: Path) -> None:
    """A checkpoint-N/ that cannot be resumed from is renamed checkpoint-N.incomplete, with a logged line:
    kept for inspection, never resumed from, and out of the way of a rerun. That is one whose save a kill
    cut short (no readable trainer_state.json, which the Trainer writes after the weights, optimiser and
    RNG states, or an empty file), or whose files a copy or a disk cut short (a weight file whose size is
    not what its safetensors header describes, a torch file without its zip archive's closing record).
    SageGRPOTrainer saves a checkpoint under a temporary name and renames it once whole: a save a kill
    interrupted there (``.tmp-checkpoint-N/``) is set aside the same way."""
    if not rl_dir.is_dir():
        return
    for staging in sorted(rl_dir.glob(".tmp-checkpoint-*")):
        for folder in staging.glob("checkpoint-*"):
            _set_aside(folder, rl_dir / f"{folder.name}.incomplete", "its save was interrupted")
        shutil.rmtree(staging, ignore_errors=True)  # empty now
    for folder in sorted(rl_dir.glob("checkpoint-*")):
        if not _is_checkpoint(folder):
            continue
        problem = checkpoint_problem(folder)
        if problem is not None:
            _set_aside(folder, folder.with_name(f"{folder.name}.incomplete"), problem)


def _set_aside(folder: Path, aside: Path, why: str) -> None:
    shutil.rmtree(aside, ignore_errors=True)  # an older attempt's leftover of the same step
    folder.rename(aside)
    log.warning("%s cannot be resumed from (%s): set aside as %s", folder, why, aside)
