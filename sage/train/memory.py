"""A run or a grid before it is submitted: its jobs, each one's GPU memory, and the completions each will
generate for training and for evaluation.

    python -m sage.train.memory model=qwen2.5-math-7b trl=paper rollout=vllm [gpu_gib=80] [prompt_tokens=1024]
        [processes=8]   # a torchrun launch: --nproc_per_node x --nnodes
    python -m sage.train.memory -m hparams_search=table1 seed=1,2,3 model=... hydra/launcher=slurm \
        hydra.launcher.tasks_per_node=8 ...   # the sage-train grid command, as is

takes sage-train's overrides (and ``gpu_gib``, ``prompt_tokens``, ``processes``, which are its own) and
expands a grid as Hydra's basic sweeper does: ``hydra.sweeper.params`` (what ``hparams_search=tableN`` sets)
plus the command line's sweep overrides (``seed=1,2,3``), the command line winning on a key both name. For
each job it prints the batch shape (the line sage-train prints at start; TRL does not truncate prompts, so
the longest prompt is a stated assumption, ``prompt_tokens``), the memory estimate term by term, what vLLM's
share holds, and the completions: training ``trl.max_steps`` x prompts x generations, evaluation problems x
``eval.n_samples`` x seeds over the eval datasets for each evaluated model (the start model's cells are shared
by every job that starts from the same model with the same evaluation settings: counted once in the grid's
total). A job with an SFT stage gets how long it trains, on how many processes (Table 7's batch of one row
is trained by one process while the job's others, and every job that starts from it, wait), and the grid
the command that builds it first as a job of its own. An RL step over several processes that does not take
the completions its trl preset states is said in one line, with the key that keeps them (and refused where
the preset fixes its batch, ``trl=paper``). It exits 1 if a job does not fit, 2 on a bad argument or on a job
sage-train would refuse at composition whatever the memory, in one line: ``sage.config.validate`` and
``sage.trl_checks.check_trl`` without what depends on the planning machine (TRL's keys, the preset's batch),
and ``check_rollout`` (``rollout=vllm`` with LoRA on the output layer or the embeddings, or full
fine-tuning of a model whose output layer is tied to its embeddings).

Processes per job: ``hydra.launcher.tasks_per_node`` x ``hydra.launcher.nodes`` under the submitit
launchers, else ``processes=`` (default 1). The architecture is the model's ``config.json``: read from
``model.source`` when that is a local folder, else from ``architectures.json`` beside this file, a copy of
the published config.json values of the paper's models (the line printed says which); a testbed model is
not estimated.

The estimate is an upper-bound style sum, not a measurement (no GPU is lent to this project): what is
resident (weights, trainable state, the reference, DDP's gradient buckets, vLLM's share under colocation)
plus the working set of one micro-batch (checkpointed layer inputs, one layer's activations when it is
recomputed, the logits of the completion tokens with their gradient). Each term is named so a user can
check it against ``torch.cuda.max_memory_allocated`` on a real run. The evaluation phase follows
(``sage.train.evaluation_memory``): what stays on each GPU once training has released the policy, its
optimiser and its engine (CUDA contexts, NCCL's buffers), beside the end-of-run evaluation engine's share
(``eval.vllm_gpu_memory_utilization``), and what that share holds; a job whose evaluation engine cannot
start does not fit (exit 1), in one line naming the share that would start it.

Warnings (the job still runs, but a cluster makes it fail or corrupt records):
- a SQLite MLflow store written from several nodes (a grid of more than one SLURM job, or a job over
  ``hydra.launcher.nodes`` > 1): SQLite's file locks are not reliable on network filesystems; use a server.
- under ``hydra/launcher=slurm``, a folder every job must see (the cache, ``sage.paths.cache_dir()``; the
  SQLite store; the sweep dir) that is not on a network filesystem. The rule is the filesystem type of the
  folder's mount in this machine's ``/proc/mounts`` (nfs, lustre, gpfs, beegfs, ceph, ...: shared; a local
  disk or tmpfs, such as /tmp, or a $HOME on a local disk: not shared), since a path alone cannot say.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from sage.train.architecture import DTYPE_BYTES, GIB, Architecture

ARCH_FILE = Path(__file__).with_name("architectures.json")
# bytes of optimiser state per trainable parameter (two moments)
OPTIMISER_BYTES = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "adamw_bnb_8bit": 2}
DEFAULT_OPTIMISER_BYTES = 8
# Filesystem types (/proc/mounts) every node of a cluster sees the same way; anything else is node-local.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "fhgfs",
        "ceph",
        "cephfs",
        "fuse.ceph",
        "fuse.cephfs",
        "cifs",
        "smb3",
        "smbfs",
        "glusterfs",
        "fuse.glusterfs",
        "panfs",
        "wekafs",
        "afs",
        "pvfs2",
        "orangefs",
        "fuse.juicefs",
        "fuse.gcsfuse",
        "fuse.s3fs",
    }
)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


@dataclass(frozen=True)
class Batch:
    """TRL's batch knobs, as GRPOConfig resolves them (steps_per_generation defaults to the accumulation)."""

    micro: int  # per_device_train_batch_size: completions per forward pass
    accumulation: int
    processes: int
    num_generations: int
    prompt_tokens: int
    completion_tokens: int
    steps_per_generation: int = 0  # 0: the accumulation (TRL's default)

    @property
    def per_step(self) -> int:
        return self.micro * self.accumulation * self.processes

    @property
    def generated_at_once(self) -> int:
        """Completions one process generates per generation round (TRL sizes vLLM's max_num_seqs so)."""
        return self.micro * (self.steps_per_generation or self.accumulation)

    def describe(self) -> str:
        longest = self.prompt_tokens + self.completion_tokens
        return (
            f"batch: {self.micro} completions per forward pass x {self.accumulation} accumulation steps x "
            f"{self.processes} processes = {self.per_step} completions "
            f"({self.per_step // self.num_generations} prompts x {self.num_generations} generations) per "
            f"optimiser step; longest micro-batch "
            f"{self.micro} x ({self.prompt_tokens} prompt + {self.completion_tokens} completion) = "
            f"{self.micro * longest} tokens"
        )


