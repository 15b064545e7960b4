"""The plan of a run or a grid before it is submitted: its jobs, each one's GPU memory, and the completions
each will generate for training and for evaluation.

    python -m sage.train.plan model=qwen2.5-math-7b trl=paper rollout=vllm [gpu_gib=80] [prompt_tokens=1024]
        [processes=8]   # a torchrun launch: --nproc_per_node x --nnodes
    python -m sage.train.plan -m hparams_search=table1 seed=1,2,3 model=... hydra/launcher=slurm \
        hydra.launcher.tasks_per_node=8 ...   # the sage-train grid command, as is

takes sage-train's overrides (and ``gpu_gib``, ``prompt_tokens``, ``processes``, which are its own) and
expands a grid as Hydra's basic sweeper does: ``hydra.sweeper.params`` (what ``hparams_search=tableN`` sets)
plus the command line's sweep overrides (``seed=1,2,3``), the command line winning on a key both name. For
each job it prints the batch shape (the line sage-train prints at start; TRL does not truncate prompts, so
the longest prompt is a stated assumption, ``prompt_tokens``), the memory estimate term by term
(``sage.train.memory``), what vLLM's share holds, and the completions (``sage.train.completions``): training
``trl.max_steps`` x prompts x generations, evaluation problems x ``eval.n_samples`` x seeds over the eval
datasets for each evaluated model (the start model's cells are shared by every job that starts from the same
model with the same evaluation settings: counted once in the grid's total). A job with an SFT stage gets how
long it trains, on how many processes (Table 7's batch of one row is trained by one process while the job's
others, and every job that starts from it, wait), and the grid the command that builds it first as a job of
its own. An RL step over several processes that does not take the completions its trl preset states is said
in one line, with the key that keeps them (and refused where the preset fixes its batch, ``trl=paper``). It
exits 1 if a job does not fit, 2 on a bad argument or on a job sage-train would refuse at composition
whatever the memory, in one line: ``sage.config.validate`` and ``sage.trl_checks.check_trl`` without what
depends on the planning machine (TRL's keys, the preset's batch), and ``check_rollout`` (``rollout=vllm``
with LoRA on the output layer or the embeddings, or full fine-tuning of a model whose output layer is tied to
its embeddings).

Processes per job: ``hydra.launcher.tasks_per_node`` x ``hydra.launcher.nodes`` under the submitit
launchers, else ``processes=`` (default 1). The evaluation phase follows the training estimate
(``sage.train.evaluation_memory``): what stays on each GPU once training has released the policy, its
optimiser and its engine (CUDA contexts, NCCL's buffers), beside the end-of-run evaluation engine's share
(``eval.vllm_gpu_memory_utilization``), and what that share holds; a job whose evaluation engine cannot
start does not fit (exit 1), in one line naming the share that would start it. The cluster warnings
(``sage.train.cluster_warnings``) close the plan.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sage.train.architecture import Architecture
from sage.train.cluster_warnings import cluster_warnings
from sage.train.completions import (
    Evaluation,
    count_problems,
    evaluation_completions,
    sft_lines,
    training_completions,
)
from sage.train.memory import (
    Batch,
    architecture,
    batch_of,
    check_rollout,
    colocated_fraction,
    describe_estimate,
    describe_vllm,
    engine_room_dtype,
    largest_vllm_fraction,
    plan,
    vllm_room,
)

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def preset_batch(preset: str) -> tuple[int, int]:
    """(completions per forward pass, accumulation steps) that ``conf/trl/<preset>.yaml`` states
    (``sage.trl_checks.preset_batch``)."""
    from sage.trl_checks import preset_batch as stated

    return stated(preset)


def global_batch_warning(batch: Batch, preset: str, stated: tuple[int, int]) -> str | None:
    """One line when an RL optimiser step over more than one process does not take the completions the
    ``trl=<preset>`` preset states for one process (``stated``: its micro-batch and accumulation), with the
    setting that keeps them; None when it does, or on one process.

    RL does not split the step over the processes as the SFT stage does (``sage.train.sft.split_batch``):
    TRL's per-process knobs are the run's record. Where the preset fixes its batch (``trl=paper``) a run that
    changes it is refused before this is asked (``sage.trl_checks.check_batch``); elsewhere, or with
    ``allow_batch_change=true``, the run goes on and says what it does."""
    from sage.trl_checks import batch_said

    if batch.processes == 1:  # one process takes the step its config states: the command asks for it
        return None
    said = batch_said(preset, stated, batch.micro, batch.accumulation, batch.processes)
    return None if said is None else f"warning: {said}"


def run_batch_warning(cfg, processes: int, preset: str | None) -> str | None:
    """:func:`global_batch_warning` for a composed sage-train config on ``processes`` processes, which
    ``sage.trl_checks.check_batch`` refuses instead where its preset fixes its batch; ``preset`` is Hydra's
    choice of the trl group (None: the config was composed without Hydra's record of its choices, so there is
    no preset to compare with)."""
    from sage.trl_checks import check_batch

    return check_batch(cfg, processes, preset)


def split_arguments(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(this module's own ``key=value`` arguments, sage-train's overrides); ``-m`` / ``--multirun`` are
    accepted so that a sage-train grid command can be pasted as is."""
    own, rest = {}, []
    for a in args:
        key = a.split("=", 1)[0]
        if key in ("gpu_gib", "prompt_tokens", "processes", "step_s"):
            own[key] = a.split("=", 1)[1]
        elif a in ("-m", "--multirun"):
            own["multirun"] = "1"
        else:
            rest.append(a)
    return own, rest


