"""sage-train: one Hydra entry point for GRPO-family RLVR with SAGE's shaped anchor.

    compose config -> validate -> build the base model (cached) -> SFT (if the model asks) -> RL -> evaluate

How it departs from a standard TRL GRPO script:
- the anchor is q * pi_ref (``guide=``) under a chosen divergence (``divergence=``): SageGRPOTrainer;
- after SFT the merged SFT model is both the RL start and the reference (never the pre-SFT base);
- the guide schedule counts optimiser steps;
- ``rollout=fast`` samples the training rollouts with the evaluator's compact decoder through TRL's
  ``rollout_func`` hook (``sage.train.rollout``), instead of transformers' ``generate``;
- the end-of-run evaluation is the same code as ``sage-eval`` (unbiased pass@k on held-out problems).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import shutil
import types
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sage import distributed
from sage.cli import exit_on_config_error, run_command
from sage.config import (
    ConfigError,
    register_configs,
    validate,
)
from sage.durable import publish, write_atomically, writer_lock
from sage.hardware import sampling_dtype
from sage.metrics import metric_name
from sage.models import lora_config
from sage.paths import CONF_DIR, base_results_dir, cache_dir
from sage.run_folder import keep_earlier_final, on_main, record_identity
from sage.targets import builds, changed_only, instantiate_node
from sage.tracking import check_run_kept, check_store, point_eval_run_at, start_run
from sage.train.resume import (
    FINAL_FILE,
    ResumePlan,
    check_resume_processes,
    checkpoint_step,
    final_record,
    final_step,
    last_whole_checkpoint,
    plan_resume,
    set_aside_incomplete_checkpoints,
)

log = logging.getLogger("sage.train.main")


def build_parts(cfg: DictConfig):
    """Divergence, guide (with its schedule) — cheap objects that fail fast on bad values."""
    divergence = instantiate_node(cfg.divergence)
    guide = instantiate_node(cfg.guide)
    if cfg.guide.get("_partial_"):  # an annealed guide: the trainer supplies the schedule over max_steps
        schedule = instantiate_node(cfg.schedule)
        if cfg.schedule.get("_partial_"):
            # A base-only run (max_steps 0) trains nothing: its schedule is built over one step, only so
            # that its values are checked like any other run's.
            schedule = complete(schedule, "schedule", max_steps=max(cfg.trl.max_steps, 1))
        guide = complete(guide, "guide", schedule=schedule)
    return divergence, guide


def complete(partial, key: str, **runtime):
    """Call a ``_partial_`` target with its runtime values; a bad value is the one-line ConfigError."""
    try:
        return partial(**runtime)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from e


def library_config(node: DictConfig, **runtime):
    """A TRL/peft config object from its node: only the keys the config changes from the class's defaults,
    plus the values sage-train supplies (``runtime``)."""
    return instantiate_node(changed_only(node), **runtime)


def grpo_args(cfg: DictConfig, output_dir: Path):
    """TRL's GRPOConfig: the ``trl`` node (TRL's own keys), plus the facts that have their key elsewhere
    (``sage.trl_checks.grpo_runtime``, which the plan-time check builds it with too); without a GPU,
    ``trl.bf16`` trains under the CPU's bfloat16 autocast (``sage.trl_checks.cpu_precision``)."""
    from sage.trl_checks import cpu_precision, grpo_runtime

    runtime = grpo_runtime(cfg) | cpu_precision(cfg.trl, "trl")
    return library_config(cfg.trl, output_dir=str(output_dir), **runtime)


def rollout_function(cfg: DictConfig, args):
    """TRL's ``rollout_func`` from the ``rollout_func`` node (``rollout=fast``); None: TRL's own generation.
    Settings it cannot honour fail here, in one line, before any model is built."""
    if cfg.rollout_func is None:
        return None
    return instantiate_node(cfg.rollout_func)(args=args, lora=lora_config(cfg))


def longest_prompt(trainer, dataset) -> int:
    """Tokens of the longest RL prompt, rendered as TRL renders it (chat template for message lists)."""
    tok = trainer.processing_class
    prompts = dataset["prompt"]
    if prompts and isinstance(prompts[0], list):
        rendered = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        return max(len(ids) for ids in tok(rendered, add_special_tokens=False)["input_ids"])
    return max((len(ids) for ids in tok(list(prompts))["input_ids"]), default=0)


