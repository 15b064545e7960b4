"""What a job generates and trains, as the plan (``python -m sage.train.plan``) counts it: RL's completions
(``trl.max_steps`` x prompts x generations), the evaluation's (problems x ``eval.n_samples`` x seeds over the
eval datasets, for each evaluated model), and how long its SFT stage trains, with the command that builds it
first."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from sage.train.memory import Batch


def training_completions(cfg, batch: Batch) -> tuple[int | None, str]:
    """(completions, how) RL generates: trl.max_steps x prompts per step x generations."""
    steps = cfg.trl.max_steps
    if steps < 0:
        return None, "trl.max_steps < 0 (a length in epochs): not counted"
    prompts = batch.per_step // batch.num_generations
    return steps * batch.per_step, f"{steps} steps x {prompts} prompts x {batch.num_generations} generations"


@dataclass
class Problems:
    """Problems per eval dataset of one eval config, or why they are unknown."""

    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_problems(eval_cfg, cache: dict[str, Problems]) -> Problems:
    """The eval datasets' rows as sage-train loads them (``eval.limit`` applied); a dataset that cannot be
    read here (a hub-only set offline, a missing file) leaves the count unknown, with the reason."""
    from omegaconf import OmegaConf

    from sage.config import ConfigError
    from sage.eval.evaluate import load_eval_rows

    datasets = OmegaConf.to_container(eval_cfg.datasets, resolve=True)
    key = json.dumps([datasets, eval_cfg.limit], sort_keys=True)
    if key not in cache:
        try:
            rows = load_eval_rows(eval_cfg.datasets, eval_cfg.limit)
            cache[key] = Problems({name: len(r) for name, r in rows.items()})
        except (ConfigError, OSError, ValueError) as e:
            cache[key] = Problems(error=str(e).strip().splitlines()[0])
    return cache[key]


@dataclass
class Evaluation:
    per_model: int | None  # completions of one evaluated model (problems x n_samples x seeds)
    trained: int | None  # the trained model's, 0 for a base row (trl.max_steps=0) or eval.at_end=false
    base: int | None  # the start model's (shared between jobs with the same start model and settings)
    periodic: int | None  # eval.every_steps during training
    how: str


def evaluation_completions(cfg, problems: Problems) -> Evaluation:
    e, steps = cfg.eval, cfg.trl.max_steps
    if problems.error is not None:
        return Evaluation(None, None, None, None, f"problems unknown ({problems.error})")
    n = problems.total
    per_model = n * e.n_samples * len(e.seeds)
    sets = ", ".join(f"{name} {c}" for name, c in problems.counts.items())
    how = f"{per_model:,} per model ({n} problems [{sets}] x {e.n_samples} samples x {len(e.seeds)} seeds)"
    base = per_model if e.at_end else 0
    trained = per_model if e.at_end and steps != 0 else 0
    models = [m for m, c in (("base", base), ("trained", trained)) if c]
    how += f" x {len(models)} model{'s' * (len(models) != 1)} ({', '.join(models) or 'eval.at_end=false'})"
    periodic = 0
    if e.every_steps and steps > 0:
        rounds = steps // e.every_steps
        periodic = rounds * n * e.every_n_samples
        how += f"; periodic {periodic:,} ({rounds} rounds x {n} problems x {e.every_n_samples} samples)"
    return Evaluation(per_model, trained, base, periodic, how)


# ---- the SFT stage -----------------------------------------------------------------------------------


def sft_rows(sft_cfg, chat: bool) -> tuple[int | None, str]:
    """(rows, "") of the SFT data as this machine holds it, or (None, why not). A hub dataset is read from
    the local cache only: the plan downloads nothing (an offline machine would retry for half a minute)."""
    import datasets.config

    from sage.targets import instantiate_node

    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        return len(instantiate_node(sft_cfg.data, chat=chat)), ""
    except Exception as e:  # any failure to read the rows leaves the count unknown, with its reason
        while e.__cause__ is not None:  # instantiate's wrapper says only which target failed
            e = e.__cause__
        return None, (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    finally:
        datasets.config.HF_HUB_OFFLINE = offline


def sft_steps(rows: int, epochs: float, micro: int, accumulation: int, processes: int) -> int:
    """Optimiser steps of ``epochs`` over ``rows`` as transformers' Trainer counts them: each epoch's
    micro-batches (over every process) grouped by the accumulation, at least one step per epoch."""
    per_epoch = max(math.ceil(rows / (micro * processes)) // accumulation, 1)
    return math.ceil(epochs * per_epoch)


def sft_command(cfg) -> str:
    """The sage-train command that builds this config's SFT stage (the cache entry every run of its model
    starts from) and nothing else: the model as the job composes it (its group choice and its ``model.*``
    overrides: what ``sage.train.sft.sft_key`` depends on), no RL step (``trl.max_steps=0``), no evaluation,
    and no MLflow run, since a cache entry is not a result to report."""
    from omegaconf import OmegaConf

    from sage.train.sft import BUILD_ONLY

    choice = OmegaConf.select(cfg, "hydra.runtime.choices.model")
    task = OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or []
    model = [o for o in task if o.lstrip("+~").split("=", 1)[0].startswith("model.")]
    return " ".join(["sage-train", f"model={choice}", *model, *BUILD_ONLY])


def sft_lines(cfg, processes: int) -> list[str]:
    """How long the SFT stage trains, on how many processes, and the command that builds it first."""
    from sage.train.sft import effective_batch, split_batch

    args = cfg.model.sft.args
    micro, accumulation = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    batch = effective_batch(args)
    split = split_batch(micro, accumulation, processes)  # as sage.train.sft.run_sft decides
    if processes == 1 or split is None:
        who = (
            "on one process"
            if processes == 1
            else (
                f"on one process alone (model.sft.args' batch of {batch} row(s) per optimiser step cannot be "
                f"shared by {processes} processes; the others wait)"
            )
        )
        train_micro, train_accumulation, train_processes = micro, accumulation, 1
    else:
        who = f"on the job's {processes} processes"
        (train_micro, train_accumulation), train_processes = split, processes
    epochs = float(args.num_train_epochs)
    if args.max_steps and args.max_steps > 0:
        length = f"model.sft.args.max_steps={args.max_steps} optimiser steps"
    else:
        rows, why = sft_rows(cfg.model.sft, bool(cfg.model.chat))
        if rows is None:
            length = (
                f"{epochs:g} epoch(s) at {batch} row(s) per optimiser step: {epochs / batch:g} steps per SFT "
                f"row (rows unknown here: {why})"
            )
        else:
            steps = sft_steps(rows, epochs, train_micro, train_accumulation, train_processes)
            length = (
                f"at most {steps:,} optimiser steps ({epochs:g} epoch(s) x {rows:,} rows at {batch} row(s) "
                "per step, before the rows longer than model.sft.args.max_length tokens are dropped)"
            )
    return [
        f"sft: the SFT stage trains {who}, {length}; every job that starts from it waits until it is built",
        f"sft: build it first, as a job of its own: {sft_command(cfg)}",
    ]