def expand_grid(compose, overrides: list[str]) -> tuple[list[list[str]], list[str], object]:
    """(each job's task overrides, the Hydra overrides, the sweep's config) as Hydra's basic sweeper makes
    them: ``hydra.sweeper.params`` first, then the command line's task overrides (which win on a key)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    hydra_args = [o.input_line for o in parsed if o.is_hydra_override()]
    task = [o for o in parsed if not o.is_hydra_override()]
    # the sweep's own config, as Hydra composes it in multirun: without the sweep overrides
    sweep_cfg = compose(hydra_args + [o.input_line for o in task if not o.is_sweep_override()])
    sweeper = sweep_cfg.hydra.sweeper
    if sweeper._target_ != BASIC_SWEEPER:
        raise ValueError(
            f"hydra.sweeper: {sweeper._target_} chooses its trials as it runs; the plan expands grids of "
            "Hydra's basic sweeper (plan one trial by fixing its parameters on the command line)"
        )
    params = [f"{k}={v}" for k, v in (sweeper.params or {}).items()]
    every = parser.parse_overrides(params) + task
    jobs = BasicSweeper.split_arguments(every, None)[0]
    return jobs, hydra_args, sweep_cfg


def processes_per_job(launcher, given: int | None) -> int:
    """tasks_per_node x nodes of a submitit launcher, else ``processes=`` (a torchrun launch), else 1."""
    if "tasks_per_node" in launcher:
        n = int(launcher.tasks_per_node) * int(launcher.nodes)
        if given is not None and given != n:
            raise ValueError(
                f"processes={given}: the launcher runs hydra.launcher.tasks_per_node x nodes = {n} "
                "processes per job"
            )
        return n
    return 1 if given is None else given


@dataclass
class JobPlan:
    label: str
    lines: list[str]
    fits: bool
    total_gib: float | None
    training: int | None
    evaluation: Evaluation
    base_key: str
    sft_build: list[str]  # the line with the command that builds the job's SFT stage first; [] without one
    steps: int = 0  # trl.max_steps: the RL optimiser steps the job trains
    number: int = 0  # the job's number in the grid
    shown: list[str] = field(default_factory=list)  # its overrides of the keys that vary over the grid


def evaluation_phase(
    cfg, arch: Architecture, gpu_gib: float, prompt_tokens: int, processes: int
) -> tuple[list[str], bool]:
    """The plan's evaluation lines (``sage.train.evaluation_memory``) and whether its engine starts."""
    from sage.train.evaluation_memory import (
        describe_evaluation,
        engine_starts,
        eval_engine,
        evaluation_estimate,
    )

    engine, why_none = eval_engine(cfg, prompt_tokens)
    if engine is None:
        return [f"memory at evaluation: {why_none}"], True
    parts = evaluation_estimate(arch, engine, processes=processes, gpu_gib=gpu_gib)
    return describe_evaluation(parts, engine), engine_starts(parts)