def rl(
    cfg: DictConfig,
    callbacks: list,
    start_path: str,
    dataset,
    divergence,
    guide,
    args,
    rollout_func,
    last: str | None,
    out: Path,
    pool,
) -> Path:
    """The RL stage, from checkpoint ``last`` if given; returns the folder of the final model (or LoRA
    adapter). ``final/`` appears by an atomic rename once complete and records the step it was saved at (a
    requeued job that finds it at ``trl.max_steps`` does not come here: ``ResumePlan.final_done``); a
    longer ``trl.max_steps`` trains on, and the earlier ``final/`` is kept as ``final-step-N/``."""
    final = out / "final"
    from sage.data.arith import FORK_MARKERS
    from sage.grading import PoolReward
    from sage.train.console import describe_batch, short_step_lines
    from sage.train.trl_import import import_grpo_trainer

    import_grpo_trainer(use_vllm=args.use_vllm)  # before sage.train.trainer: vLLM's import only if used
    from sage.train.trainer import SageGRPOTrainer

    # what an in-process vLLM engine (TRL's colocated one) changes for the whole process, to restore after it
    environment = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")}
    trainer = SageGRPOTrainer(
        model=start_path,
        reward_funcs=[PoolReward(pool)],
        args=args,
        train_dataset=dataset,
        peft_config=lora_config(cfg),
        divergence=divergence,
        guide=guide,
        filter_zero_variance_groups=cfg.filter_zero_variance_groups,
        anchor_buckets=cfg.tracking.anchor_buckets,
        fork_markers=FORK_MARKERS.values(),  # the testbed fork world's: only its models have them
        callbacks=callbacks,
        rollout_func=rollout_func,
    )
    short_step_lines(trainer)  # a short console line per step; every metric still goes to MLflow
    if distributed.is_main():
        longest = longest_prompt(trainer, dataset)
        print(describe_batch(trainer.args, trainer.accelerator.num_processes, longest))
    try:
        trainer.train(resume_from_checkpoint=last)
        saving = out / "final.partial"
        if distributed.is_main():
            shutil.rmtree(saving, ignore_errors=True)  # what a job killed while saving left behind
        distributed.barrier()
        # on every process (sharded weights are gathered); the main one writes
        trainer.save_model(str(saving))
        if distributed.is_main():
            trainer.processing_class.save_pretrained(str(saving))
            (saving / FINAL_FILE).write_text(json.dumps({"global_step": trainer.state.global_step}))
            # An earlier, shorter run's model is replaced by this one: it moves, with the sage-eval results
            # inside it, to final-step-N/, and those evaluation runs' checkpoint tags follow it there.
            retag = functools.partial(point_eval_run_at, cfg)
            keep_earlier_final(final, final_step(final), retag=retag)
            (out / "train_log.json").write_text(json.dumps(trainer.state.log_history))
            publish(saving, final)
            from sage.train.untrained import flag_untrained

            # a warm-up-only run (max_steps=1) trained nothing: recorded beside the model, for metrics.json
            if flag_untrained(cfg, start_path, final, out):
                record = {**final_record(final), "untrained": True}
                write_atomically(final / FINAL_FILE, json.dumps(record))
        distributed.barrier()
    finally:  # an engine (its processes, its memory share) goes with the stage that uses it
        release_training_engine(trainer, environment)
        held = [weakref.ref(trainer.model), weakref.ref(trainer.accelerator.unwrap_model(trainer.model))]
        if trainer.optimizer is not None:
            held.append(weakref.ref(trainer.optimizer))
        del trainer
    release_training_memory(held)
    return final


