"""Training-time callbacks that are not TRL's: held-out accuracy every N optimiser steps (Figure 2:
train reward vs held-out accuracy), sampled with the evaluator's own sampler and graded by each row's
verifier through the run's grading pool; Optuna pruning on those periodic metrics; per-step timing lines; a
one-line warning when a vLLM rollout's importance-sampling ratio starts away from 1; and one when the guide
acted on almost no token."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from sage import distributed
from sage.eval.analyses import tier_figures
from sage.metrics import metric_name, pass_at_k_curve

log = logging.getLogger(__name__)


class PeriodicEval(TrainerCallback):
    """Every ``every`` optimiser steps: ``settings.n_samples`` samples per held-out problem from the model
    being trained; pass@1 and pass@n go to MLflow as ``pass_at_<k>/periodic/<dataset>`` at that step
    (with, on the testbed, the figures by tier of ``sage.eval.analyses.tier_figures``) and to
    ``<out>/periodic_eval.json``. The global torch RNG is restored afterwards, so evaluating does
    not change the training samples. The step's metrics are then handed to the ``on_evaluate`` of each of
    ``callbacks`` (the run's ``callbacks`` node), as a trainer hands its own evaluation's metrics.

    It samples as the end-of-run evaluation's HF backend does (``sage.eval.evaluate.sample_cell``: the same
    sampler, blocks and block seeds), on the current weights: the same weights give the same correctness
    matrix here as in ``sage-eval``. In a multi-process run every process samples and grades its share of
    the blocks on its own replica of the model, and the main process alone merges, logs and writes.

    ``engine``: the training rollouts' engine (``rollout=vllm``), whose ``sampler()`` serves the current
    policy; the evaluation then samples through it, as the end-of-run evaluation's vLLM backend does, and
    no second model or KV cache is allocated beside it. None: the HF backend on the model being trained."""

    def __init__(
        self,
        rows_by_dataset,
        settings,
        every: int,
        batch_size: int,
        tracker,
        out: Path,
        pool,
        callbacks=(),
        engine=None,
    ):
        self.engine = engine
        self.rows_by_dataset = rows_by_dataset
        self.pool = pool
        self.callbacks = list(callbacks)
        self.settings = settings
        self.every = every
        self.batch_size = batch_size
        self.tracker = tracker
        self.path = out / "periodic_eval.json"
        self.records = json.loads(self.path.read_text()) if self.path.exists() else []

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every:
            return
        self._evaluate(args, state, control, model, processing_class)  # on every process: its share
        # A callback's decision to stop (pruning) must reach every process: the others would otherwise wait
        # in the next step's collective for a process that has stopped.
        control.should_training_stop = distributed.broadcast(control.should_training_stop)

    def _evaluate(self, args, state, control, model, processing_class) -> None:
        from sage.eval.evaluate import sample_cell
        from sage.eval.sampling import HFSampler

        rng = torch.get_rng_state()
        was_training = model.training
        model.eval()
        # ``model`` is the Trainer's own module, not its DDP wrapper: sampling runs no collective
        if self.engine is not None:
            sampler = self.engine.sampler()
        else:
            sampler = HFSampler(model, processing_class, self.batch_size)
        matrices = {}
        try:
            for name, rows in self.rows_by_dataset.items():
                merged = sample_cell(sampler, processing_class, rows, self.settings, self.pool)
                if merged is not None:  # the main process
                    matrices[name] = merged
        finally:
            model.train(was_training)
            torch.set_rng_state(rng)
        if not distributed.is_main():
            return
        metrics: dict[str, float] = {}
        n = self.settings.n_samples
        for name, (correct, completions) in matrices.items():
            curve = pass_at_k_curve(correct, [1, n])
            self.records.append(
                {
                    "step": state.global_step,
                    "dataset": name,
                    "problems": int(correct.shape[0]),
                    "pass@1": curve[1],
                    f"pass@{n}": curve[n],
                }
            )
            step_metrics = {
                metric_name("periodic", name, "pass@1"): curve[1],
                metric_name("periodic", name, f"pass@{n}"): curve[n],
            }
            # on the testbed, by tier: the rare strategy's share on tail problems over training
            tiers = tier_figures(self.rows_by_dataset[name], completions, correct)
            step_metrics |= {metric_name("periodic", name, k): v for k, v in tiers.items()}
            metrics.update(step_metrics)
            if self.tracker is not None:
                self.tracker.log_metrics(step_metrics, step=state.global_step)
            log.info("step %d: held-out %s pass@1 %.3f", state.global_step, name, curve[1])
        self.path.write_text(json.dumps(self.records, indent=1))
        for callback in self.callbacks:
            callback.on_evaluate(args, state, control, metrics=metrics)


class OptunaPruning(TrainerCallback):
    """Optuna pruning on the periodic evaluation: each ``metric`` it hands to ``on_evaluate`` is reported to
    trial number ``trial`` of the study ``study`` in ``storage``, and training stops when ``pruner`` says
    so (``pruned_at`` is then that step). ``hydra/sweeper=optuna`` adds it to each trial as
    ``+callbacks.optuna_pruning`` with its own pruner's node, as Optuna does not store the pruner."""

    def __init__(self, storage: str, study: str, trial: int, metric: str, pruner) -> None:
        import optuna

        store = optuna.storages.get_storage(storage)
        study_id = store.get_study_id_from_name(study)
        self.study = optuna.load_study(study_name=study, storage=store, pruner=pruner)
        self.trial = optuna.Trial(self.study, store.get_trial_id_from_study_id_trial_number(study_id, trial))
        self.metric = metric
        self.pruned_at: int | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.trial.report(metrics[self.metric], state.global_step)
        if self.trial.should_prune():
            log.info("step %d: the study's pruner stops this trial", state.global_step)
            self.pruned_at = state.global_step
            control.should_training_stop = True