def plan_job(cfg, label: str, gpu_gib: float, prompt_tokens: int, processes: int, problems) -> JobPlan:
    from omegaconf import OmegaConf

    batch = batch_of(cfg, prompt_tokens, processes)
    lines, fits, total = [], True, None
    if "repo_id" in cfg.model.source:
        _, parts, origin = plan(cfg, gpu_gib, prompt_tokens, processes)
        arch, _ = architecture(cfg.model.source)
        lines += [f"architecture: {origin}", batch.describe(), describe_estimate(parts)]
        fits, total = parts["total"] <= parts["gpu"], parts["total"]
        fraction = colocated_fraction(cfg)
        if fraction:
            served = engine_room_dtype(cfg)
            room = vllm_room(arch, batch, parts["vllm"], served)
            lines.append(describe_vllm(room, fraction))
            fits = fits and room["kv"] > 0
            best = largest_vllm_fraction(parts)
            smaller = vllm_room(arch, batch, best * gpu_gib, served)
            if not fits and smaller["kv"] > 0:
                lines.append(
                    f"fix: trl.vllm_gpu_memory_utilization={best:.2f} is the largest share that fits beside "
                    f"the rest; vLLM then holds {smaller['sequences']} sequences of the longest length at "
                    "once"
                )
        lines_eval, starts = evaluation_phase(cfg, arch, gpu_gib, prompt_tokens, processes)
        lines += lines_eval
        fits = fits and starts
    else:
        lines += [
            f"memory: not estimated (model.source is {cfg.model.source._target_}, not a hub or local model "
            "with a config.json)",
            batch.describe(),
        ]
    warning = run_batch_warning(cfg, processes, OmegaConf.select(cfg, "hydra.runtime.choices.trl"))
    lines += [warning] if warning else []
    training, how = training_completions(cfg, batch)
    evaluation = evaluation_completions(cfg, problems)
    shown = "unknown" if training is None else f"{training:,}"
    lines.append(f"completions: training {shown} ({how}); evaluation {evaluation.how}")
    sft = sft_lines(cfg, processes) if cfg.model.sft is not None else []
    lines += sft[:1]
    base_key = json.dumps(
        [OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.eval, resolve=True)],
        sort_keys=True,
        default=str,
    )
    return JobPlan(label, lines, fits, total, training, evaluation, base_key, sft[1:])


def same_plans(plans: list[JobPlan]) -> list[tuple[str, list[str]]]:
    """The jobs grouped by identical plan lines (a grid's seeds plan alike), in the order of their first job:
    (the group's heading, the lines). A group of more than ``LISTED`` jobs is named by its job numbers and the
    values it takes of each varying key, not job by job."""
    groups: dict[tuple[str, ...], list[JobPlan]] = {}
    for p in plans:
        groups.setdefault(tuple(p.lines), []).append(p)
    out = []
    for lines, group in groups.items():
        if len(group) == 1:
            head = group[0].label
        elif len(group) <= LISTED:
            head = f"{len(group)} jobs with the same plan ({'; '.join(p.label for p in group)})"
        else:
            values: dict[str, list[str]] = {}
            for p in group:
                for o in p.shown:
                    key, _, value = o.partition("=")
                    values.setdefault(key, [])
                    if value not in values[key]:
                        values[key].append(value)
            which = " x ".join(f"{k}={','.join(v)}" for k, v in values.items())
            numbers = job_ranges([p.number for p in group])
            head = f"{len(group)} jobs with the same plan (jobs {numbers}: {which})"
        out.append((head, list(lines)))
    return out


LISTED = 4  # a group of up to this many jobs with one plan lists them one by one