def clear_finished_frames() -> None:
    """Drop the locals of sage's finished function frames that something still holds. A library that keeps
    an exception (vLLM keeps the ModuleNotFoundError of an optional import made while it builds an engine)
    keeps its traceback's frames and, through their callers, every frame that was on the stack then:
    ``SageGRPOTrainer.__init__`` among them, whose ``self`` is the trainer, with the policy and optimiser.
    A finished frame is never run again; generator frames (suspended, not finished) are left alone."""
    import inspect

    root = str(Path(__file__).resolve().parents[1])
    suspended = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
    for obj in gc.get_objects():
        if not isinstance(obj, types.FrameType) or obj.f_code.co_flags & suspended:
            continue
        if obj.f_code.co_filename.startswith(root):
            try:
                obj.clear()
            except RuntimeError:  # still executing: on the stack now
                pass


def release_training_memory(held: list) -> None:
    """After RL the policy, its optimiser and the trainer must be unreachable before the evaluation builds
    an engine of its own on the same device: vLLM takes its share of what is free, and a 7B policy with
    its optimiser state left behind would leave too little. ``held``: weak references to them. What is
    still reachable is named in a warning (the evaluation may then be refused its memory)."""
    import torch

    clear_finished_frames()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    alive = [type(ref()).__name__ for ref in held if ref() is not None]
    if alive:
        log.warning("process %d: after RL, still reachable: %s", distributed.rank(), ", ".join(alive))
    else:
        log.info("process %d: the policy and its optimiser were released after RL", distributed.rank())


def log_anchor_buckets(tracker, out: Path) -> None:
    """The step x token-entropy-bucket figure of where the anchor acted (``sage.train.figures``), from the
    run's training log, into the run's folder and its MLflow artifacts."""
    from sage.train.figures import anchor_buckets_figure

    history = out / "train_log.json"
    if not history.is_file():
        return
    figure = anchor_buckets_figure(json.loads(history.read_text()), out / "anchor_buckets.png")
    if figure is not None:
        tracker.log_artifact(figure)


def release_training_engine(trainer, environment_before: dict[str, str | None]) -> None:
    """The training rollouts' vLLM engine is shut down once RL is done: the end-of-run evaluation starts an
    engine of its own, which must never run beside a live one on the same device. ``rollout=vllm``'s engine
    closes itself; TRL's colocated engine (``rollout=vllm_merged``) runs in this process and is stopped
    without the process group it shares with the other processes (``sage.vllm_engine.shutdown_engine``), and
    with ``environment_before``, the environment as it was before TRL built it."""
    from sage.vllm_engine import shutdown_engine

    close = getattr(trainer.rollout_func, "close", None)
    if close is not None:
        close()
        return
    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if llm is not None:
        del generation.llm
        shutdown_engine(llm, environment_before)


def training_callbacks(cfg: DictConfig, tracker, eval_rows, out: Path, pool, rollout_func) -> list:
    """MLflow logging of every step, the ``callbacks`` node's callbacks, and the periodic held-out evaluation
    if asked for (it hands its metrics to those callbacks; through the rollouts' engine if it has one)."""
    from sage.eval.sampling import SamplingSettings
    from sage.tracking import step_callback
    from sage.train.callbacks import FirstRatioCheck, GuideActivity, PeriodicEval, StepTimes

    extra = [config_callback(name, node) for name, node in cfg.callbacks.items()]
    cbs = ([step_callback(tracker)] if tracker is not None else []) + extra + [FirstRatioCheck()]
    from sage.objective.guides import NoGuide

    if not builds(cfg.guide, NoGuide):  # guide=none keeps q at 1 by design
        cbs.append(GuideActivity(*guide_knob(cfg)))
    if hasattr(rollout_func, "rollout_seconds"):  # an engine that times its rollouts: a line per step
        cbs.append(StepTimes(rollout_func))
    if cfg.eval.every_steps:
        settings = SamplingSettings(
            n_samples=cfg.eval.every_n_samples,
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.model.max_completion_length,
            chat=cfg.model.chat,
            seed=cfg.seed,
        )
        cbs.append(
            PeriodicEval(
                eval_rows,
                settings,
                cfg.eval.every_steps,
                cfg.eval.batch_size,
                tracker,
                out,
                pool,
                callbacks=extra,
                engine=rollout_func if hasattr(rollout_func, "sampler") else None,
            )
        )
    return cbs