class StepTimes(TrainerCallback):
    """Per optimiser step, on every process, one line: the rollout's time, the adapter hand-over's and the
    rest of the step (scoring, log-prob passes, backward, optimiser), and this process's peak memory so far
    (its GPU's allocator peak on CUDA, else the process's peak RSS). ``engine``: the rollout function that
    times its calls (``rollout=vllm``). What ``launchers/first_hour.py`` reads off a first run on a
    cluster."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._started = 0.0
        self._seen = (0, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._started:  # the first micro-batch of the step: it generates the step's rollouts
            self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        wall = time.perf_counter() - self._started
        self._started = 0.0
        rollouts, handovers = self._seen
        rollout = sum(self.engine.rollout_seconds[rollouts:])
        handover = sum(self.engine.handover_seconds[handovers:])
        self._seen = (len(self.engine.rollout_seconds), len(self.engine.handover_seconds))
        log.info(
            "step %d, process %d: rollout %.2fs, adapter hand-over %.3fs, rest %.2fs; "
            "peak memory %.2f GiB (%s)",
            state.global_step,
            distributed.rank(),
            rollout,
            handover,
            wall - rollout - handover,
            *peak_memory(),
        )


RATIO_KEY = "sampling/importance_sampling_ratio/mean"
RATIO_RANGE = (0.9, 1.1)


class FirstRatioCheck(TrainerCallback):
    """Warns in one line when the importance-sampling ratio's mean at the first logged step of a vLLM
    rollout leaves RATIO_RANGE. At the first step the engine and the trainer hold the same weights, so the
    ratio measures only how differently they compute the same distribution: far from 1, the correction
    rescales the policy gradient rather than correcting it (another dtype, another sampling distribution)."""

    def __init__(self) -> None:
        self.checked = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.checked or not logs or RATIO_KEY not in logs:
            return
        self.checked = True
        ratio = logs[RATIO_KEY]
        if not RATIO_RANGE[0] <= ratio <= RATIO_RANGE[1] and distributed.is_main():
            log.warning(
                "the importance-sampling ratio's mean at the first step is %.3f, outside [%g, %g]: the "
                "engine "
                "samples from another distribution than the trainer computes (dtype, sampling keys); "
                "see docs/reference.md, 'The importance-sampling correction'",
                ratio,
                *RATIO_RANGE,
            )


GUIDE_ACTIVE_KEY = "guide/active_frac"
GUIDE_ACTIVE_MIN = 0.01


class GuideActivity(TrainerCallback):
    """Warns in one line at the end of training when the guide changed q on under GUIDE_ACTIVE_MIN of the
    completion tokens (the mean over the run of the trainer's logged ``guide/active_frac``): such a run is
    its divergence's plain pi_ref anchor in all but name. An Optuna search whose threshold range lay above
    the testbed's token entropies returned the same objective for every trial, and nothing said why.
    ``knob``: the guide's key that sets where it acts (``guide.threshold=1.2``, else ``guide=<option>``);
    ``hint``: what to change, appended to the line."""

    def __init__(self, knob: str, hint: str = "") -> None:
        self.knob, self.hint = knob, hint

    def on_train_end(self, args, state, control, **kwargs):
        values = [e[GUIDE_ACTIVE_KEY] for e in state.log_history if GUIDE_ACTIVE_KEY in e]
        if not values or not distributed.is_main():
            return
        active = sum(values) / len(values)
        if active < GUIDE_ACTIVE_MIN:
            log.warning(
                "%s: the guide acted on %.2f%% of completion tokens (%s, mean of %d logged steps), under "
                "%g%%: the anchor was almost plain pi_ref%s",
                self.knob,
                100 * active,
                GUIDE_ACTIVE_KEY,
                len(values),
                100 * GUIDE_ACTIVE_MIN,
                f"; {self.hint}" if self.hint else "",
            )


def peak_memory() -> tuple[float, str]:
    """This process's peak memory in GiB so far, and what was measured."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, f"cuda:{torch.cuda.current_device()} allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process RSS"