def estimate(
    arch: Architecture,
    batch: Batch,
    *,
    lora: tuple[int, list[str]] | None,
    beta: float,
    optim: str,
    gradient_checkpointing: bool,
    vllm_fraction: float,
    gpu_gib: float,
    dtype: str,
) -> dict[str, float]:
    """Peak memory of one process in GiB, term by term; ``total`` is their sum.

    ``dtype`` is the one TRL loads the policy in (``trl.model_init_kwargs.dtype``: ``model.dtype`` under LoRA,
    float32 master weights for full fine-tuning of a half-precision model, see ``sage.models.policy_dtype``).
    Weights: the policy at ``dtype``. Trainable state: under LoRA a float32 adapter (peft keeps it so), its
    float32 gradient and the optimiser's moments; for full fine-tuning a gradient at ``dtype`` and the
    moments.
    Reference: none under LoRA or with beta 0 (TRL then builds none: the adapter disabled is the reference);
    for full fine-tuning TRL builds it with the same ``model_init_kwargs``, so at ``dtype``. DDP's gradient
    buckets (more than one process): one more copy of the trainable gradients (transformers' DDP keeps
    ``gradient_as_bucket_view`` off). Activations (bf16): each layer's input when checkpointed, or every
    layer's working set otherwise, plus one layer's working set (q, k, v, attention output, the MLP's three
    wide tensors, and as much again for their gradients). Logits: bf16 logits of the completion tokens and
    their gradient, and one row's float32 log-softmax (TRL computes log-probs row by row)."""
    params = arch.parameters()
    b, s, c = batch.micro, batch.prompt_tokens + batch.completion_tokens, batch.completion_tokens
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    opt = OPTIMISER_BYTES.get(optim, DEFAULT_OPTIMISER_BYTES)
    w = DTYPE_BYTES[dtype]
    if lora is not None:
        trainable, grad_bytes = arch.lora_parameters(*lora), 4
        state, reference = trainable * (4 + grad_bytes + opt), 0
    else:
        trainable, grad_bytes = params, w
        state, reference = params * (grad_bytes + opt), (w * params if beta else 0)
    buckets = trainable * grad_bytes if batch.processes > 1 else 0
    layer = b * s * (4 * h + 2 * arch.kv_size + 3 * i) * 2 * 2
    layers = arch.num_hidden_layers
    kept = b * s * h * 2 * layers if gradient_checkpointing else layer * layers
    logits = b * c * v * 2 * 2 + c * v * 4
    parts = {
        "weights": w * params / GIB,
        "trainable_state": state / GIB,
        "reference": reference / GIB,
        "ddp_buckets": buckets / GIB,
        "activations": (kept + layer) / GIB,
        "logits": logits / GIB,
        "vllm": vllm_fraction * gpu_gib,
    }
    parts["total"] = sum(parts.values())
    parts["gpu"] = gpu_gib
    return parts