def guide_knob(cfg: DictConfig) -> tuple[str, str]:
    """The guide's key that sets where it acts, as set (``guide.threshold=1.2``, else ``guide=<option>``),
    and what to change when it acts almost nowhere (sage.train.callbacks.GuideActivity)."""
    threshold = cfg.guide.get("threshold")
    if threshold is not None:
        return (
            f"guide.threshold={threshold}",
            f"lower guide.threshold (this model's token-entropy q90 is model.branch_threshold="
            f"{cfg.model.branch_threshold} nats)",
        )
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return f"guide={choices.get('guide') or cfg.guide._target_.rsplit('.', 1)[-1]}", ""


def config_callback(name: str, node: DictConfig):
    """One entry of the ``callbacks`` node, built; it must be a transformers TrainerCallback."""
    from transformers import TrainerCallback

    callback = instantiate_node(node)
    if not isinstance(callback, TrainerCallback):
        raise ConfigError(
            f"callbacks.{name}: {node._target_} built a {type(callback).__name__}, not a TrainerCallback"
        )
    return callback


def train(cfg: DictConfig) -> dict[str, float]:
    from sage.train.memory import check_rollout
    from sage.trl_checks import check_trl

    validate(cfg)
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    # every process refuses alike, before the process group: TRL's keys and the preset's batch
    batch_warning = check_trl(cfg, distributed.world_size(), choices.get("trl"))
    check_rollout(cfg)
    # Only the main process records (start_run below), so only it opens the store: N processes probing one
    # server (or one SQLite file) at once is load and lock contention for nothing. The launcher's rank
    # (RANK) says which process is main before the process group exists; if the store cannot be opened,
    # the main process exits and the launcher (torchrun, srun) stops the others.
    if distributed.is_main():
        check_store(cfg)
        if batch_warning:  # the run's step against its trl preset's, said once
            log.warning(batch_warning)
    divergence, guide = build_parts(cfg)
    check_resume_processes(cfg)  # every process alike, before the process group: the batch stays the run's
    distributed.init(timeout_s=cfg.trl.ddp_timeout)  # the Trainer's own timeout, for the group made here
    # Under torchrun each process has its own Hydra run dir (a timestamp): the main process's is the run's.
    out = Path(distributed.broadcast(str(cfg.output_dir or HydraConfig.get().runtime.output_dir))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with writer_lock(out):  # one writer per folder: a second run into it is refused in one line
        return train_in(cfg, out, divergence, guide)


def train_in(cfg: DictConfig, out: Path, divergence, guide) -> dict[str, float]:
    """The run in its folder ``out``, whose writer lock the caller holds: plan, build, train, evaluate,
    record."""
    from sage.grading import GradingPool
    from sage.run_names import what_trains

    if distributed.is_main():
        print(what_trains(cfg), flush=True)  # what this run is, before the minutes it takes
    plan = follow_resume_plan(cfg, out)
    inputs = build_inputs(cfg, out)
    # One MLflow run per run, however many processes train: the main process records, the others only train.
    recording = distributed.is_main()
    run = start_run(cfg, out, kind="train", resume=plan.continue_run) if recording else nullcontext(None)
    # One grading pool for the run (its workers start on first use): training rewards, the periodic and
    # the final evaluation are all graded by it, under the same time and memory limits.
    with run as tracker, GradingPool(max_answer_chars=cfg.grading.max_answer_chars) as pool:
        if tracker is not None:
            tracker.log_artifact(out / "config.yaml")
            # the reference for perplexity-under-base analyses
            tracker.set_tag("base_model", inputs.start_path)
        metrics, final, pruned_at = train_stage(cfg, plan, inputs, divergence, guide, tracker, pool, out)
        # The base model's cells are shared by every run that starts from it (same settings, same seed).
        to_evaluate = [("base", inputs.start_path, base_results_dir(inputs.start_path))]
        if final is not None:
            to_evaluate.append(("trained", str(final), out / "eval" / "trained"))
        at_end = cfg.eval.at_end and pruned_at is None
        evaluated = evaluate_models(cfg, to_evaluate, inputs.eval_rows, pool) if at_end else []
        if recording:  # the records of the evaluation are the main process's
            record_results(cfg, out, tracker, evaluated, metrics, inputs)
    return metrics


def follow_resume_plan(cfg: DictConfig, out: Path) -> ResumePlan:
    """The run's resume plan (``plan_resume``), the same on every process, carried out before any work: its
    refusal is every process's one line; a checkpoint that cannot be resumed from is set aside; the MLflow
    run it continues must not have been deleted."""
    plan = plan_resume(cfg, out, distributed.world_size())
    if plan.refusal is not None:
        raise ConfigError(plan.refusal)
    if distributed.is_main():
        set_aside_incomplete_checkpoints(out / "rl")
    distributed.barrier()
    if plan.checkpoint is not None:
        log.info("resume=%s: continuing from %s", plan.resume, plan.checkpoint)
    if plan.check_kept:
        on_main(lambda: check_run_kept(cfg, out))  # the run this one continues, before any work
    return plan


@dataclass(frozen=True)
class Inputs:
    """What the run's stages are built from (``build_inputs``)."""

    args: Any  # TRL's GRPOConfig
    rollout_func: Any  # TRL's rollout_func; None: TRL's own generation
    dataset: Any  # the RL prompts
    eval_rows: dict  # the held-out problems, by dataset; empty where nothing is evaluated
    start_path: str  # the RL start model and reference: the base model, or the SFT model made from it


def build_inputs(cfg: DictConfig, out: Path) -> Inputs:
    """Everything cheap that can fail (TRL's own checks of its args, data files, eval files) fails before the
    model is built; then the run's config is recorded in its folder and the start model built (SFT, if the
    model asks for it)."""
    from transformers import set_seed

    from sage.eval.evaluate import load_eval_rows

    args = grpo_args(cfg, out / "rl")
    rollout_func = rollout_function(cfg, args)
    dataset = instantiate_node(cfg.data, chat=cfg.model.chat)
    needs_rows = cfg.eval.at_end or cfg.eval.every_steps
    eval_rows = load_eval_rows(cfg.eval.datasets, cfg.eval.limit) if needs_rows else {}
    if distributed.is_main():
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
        record_identity(cfg, out)
    set_seed(cfg.seed)
    start_path = instantiate_node(cfg.model.source)
    if cfg.model.sft is not None:
        from sage.train.sft import run_sft

        start_path = run_sft(cfg, start_path, cache_dir() / "sft", lora_config(cfg))
    return Inputs(args, rollout_func, dataset, eval_rows, start_path)


def train_stage(
    cfg: DictConfig, plan: ResumePlan, inputs: Inputs, divergence, guide, tracker, pool, out: Path
) -> tuple[dict[str, float], Path | None, int | None]:
    """RL as the plan says: the metrics it gives, the final model's folder (None: trl.max_steps=0, which
    evaluates the (SFT) start model only, the "base" row) and the step a callback pruned the run at."""
    metrics: dict[str, float] = {}
    if cfg.trl.max_steps == 0:
        return metrics, None, None
    callbacks = training_callbacks(cfg, tracker, inputs.eval_rows, out, pool, inputs.rollout_func)
    final = out / "final"
    if plan.final_done:  # a requeued job that finds final/ complete goes on to the evaluation
        log.info("%s is complete at step %d: RL is not run again", final, plan.final_step)
    else:
        last = None if plan.checkpoint is None else str(plan.checkpoint)
        final = rl(
            cfg,
            callbacks,
            inputs.start_path,
            inputs.dataset,
            divergence,
            guide,
            inputs.args,
            inputs.rollout_func,
            last,
            out,
            pool,
        )
    pruned_at = next((c.pruned_at for c in callbacks if getattr(c, "pruned_at", None)), None)
    metrics["train/steps"] = float(pruned_at or cfg.trl.max_steps)
    if tracker is not None:
        tracker.set_tag("final_model", str(final))
        log_anchor_buckets(tracker, out)
    if pruned_at is not None:  # the sweeper records the trial as pruned; its final numbers are moot
        metrics["pruned_at_step"] = float(pruned_at)
        if tracker is not None:
            tracker.set_tag("pruned_at_step", str(pruned_at))
    return metrics, final, pruned_at


def evaluate_models(cfg: DictConfig, to_evaluate: list, eval_rows: dict, pool) -> list:
    """Each ``(label, model, results dir)`` evaluated: every process samples and grades its share of each
    evaluation cell; the main process merges them and alone writes the cells, results.json and the records.
    All models are evaluated before the main process's analyses, so that no process waits in the next
    evaluation's collectives for them."""
    from sage.eval.evaluate import evaluate_model

    max_new = cfg.eval.max_new_tokens or cfg.model.max_completion_length
    dtype = sampling_dtype(cfg.model, cfg.eval)
    settings = {"chat": cfg.model.chat, "max_new_tokens": max_new, "dtype": dtype, "pool": pool}
    return [
        (label, path, evaluate_model(path, eval_rows, cfg.eval, results_dir=rdir, **settings))
        for label, path, rdir in to_evaluate
    ]


def record_results(
    cfg: DictConfig, out: Path, tracker, evaluated: list, metrics: dict, inputs: Inputs
) -> None:
    """The main process's records: each evaluated model's summary into ``metrics``, MLflow (with what its
    samples say) and a printed table, then ``metrics.json``."""
    from sage.eval.analyses import log_analyses
    from sage.eval.evaluate import format_table

    eval_rows = inputs.eval_rows
    if evaluated:
        table = {}
        for label, path, res in evaluated:
            table[label] = {ds: r["summary"] for ds, r in res.items()}
            for ds, r in res.items():
                metrics.update({metric_name(label, ds, k): v for k, v in r["summary"].items()})
                if tracker is not None:  # at the evaluated model's step (final/ records it; base: 0)
                    step = max(final_step(Path(path)), 0)
                    ks, shown = list(cfg.eval.ks), cfg.tracking.completions_sample
                    tracker.log_eval(label, ds, r, ks, shown, step=step, rows=eval_rows[ds])
            if tracker is not None:  # what the samples say, under the start model (the reference)
                log_analyses(
                    tracker,
                    label,
                    eval_rows,
                    res,
                    chat=cfg.model.chat,
                    base=inputs.start_path,
                    cap=cfg.eval.perplexity_cap,
                    dtype=str(cfg.model.dtype),
                )
        print("\n" + format_table(table, list(cfg.eval.ks), len(cfg.eval.seeds)))
    print(f"\nrun outputs: {out}")
    if cfg.trl.max_steps > 0 and final_record(out / "final").get("untrained"):
        metrics["untrained"] = True  # final/ is the start model (sage.train.untrained)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if tracker is not None:
        tracker.log_artifact(out / "metrics.json")
        print(f"MLflow run: {tracker.run_id}")


def interruption_hint(cfg: DictConfig) -> str:
    """After an interrupted run: what its folder keeps and what a rerun does, naming the folder. resume=true
    is offered only where a checkpoint exists to continue from (else it is refused): without one, nothing
    of the training was saved and a rerun starts over."""
    out = Path(cfg.output_dir or HydraConfig.get().runtime.output_dir).resolve()
    last = last_whole_checkpoint(out / "rl")
    if last is not None:
        return (
            f"checkpoint-{checkpoint_step(last)} and finished evaluation cells are kept in {out}; rerun with "
            f"output_dir={out} resume=true to continue"
        )
    if final_step(out / "final") >= 0:
        return f"the finished model is kept in {out}/final; rerun with output_dir={out} to evaluate it"
    if cfg.trl.max_steps == 0:  # the start model's evaluation: its finished cells are in the shared cache
        return f"finished evaluation cells are kept; rerun with output_dir={out} to evaluate the rest"
    return (
        f"no checkpoint was saved in {out} (trl.save_steps={cfg.trl.save_steps}): nothing of the training "
        "is kept, and a rerun starts over"
    )


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict[str, float]:
    """Returns every metric of the run; a sweeper picks its objectives from them by name."""
    register_configs()  # a grid job (submitit) runs this function without main(); instantiation needs them
    return exit_on_config_error(train, cfg, rerun=functools.partial(interruption_hint, cfg))


def main() -> None:
    run_command(_hydra_main, register_configs)


if __name__ == "__main__":
    main()
