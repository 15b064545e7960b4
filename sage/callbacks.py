"""Training-time callbacks that are not TRL's: held-out accuracy every N optimiser steps (Figure 2:
train reward vs held-out accuracy), sampled with the evaluator's own sampler and graded by Math-Verify."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback

from sage.metrics import pass_at_k_curve
from sage.rewards import grade

log = logging.getLogger(__name__)


class PeriodicEval(TrainerCallback):
    """Every ``every`` optimiser steps: ``settings.n_samples`` samples per held-out problem from the model
    being trained; pass@1 and pass@n go to MLflow as ``eval/periodic/<dataset>/pass_at_<k>`` at that step
    and to ``<out>/periodic_eval.json``. The global torch RNG is restored afterwards, so evaluating does
    not change the training samples."""

    def __init__(self, rows_by_dataset, settings, every: int, batch_size: int, tracker, out: Path):
        self.rows_by_dataset = rows_by_dataset
        self.settings = settings
        self.every = every
        self.batch_size = batch_size
        self.tracker = tracker
        self.path = out / "periodic_eval.json"
        self.records = json.loads(self.path.read_text()) if self.path.exists() else []

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every:
            return
        from sage.evaluate import sample_completions

        rng = torch.get_rng_state()
        was_training = model.training
        model.eval()
        try:
            for name, rows in self.rows_by_dataset.items():
                completions = sample_completions(
                    model, processing_class, rows, self.settings, self.batch_size
                )
                correct = np.array(
                    [
                        [grade(c, r["answer"]) == 1.0 for c in per_row]
                        for per_row, r in zip(completions, rows, strict=True)
                    ]
                )
                n = self.settings.n_samples
                curve = pass_at_k_curve(correct, [1, n])
                record = {
                    "step": state.global_step,
                    "dataset": name,
                    "pass@1": curve[1],
                    f"pass@{n}": curve[n],
                }
                self.records.append(record)
                if self.tracker is not None:
                    self.tracker.log_metrics(
                        {
                            f"eval/periodic/{name}/pass@1": curve[1],
                            f"eval/periodic/{name}/pass@{n}": curve[n],
                        },
                        step=state.global_step,
                    )
                log.info("step %d: held-out %s pass@1 %.3f", state.global_step, name, curve[1])
        finally:
            model.train(was_training)
            torch.set_rng_state(rng)
        self.path.write_text(json.dumps(self.records, indent=1))