def describe_estimate(parts: dict[str, float]) -> str:
    terms = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if k not in ("total", "gpu"))
    verdict = "fits" if parts["total"] <= parts["gpu"] else "DOES NOT FIT"
    # "in training": the plan's evaluation phase (sage.train.evaluation_memory) has a line of its own
    return (
        f"memory estimate per GPU: {parts['total']:.1f} GiB of {parts['gpu']:.1f} GiB in training, {verdict} "
        f"({terms})"
    )


def vllm_room(arch: Architecture, batch: Batch, share_gib: float, dtype: str) -> dict[str, float]:
    """What a colocated vLLM engine's share holds: its weights at ``dtype`` (vLLM's "auto": the checkpoint's
    dtype) and, in the rest, KV cache for ``sequences`` of the longest length at once. vLLM's own working
    memory (its profiling run's activations, CUDA graphs) also comes out of the share and is not counted."""
    weights = arch.parameters() * DTYPE_BYTES[dtype] / GIB
    kv = max(share_gib - weights, 0.0)
    tokens = int(kv * GIB // arch.kv_bytes_per_token(DTYPE_BYTES[dtype]))
    return {
        "share": share_gib,
        "weights": weights,
        "kv": kv,
        "tokens": tokens,
        "sequences": tokens // (batch.prompt_tokens + batch.completion_tokens),
        "generated_at_once": batch.generated_at_once,
    }


def describe_vllm(room: dict[str, float], fraction: float) -> str:
    if room["kv"] <= 0:
        return (
            f"vllm: trl.vllm_gpu_memory_utilization={fraction} gives {room['share']:.1f} GiB, which cannot "
            f"hold its {room['weights']:.1f} GiB of weights: DOES NOT FIT"
        )
    return (
        f"vllm: trl.vllm_gpu_memory_utilization={fraction} gives {room['share']:.1f} GiB = weights "
        f"{room['weights']:.1f} + KV cache {room['kv']:.1f} ({room['tokens']:,} tokens: {room['sequences']} "
        f"sequences of the longest length at once, for the {room['generated_at_once']} each process "
        "generates per round; fewer at once is slower, not an error)"
    )


def largest_vllm_fraction(parts: dict[str, float]) -> float:
    """The largest vLLM share (a multiple of 0.05 of the GPU) that fits beside everything else; 0 if none."""
    room = parts["gpu"] - (parts["total"] - parts["vllm"])
    return max(int(room / parts["gpu"] * 20) / 20, 0.0)


def architecture(source: dict) -> tuple[Architecture, str]:
    """The model's architecture and where it was read from."""
    repo = str(source.get("repo_id", ""))
    local = Path(repo) / "config.json"
    if repo and local.is_file():
        return Architecture.from_config(json.loads(local.read_text())), str(local)
    stored = json.loads(ARCH_FILE.read_text())
    if repo not in stored["models"]:
        raise ValueError(
            f"model.source.repo_id={repo!r}: no local config.json and no stored architecture "
            f"(stored: {sorted(stored['models'])})"
        )
    return Architecture.from_config(stored["models"][repo]), f"stored copy of {repo}'s config.json"


TESTBED_SOURCE = "sage.testbed.model.build_tiny_model"  # every testbed model ties (its make_model)


def check_rollout(cfg) -> None:
    """``rollout=vllm``'s refusals that the composed config already shows, in the one line its rollout
    function would raise later (``sage.train.vllm_rollout.refusal``, their one source): an adapter vLLM
    cannot serve (LoRA on the output layer or the embeddings, DoRA, ``modules_to_save``, a bias, a rank above
    vLLM's), a TRL setting it does not do, and full fine-tuning of a model whose output layer is tied to its
    embeddings (``sage.train.memory.tied_embeddings``: the stored or local config.json, the testbed's models).
    sage-train (after ``sage.config.validate``) and ``python -m sage.train.memory`` call it; imports no vLLM
    (here, not in sage.config, which the modules it reads import)."""
    from omegaconf import OmegaConf

    from sage.config import ConfigError

    if OmegaConf.select(cfg, "rollout_func._target_") != "sage.train.vllm_rollout.VllmRollout":
        return
    from sage.train.vllm_rollout import refusal

    refused = refusal(cfg.model.lora, cfg.trl, tied=tied_embeddings(cfg.model.source))
    if refused:
        raise ConfigError(refused)


def tied_embeddings(source) -> bool | None:
    """Whether the model ``model.source`` names ties its output layer to its embeddings
    (``tie_word_embeddings``), as far as the config tells before the model is built: a hub or local model by
    its ``config.json`` (the paper's models by the stored copy, as :func:`architecture` reads them), a GGUF
    package by its converted folder's, a testbed model always (``sage.testbed.model.make_model``); None
    where it cannot tell (a hub model neither local nor stored, a GGUF file not converted yet, a config.json
    that does not say), which ``VllmRollout.attach`` then checks on the built model."""
    target = str(source.get("_target_", ""))
    if target == TESTBED_SOURCE:
        return True
    repo = source.get("repo_id")
    if repo:
        local = Path(str(repo)) / "config.json"
        if local.is_file():
            return json.loads(local.read_text()).get("tie_word_embeddings")
        stored = json.loads(ARCH_FILE.read_text())["models"].get(str(repo))
        return None if stored is None else stored["tie_word_embeddings"]
    if target == "sage.models.from_package_gguf" and source.get("sha256"):
        from sage.models import GGUF_MARKER, gguf_folder

        folder = gguf_folder(str(source.get("sha256")))
        if (folder / GGUF_MARKER).is_file():
            return json.loads((folder / "config.json").read_text()).get("tie_word_embeddings")
    return None


def training_dtype(cfg) -> str:
    """The dtype TRL loads the policy (and a full fine-tuning reference) in: sage-train's
    ``model_init_kwargs`` (``sage.train.main.grpo_args``), where ``trl.model_init_kwargs`` wins."""
    from sage.models import policy_dtype

    dtype = policy_dtype(str(cfg.model.dtype), lora=cfg.model.lora is not None)
    return str({"dtype": dtype, **(cfg.trl.model_init_kwargs or {})}["dtype"])


def batch_of(cfg, prompt_tokens: int, processes: int) -> Batch:
    t = cfg.trl
    if t.steps_per_generation is not None:
        steps_per_generation = t.steps_per_generation
    elif t.generation_batch_size is not None:
        steps_per_generation = t.generation_batch_size // (t.per_device_train_batch_size * processes)
    else:
        steps_per_generation = t.gradient_accumulation_steps
    return Batch(
        micro=t.per_device_train_batch_size,
        accumulation=t.gradient_accumulation_steps,
        processes=processes,
        num_generations=t.num_generations,
        prompt_tokens=prompt_tokens,
        completion_tokens=cfg.model.max_completion_length,
        steps_per_generation=steps_per_generation,
    )


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


def colocated_fraction(cfg) -> float:
    """The share of each GPU a training-rollout engine beside the trainer takes: TRL's colocated engine
    (``rollout=vllm_merged``) or sage's adapter-serving one (``rollout=vllm``), both sized by
    ``trl.vllm_gpu_memory_utilization``; 0 with no engine on the training GPU (or TRL's server mode)."""
    t = cfg.trl
    colocated = t.use_vllm and t.vllm_mode == "colocate"
    from omegaconf import OmegaConf

    target = OmegaConf.select(cfg, "rollout_func._target_")
    adapter_engine = target == "sage.train.vllm_rollout.VllmRollout"
    return float(t.vllm_gpu_memory_utilization) if colocated or adapter_engine else 0.0


def plan(cfg, gpu_gib: float, prompt_tokens: int, processes: int = 1) -> tuple[Batch, dict[str, float], str]:
    """Batch shape and memory estimate of a composed sage-train config (one process per GPU)."""
    batch = batch_of(cfg, prompt_tokens, processes)
    arch, origin = architecture(cfg.model.source)
    lora = None if cfg.model.lora is None else (cfg.model.lora.r, list(cfg.model.lora.target_modules))
    parts = estimate(
        arch,
        batch,
        lora=lora,
        beta=cfg.divergence.beta,
        optim=str(cfg.trl.optim),
        gradient_checkpointing=bool(cfg.trl.gradient_checkpointing),
        vllm_fraction=colocated_fraction(cfg),
        gpu_gib=gpu_gib,
        dtype=training_dtype(cfg),
    )
    return batch, parts, origin


def engine_room_dtype(cfg) -> str:
    """The dtype a colocated engine holds its weights and KV cache in on the cluster. sage's adapter engine
    (``rollout=vllm``) serves in ``model.engine_dtype``, whose ``auto`` is bfloat16 on the bfloat16 GPUs a
    plan is for (resolving it on the planning machine would size the cluster's engine by this one's CPU);
    TRL's engine (``rollout=vllm_merged``) serves in the checkpoint's dtype, ``model.dtype``."""
    from omegaconf import OmegaConf

    model_dtype = str(getattr(cfg.model.dtype, "value", cfg.model.dtype))
    if OmegaConf.select(cfg, "rollout_func._target_") != "sage.train.vllm_rollout.VllmRollout":
        return model_dtype
    engine = str(getattr(cfg.model.engine_dtype, "value", cfg.model.engine_dtype))
    return "bfloat16" if engine == "auto" else engine


# ---- completions -------------------------------------------------------------------------------------


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

    from sage.config import instantiate_node

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


# ---- warnings ----------------------------------------------------------------------------------------


def mount_of(path: Path, mounts: str) -> tuple[str, str]:
    """(mount point, filesystem type) holding ``path``, from a /proc/mounts text: the longest mount point
    that is a prefix of the path (the last such line: a later mount hides an earlier one, as autofs's)."""
    best = ("/", "unknown")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == Path(point) or Path(point) in path.parents
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def shared_folder_warnings(folders: dict[str, Path], mounts: str) -> list[str]:
    """A warning for each folder every SLURM job must see that is on a node-local filesystem."""
    out = []
    for what, folder in folders.items():
        path = Path(os.path.abspath(folder))
        point, fstype = mount_of(path, mounts)
        if fstype not in NETWORK_FILESYSTEMS:
            out.append(
                f"warning: {what} {path} is on {fstype} (mounted at {point}) here, not a network filesystem: "
                "jobs on other nodes will not see it; put it on a shared folder"
            )
    return out


def store_uri(cfg) -> str:
    """The MLflow store sage-train will write (``sage.tracking.resolve_uri``), without creating it."""
    from sage.tracking import default_uri

    configured = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    return configured or default_uri()


def cluster_warnings(cfg, launcher, jobs: int, mounts: str) -> list[str]:
    """What breaks on a cluster: a SQLite store written from several nodes, and, under the SLURM launcher,
    the cache, the SQLite file or the sweep dir on a node-local filesystem."""
    from sage.paths import cache_dir

    slurm = str(launcher._target_).endswith("SlurmLauncher")
    nodes = int(launcher.get("nodes", 1) or 1)
    uri = store_uri(cfg)
    sqlite = uri.startswith("sqlite:///")
    out = []
    if sqlite and slurm and (nodes > 1 or jobs > 1):
        who = f"a job over {nodes} nodes" if nodes > 1 else f"{jobs} SLURM jobs, on any nodes,"
        out.append(
            f"warning: the MLflow store is the SQLite file {uri.removeprefix('sqlite:///')}, and {who} write "
            "it: SQLite's locks are not reliable on a network filesystem; run a tracking server "
            "(scripts/mlflow_server.sh, or PostgreSQL: scripts/postgres.sh) and set tracking.uri "
            "or $MLFLOW_TRACKING_URI"
        )
    if slurm:
        folders = {"the cache (sage.paths.cache_dir(): $SAGE_CACHE_DIR, else ~/.cache/sage)": cache_dir()}
        if sqlite:
            folders["the MLflow SQLite store (tracking.uri / $MLFLOW_TRACKING_URI)"] = Path(
                uri.removeprefix("sqlite:///")
            ).parent
        folders["the sweep dir (hydra.sweep.dir)"] = Path(str(cfg.hydra.sweep.dir))
        out += shared_folder_warnings(folders, mounts)
    return out


# ---- the grid ----------------------------------------------------------------------------------------


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