def job_ranges(numbers: list[int]) -> str:
    """``0-2, 5, 7-9``: sorted job numbers with their runs joined."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def gpu_hours_line(plans: list[JobPlan], processes: int, step_s: float | None) -> str:
    """The GPU-hours of the grid's RL training, one GPU per process, at ``step_s`` seconds per optimiser step
    (``make first-hour`` measures a step on one node); without it, how to get the figure."""
    steps = sum(p.steps for p in plans)
    if step_s is None:
        return (
            f"gpu-hours: {steps:,} optimiser steps on {processes} GPU(s) each; give "
            "step_s=<seconds per step> (make first-hour measures it) for the total"
        )
    hours = steps * step_s * processes / 3600
    return (
        f"gpu-hours: {hours:,.1f} for RL training ({steps:,} optimiser steps x {step_s:g} s x {processes} "
        "GPU(s); the SFT jobs and the evaluations not included)"
    )


def stage_plan_lines(plans: list[JobPlan], stages) -> list[str]:
    """What the launcher submits first for the grid's SFT stages (``sage.train.sft.sft_stages``): one SFT job
    per stage the cache lacks, and the jobs that depend on it; a stage in the cache needs no job."""
    lines = []
    for stage in stages:
        held = job_ranges(stage.dependents)
        every = f" (all {len(plans)})" if len(stage.dependents) == len(plans) > 1 else ""
        lines.append(
            f"sft: the launcher submits 1 SFT job first for {stage.model} ({stage.processes} process(es)); "
            f"job(s) {held}{every} depend on it (SLURM afterok; locally they start after it) and do not run "
            "if it fails"
        )
    if any(p.sft_build for p in plans) and not stages:
        lines.append("sft: every SFT stage the jobs need is in the cache: no SFT job")
    return lines


def grid_summary(jobs: list[JobPlan], processes: int, gpu_gib: float) -> list[str]:
    estimated = [j for j in jobs if j.total_gib is not None]
    lines = [f"grid: {len(jobs)} jobs x {processes} processes (one GPU each)"]
    if estimated:
        worst = max(estimated, key=lambda j: j.total_gib)
        failing = [j.label for j in jobs if not j.fits]
        verdict = f"every job fits {gpu_gib:.0f} GiB"
        if failing:
            verdict = f"{len(failing)} DO NOT FIT: {'; '.join(failing)}"
        lines.append(f"memory: largest estimate {worst.total_gib:.1f} GiB per GPU ({worst.label}); {verdict}")
    training = [j.training for j in jobs]
    shown = "unknown" if None in training else f"{sum(training):,}"
    lines.append(f"completions: training {shown}")
    evals = [j.evaluation for j in jobs]
    if any(e.per_model is None for e in evals):
        lines.append("completions: evaluation unknown (a job's problems could not be counted)")
    else:
        bases = {j.base_key: j.evaluation.base for j in jobs}
        trained = sum(e.trained for e in evals)
        periodic = sum(e.periodic for e in evals)
        start = sum(bases.values())
        lines.append(
            f"completions: evaluation {start + trained + periodic:,} (trained models {trained:,}, start "
            f"models {start:,}: {len(bases)} distinct start model and evaluation settings, each evaluated "
            f"once; periodic {periodic:,})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from sage.config import ConfigError, register_configs, validate
    from sage.paths import CONF_DIR
    from sage.trl_checks import check_trl

    own, overrides = split_arguments(list(sys.argv[1:] if argv is None else argv))
    try:
        gpu_gib = float(own.get("gpu_gib", 80))
        prompt_tokens = int(own.get("prompt_tokens", 1024))
        given = int(own["processes"]) if "processes" in own else None
        step_s = float(own["step_s"]) if "step_s" in own else None
    except ValueError as e:
        print(f"error: gpu_gib, prompt_tokens, processes and step_s take numbers ({e})", file=sys.stderr)
        return 2
    if step_s is not None and not (math.isfinite(step_s) and step_s > 0):
        print(f"error: step_s={own['step_s']}: seconds per optimiser step, a number > 0", file=sys.stderr)
        return 2
    register_configs()
    mounts = Path("/proc/mounts").read_text() if Path("/proc/mounts").is_file() else ""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):

        def compose_train(args: list[str]):
            return compose(config_name="train", overrides=args, return_hydra_config=True)

        try:
            jobs, hydra_args, sweep_cfg = expand_grid(compose_train, overrides)
            processes = processes_per_job(sweep_cfg.hydra.launcher, given)
            varying = sorted(
                {o.split("=", 1)[0] for job in jobs for o in job if any(o not in other for other in jobs)}
            )
            problems: dict = {}
            plans = []
            composed: dict[tuple[str, ...], object] = {}
            for number, job in enumerate(jobs):
                cfg = composed[tuple(job)] = compose_train(hydra_args + job)
                shown = " ".join(o for o in job if o.split("=", 1)[0] in varying)
                label = f"job {number}" + (f" [{shown}]" if shown else "")
                try:  # what sage-train refuses at composition, before any model is built
                    validate(cfg, here=False)  # what depends on this machine is sage-train's to check
                    check_trl(cfg, processes, OmegaConf.select(cfg, "hydra.runtime.choices.trl"), here=False)
                    check_rollout(cfg)
                except ConfigError as e:
                    raise ConfigError(f"{label}: {e}" if len(jobs) > 1 else str(e)) from e
                problems_of = count_problems(cfg.eval, problems)
                plans.append(plan_job(cfg, label, gpu_gib, prompt_tokens, processes, problems_of))
                plans[-1].steps, plans[-1].number, plans[-1].shown = (
                    int(cfg.trl.max_steps),
                    number,
                    shown.split(),
                )
            from sage.train.sft import sft_stages

            stages = sft_stages(lambda job: composed[tuple(job)], jobs, processes)  # each job composed once
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if len(plans) == 1:
        print("\n".join(plans[0].lines))
    else:
        for head, lines in same_plans(plans):
            print(head + ":\n" + "\n".join(f"  {line}" for line in lines))
        print("\n".join(grid_summary(plans, processes, gpu_gib)))
    print(gpu_hours_line(plans, processes, step_s))
    if "multirun" in own:  # a grid: its launcher runs each SFT stage the cache lacks as a job of its own
        print("\n".join(stage_plan_lines(plans, stages)))
    else:  # one run builds its SFT stage itself, or from the command printed here, first
        print("\n".join(line for p in plans for line in p.sft_build))
    for line in cluster_warnings(sweep_cfg, sweep_cfg.hydra.launcher, len(plans), mounts):
        print(line)
    return 0 if all(p.fits for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
