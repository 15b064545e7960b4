"""sage-train: one Hydra entry point for GRPO-family RLVR with SAGE's shaped anchor.

    compose config -> validate -> build the base model (cached) -> SFT (if the model asks) -> RL -> evaluate

How it departs from a standard TRL GRPO script:
- the anchor is q * pi_ref (``guide=``) under a chosen divergence (``divergence=``): SageGRPOTrainer;
- after SFT the merged SFT model is both the RL start and the reference (never the pre-SFT base);
- the guide schedule counts optimiser steps;
- the end-of-run evaluation is the same code as ``sage-eval`` (unbiased pass@k on held-out problems).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sage.config import ConfigError, build, exit_on_config_error, register_configs, validate
from sage.paths import CONF_DIR, base_results_dir
from sage.tracking import start_run

log = logging.getLogger("sage.train.main")
register_configs()


def build_parts(cfg: DictConfig):
    """Divergence, guide (with its schedule) — cheap objects that fail fast on bad values."""
    divergence = build(cfg.divergence)
    guide = build(cfg.guide)
    if cfg.guide.get("_partial_"):  # an annealed guide: the trainer supplies the schedule over max_steps
        schedule = build(cfg.schedule)
        if cfg.schedule.get("_partial_"):
            schedule = schedule(max_steps=cfg.trainer.max_steps)
        guide = guide(schedule=schedule)
    return divergence, guide


def grpo_args(cfg: DictConfig, output_dir: Path):
    """TRL's GRPOConfig from the algorithm, divergence, rollout and trainer groups (one place, no defaults
    of our own hidden here)."""
    from trl import GRPOConfig

    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    return GRPOConfig(
        output_dir=str(output_dir),
        seed=cfg.seed,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        per_device_train_batch_size=t.prompts_per_step * t.num_generations,
        num_generations=t.num_generations,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of max_steps
        lr_scheduler_type=t.lr_scheduler_type,
        optim=t.optim,
        max_grad_norm=t.max_grad_norm,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        logging_steps=t.logging_steps,
        gradient_checkpointing=t.gradient_checkpointing,
        bf16=t.bf16,
        max_completion_length=cfg.model.max_completion_length,
        model_init_kwargs={
            "dtype": cfg.model.dtype.value if hasattr(cfg.model.dtype, "value") else cfg.model.dtype
        },
        beta=cfg.divergence.beta,
        use_bias_correction_kl=bool(cfg.divergence.get("importance_weighted", False)),
        loss_type=str(a.loss_type.value),
        scale_rewards=str(a.scale_rewards.value),
        epsilon=a.epsilon,
        epsilon_high=a.epsilon_high,
        importance_sampling_level=str(a.importance_sampling_level.value),
        mask_truncated_completions=a.mask_truncated_completions,
        num_iterations=a.num_iterations,
        steps_per_generation=a.steps_per_generation,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        use_vllm=r.use_vllm,
        vllm_mode=str(r.vllm_mode.value),
        vllm_gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=r.vllm_tensor_parallel_size,
        disable_dropout=True,
        report_to="none",
        log_completions=False,
    )


def lora_config(cfg: DictConfig):
    if cfg.model.lora is None:
        return None
    from peft import LoraConfig

    lo = cfg.model.lora
    return LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=list(lo.target_modules),
        task_type="CAUSAL_LM",
    )


def run_sft(cfg: DictConfig, base_path: str, out: Path) -> str:
    """Supervised stage; the LoRA adapter is MERGED into the weights and saved, so that the RL stage's
    reference (TRL: a new adapter disabled, or a copy of the weights) is the SFT model, not the base."""
    merged = out / "merged"
    if (merged / "config.json").exists():
        log.info("SFT already done: %s", merged)
        return str(merged)
    from trl import SFTConfig, SFTTrainer

    s = cfg.model.sft
    dataset = build(s.data, chat=cfg.model.chat)
    args = SFTConfig(
        output_dir=str(out),
        num_train_epochs=s.epochs,
        max_steps=s.max_steps,
        learning_rate=s.learning_rate,
        per_device_train_batch_size=s.batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        weight_decay=s.weight_decay,
        warmup_steps=s.warmup_steps,
        lr_scheduler_type=s.lr_scheduler_type,
        optim=s.optim,
        max_length=s.max_length,
        seed=s.seed,
        bf16=cfg.trainer.bf16,
        report_to="none",
        save_strategy="no",
        model_init_kwargs={"dtype": str(cfg.model.dtype.value)},
    )
    trainer = SFTTrainer(model=base_path, args=args, train_dataset=dataset, peft_config=lora_config(cfg))
    trainer.train()
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(merged)
    trainer.processing_class.save_pretrained(merged)
    return str(merged)


def rl(
    cfg: DictConfig,
    callbacks: list,
    start_path: str,
    dataset,
    divergence,
    guide,
    rl_dir: Path,
    last: str | None,
    out: Path,
) -> Path:
    """The RL stage; returns the folder of the final model (or LoRA adapter)."""
    from sage.grading import math_verify_reward
    from sage.train.trainer import SageGRPOTrainer

    trainer = SageGRPOTrainer(
        model=start_path,
        reward_funcs=[math_verify_reward],
        args=grpo_args(cfg, rl_dir),
        train_dataset=dataset,
        peft_config=lora_config(cfg),
        divergence=divergence,
        guide=guide,
        filter_zero_variance_groups=cfg.algorithm.filter_zero_variance_groups,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=last)
    final = out / "final"
    trainer.save_model(str(final))
    trainer.processing_class.save_pretrained(str(final))
    (out / "train_log.json").write_text(json.dumps(trainer.state.log_history))
    return final


def training_callbacks(cfg: DictConfig, tracker, eval_rows, out: Path) -> list:
    """MLflow logging of every step, the ``callbacks`` node's callbacks, and the periodic held-out evaluation
    if asked for (it hands its metrics to those callbacks)."""
    from sage.eval.evaluate import SamplingSettings
    from sage.tracking import step_callback
    from sage.train.callbacks import PeriodicEval

    extra = [config_callback(name, node) for name, node in cfg.callbacks.items()]
    cbs = ([step_callback(tracker)] if tracker is not None else []) + extra
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
                callbacks=extra,
            )
        )
    return cbs


def config_callback(name: str, node: DictConfig):
    """One entry of the ``callbacks`` node, built; it must be a transformers TrainerCallback."""
    from transformers import TrainerCallback

    callback = build(node)
    if not isinstance(callback, TrainerCallback):
        raise ConfigError(
            f"callbacks.{name}: {node._target_} built a {type(callback).__name__}, not a TrainerCallback"
        )
    return callback


def train(cfg: DictConfig) -> dict[str, float]:
    validate(cfg)
    divergence, guide = build_parts(cfg)
    out = Path(cfg.output_dir or HydraConfig.get().runtime.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from transformers.trainer_utils import get_last_checkpoint

    from sage.config import Resume, resume_mode

    rl_dir = out / "rl"
    last = get_last_checkpoint(str(rl_dir)) if rl_dir.is_dir() else None
    resume = resume_mode(cfg.resume)
    if resume == Resume.true and last is None:
        raise ConfigError(f"resume=true but {rl_dir} holds no checkpoint-*/ folder to resume from")
    if resume == Resume.false and last is not None:
        raise ConfigError(
            f"{out} already holds checkpoints; pass resume=true (or auto) to continue "
            "or choose another output_dir"
        )
    if last is not None:
        log.info("resume=%s: continuing from %s", resume, last)

    # Everything cheap that can fail (data files, eval files) fails before the model is built.
    dataset = build(cfg.data, chat=cfg.model.chat)
    from sage.eval.evaluate import evaluate_model, format_table, load_eval_rows

    needs_rows = cfg.eval.at_end or cfg.eval.every_steps
    eval_rows = load_eval_rows(cfg.eval.datasets, cfg.eval.limit) if needs_rows else {}
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)

    from transformers import set_seed

    set_seed(cfg.seed)
    base_path = build(cfg.model.source)
    start_path = run_sft(cfg, base_path, out / "sft") if cfg.model.sft is not None else base_path

    with start_run(cfg, out, kind="train") as tracker:
        if tracker is not None:
            tracker.log_artifact(out / "config.yaml")
            tracker.set_tag("base_model", start_path)  # the reference for perplexity-under-base analyses
        metrics: dict[str, float] = {}
        # The base model's cells are shared by every run that starts from it (same settings, same seed).
        to_evaluate = [("base", start_path, base_results_dir(start_path))]
        pruned_at = None
        if cfg.trainer.max_steps > 0:  # max_steps=0 evaluates the (SFT) start model only: the "base" row
            callbacks = training_callbacks(cfg, tracker, eval_rows, out)
            final = rl(
                cfg,
                callbacks,
                start_path,
                dataset,
                divergence,
                guide,
                rl_dir,
                last,
                out,
            )
            pruned_at = next((c.pruned_at for c in callbacks if getattr(c, "pruned_at", None)), None)
            metrics["train/steps"] = float(pruned_at or cfg.trainer.max_steps)
            to_evaluate.append(("trained", str(final), out / "eval" / "trained"))
            if tracker is not None:
                tracker.set_tag("final_model", str(final))
        if pruned_at is not None:  # the sweeper records the trial as pruned; its final numbers are moot
            metrics["pruned_at_step"] = float(pruned_at)
            if tracker is not None:
                tracker.set_tag("pruned_at_step", str(pruned_at))

        if cfg.eval.at_end and pruned_at is None:
            max_new = cfg.eval.max_new_tokens or cfg.model.max_completion_length
            table = {}
            for label, path, rdir in to_evaluate:
                res = evaluate_model(
                    path,
                    eval_rows,
                    cfg.eval,
                    chat=cfg.model.chat,
                    max_new_tokens=max_new,
                    results_dir=rdir,
                    dtype=str(cfg.model.dtype.value),
                    rollout=cfg.rollout,
                )
                table[label] = {ds: r["summary"] for ds, r in res.items()}
                for ds, r in res.items():
                    metrics.update({f"{label}/{ds}/{k}": v for k, v in r["summary"].items()})
                    if tracker is not None:
                        tracker.log_eval(label, ds, r, list(cfg.eval.ks), cfg.tracking.completions_sample)
            print("\n" + format_table(table, list(cfg.eval.ks)))
        print(f"\nrun outputs: {out}")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if tracker is not None:
            tracker.log_artifact(out / "metrics.json")
            print(f"MLflow run: {tracker.run_id}")
    return metrics


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict[str, float]:
    """Returns every metric of the run; a sweeper picks its objectives from them by name."""
    return exit_on_config_error(train, cfg)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _hydra_main()


if __name__ == "__main__":
    main()
