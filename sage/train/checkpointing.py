"""The trainer's checkpoints: ``CheckpointMixin`` saves each one whole or not at all, rotates only the
published ones, and on resume sets the learning rate the resumed schedule has at the checkpoint's step.

- ``_save_checkpoint`` (with ``_get_output_dir``): the same files, written into a temporary folder and
  renamed to ``checkpoint-N/`` once flushed to the disk, so a checkpoint is whole or absent.
- ``_load_optimizer_and_scheduler``: on resume, ``max_steps`` is the run's total length. TRL/transformers
  restore the learning rate the checkpoint's own schedule had reached (0 at the end of a finished run with a
  decaying schedule); this sets it to the value the resumed schedule (over the new ``max_steps``) has at the
  checkpoint's step, which is the same value when ``max_steps`` is unchanged.

transformers internals (pinned with trl==1.16.0) it relies on:
- overrides ``Trainer._save_checkpoint(model, trial)``, ``Trainer._get_output_dir(trial)`` (where every
  method that writes a checkpoint's files takes its folder) and
  ``Trainer._load_optimizer_and_scheduler(checkpoint)``;
- redoes ``Trainer._rotate_checkpoints``'s rule (keep ``args.save_total_limit``, the newest and
  ``state.best_model_checkpoint``) instead of calling it;
- sets ``LambdaLR._last_lr``, what ``get_last_lr()`` reports.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


class CheckpointMixin:
    """Put before ``GRPOTrainer`` among the bases; see the module docstring."""

    _staging: Path | None = None  # the temporary folder a checkpoint is being saved in

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        # The loaded state keeps the checkpoint's step and base rates; the lambdas stay this run's (LambdaLR
        # restores only a callable object's __dict__, empty for transformers' partials): the schedule over
        # the current max_steps.
        sched = self.lr_scheduler
        step = sched.last_epoch
        rates = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, rate in zip(sched.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        sched._last_lr = rates  # what get_last_lr() reports (the logged learning_rate): LambdaLR's own field

    def _save_checkpoint(self, model, trial):
        """TRL's and transformers' save, redirected into ``.tmp-checkpoint-N/checkpoint-N/`` and renamed to
        ``checkpoint-N/`` once every process has written its files and the main one has flushed them to
        the disk: a checkpoint is whole or absent, never resumed from half-written (a kill during the save
        leaves only the temporary folder, which the next start sets aside). The Trainer writes a
        checkpoint's files from several methods (weights, optimiser, each process's RNG state, trainer
        state, TRL's entropy controller), and every one takes the folder from ``_get_output_dir``: that is
        the one redirection. A callback could not do it: ``on_save`` runs after the files are in place.
        Old checkpoints are then rotated among the published ones (``_rotate_published``)."""
        from sage.durable import publish

        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging = run_dir / f".tmp-{name}"
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)  # a save of this step that failed earlier in this process
        self.accelerator.wait_for_everyone()
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()  # every process's files are in the temporary folder
        if self.args.should_save:
            target = run_dir / name
            if target.exists():  # a save of the same step by an earlier attempt of this run
                shutil.rmtree(target)
            publish(staging / name, target)
            staging.rmdir()
            self._rotate_published(run_dir)
        self.accelerator.wait_for_everyone()  # no process goes on before the checkpoint is in place

    def _get_output_dir(self, trial):
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _rotate_published(self, run_dir: Path) -> None:
        """transformers' rotation (keep ``save_total_limit``, the newest and the best), over the published
        ``checkpoint-N/`` folders in step order only: its own glob also counts the ``checkpoint-N.incomplete``
        folders sage-train sets aside for inspection, and would delete them."""
        limit = self.args.save_total_limit
        steps = sorted(
            int(p.name.removeprefix("checkpoint-"))
            for p in run_dir.glob("checkpoint-*")
            if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit()
        )
        if limit is None or limit <= 0 or len(steps) <= limit:
            return
        checkpoints = [run_dir / f"checkpoint-{step}" for step in steps]
        protected = {checkpoints[-1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if checkpoint not in protected:
                shutil.rmtree(checkpoint, ignore_errors=True)
                remaining -= 1
