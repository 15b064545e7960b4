"""The SFT stage: LoRA (or full) supervised fine-tuning of a base model, merged and saved as the RL start.

The merged SFT model is both the RL start and the reference policy (TRL then uses a disabled adapter or a
copy of these weights), never the pre-SFT base. ``model.sft.args`` is TRL's ``SFTConfig`` with its own
keys; this module supplies only the output folder, the checkpoint policy and the model's dtype.

The stage is a function of (base model, SFT data, SFT args, LoRA, dtype, template), so its result is
stored once under that key and shared by every job of a grid that asks for it: the first job trains,
the others wait on a lock and start from its folder (and share its base-model evaluation cells).

Two departures from a plain ``SFTTrainer`` call, so that the model is Table 7's on any number of GPUs:
- rows whose whole conversation is longer than ``max_length`` tokens are dropped, not truncated: TRL
  keeps a long row's start, so a long worked solution would lose its answer, closing tags and end-of-turn
  token, and the model would learn working that never closes;
- the effective batch (``per_device_train_batch_size`` x ``gradient_accumulation_steps``, what one
  process trains with) is kept on N processes by splitting it over them; a batch that does not split
  (Table 7's batch of 1 on 8 GPUs) is trained by the main process alone, in a child process of its own,
  while the others wait for its result.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sage import distributed
from sage.durable import build_once
from sage.paths import content_key
from sage.targets import changed_only, instantiate_node

log = logging.getLogger(__name__)

DONE_FILE = "sft_info.json"
# Raised when what the stage does changes for the same settings (2: chat models stop at the template's
# end-of-turn token; 3: rows longer than max_length are dropped, and the effective batch is the same on any
# number of processes), so that a merged model an earlier version stored is not reused.
SFT_FORMAT = 3


def effective_batch(args: DictConfig) -> int:
    """Rows per optimiser step of the SFT stage as ``model.sft.args`` states it for one process."""
    return int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)


def split_batch(per_device: int, accumulation: int, processes: int) -> tuple[int, int] | None:
    """(rows per forward pass, accumulation steps) of each of ``processes`` processes whose optimiser step
    takes the same ``per_device x accumulation`` rows as one process's; None if that many rows cannot be
    shared equally (the main process then trains alone). The micro-batch never grows, so neither does the
    memory a forward pass needs."""
    total = per_device * accumulation
    if total % processes:
        return None
    share = total // processes
    micro = math.gcd(per_device, share)
    return micro, share // micro


def stage_processes(args: DictConfig, processes: int) -> int:
    """How many of a job's ``processes`` an SFT job of its own can use: the most that share the effective
    batch equally (``split_batch``), one for Table 7's batch of 1. A grid's SFT job asks for no more."""
    total = effective_batch(args)
    return max(p for p in range(1, processes + 1) if total % p == 0)


# What turns a sage-train run into the build of its SFT stage alone (the cache entry every run of its model
# starts from): no RL step, no evaluation, and no MLflow run, since a cache entry is not a result to report.
BUILD_ONLY = ("trl.max_steps=0", "eval.at_end=false", "tracking.enabled=false")


def stage_identity(cfg: DictConfig) -> str:
    """What two configs must share to start from one SFT stage, known before their base model exists: the
    cache key with the model source's config in place of its folder."""
    source = OmegaConf.to_container(cfg.model.source, resolve=True)
    return content_key(sft_key(cfg, json.dumps(source, sort_keys=True)))


def cached_stage(cfg: DictConfig) -> Path | None:
    """The finished SFT folder ``run_sft`` would reuse for ``cfg``, or None; builds and fetches nothing (a
    base model that is not on this machine has no SFT stage built from it here)."""
    from sage.paths import cache_dir

    base = instantiate_node(cfg.model.source, present_only=True)
    if base is None:
        return None
    final = cache_dir() / "sft" / content_key(sft_key(cfg, base))
    return final if (final / DONE_FILE).exists() else None


# ---- a grid's SFT stages as jobs of their own -------------------------------------------------------
# A model with an SFT stage trains it once per cache key and every job that starts from it waits on the
# cache's lock while one of them builds it: on a cluster, every job's GPUs idle for the whole stage, and the
# stage on one process of a multi-GPU job. So a grid's launcher (launchers/submitit.py) and its plan
# (``python -m sage.train.plan -m ...``) find, before anything is submitted, the stages the grid's jobs need
# and the cache lacks, and run each as one job of its own sized to its batch (``stage_processes``), with the
# jobs that start from it held until it has succeeded. Its command is its first dependent job's with
# ``BUILD_ONLY``, run in ``<sweep dir>/.sft/<stage key>``.

SFT_SUBDIR = ".sft"  # in a sweep dir: one folder per SFT job, named by its stage's key


@dataclass
class SFTStage:
    """One SFT stage a grid needs built: its job's overrides and size, and the grid jobs that wait for it."""

    identity: str  # sage.train.sft.stage_identity: equal for every job that starts from this stage
    model: str  # the model option (``model=tiny_chat``) and its model.* overrides, for the driver's lines
    overrides: list[str]
    processes: int
    dependents: list[int] = field(default_factory=list)  # indexes into the grid's jobs

    @property
    def subdir(self) -> str:
        return f"{SFT_SUBDIR}/{self.identity[:16]}"


def model_label(cfg: DictConfig, overrides: Sequence[str]) -> str:
    """``model=<option>`` and the job's ``model.*`` overrides: what an SFT stage is built for."""
    choice = OmegaConf.select(cfg, "hydra.runtime.choices.model")
    keyed = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].startswith("model.")]
    return " ".join([f"model={choice}", *keyed])


def sft_stages(
    compose: Callable[[list[str]], DictConfig], job_overrides: Sequence[Sequence[str]], processes: int
) -> list[SFTStage]:
    """The SFT stages the jobs (``job_overrides``, each composed by ``compose``) need and the cache lacks,
    in the order of the first job that needs each; ``processes``: a job's processes (tasks x nodes)."""
    stages: dict[str, SFTStage] = {}
    for i, overrides in enumerate(job_overrides):
        cfg = compose(list(overrides))
        if cfg.model.get("sft") is None:
            continue
        identity = stage_identity(cfg)
        if identity not in stages:
            if cached_stage(cfg) is not None:
                continue
            set_here = {"resume", *(b.split("=", 1)[0] for b in BUILD_ONLY)}
            own = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in set_here]
            stage = SFTStage(
                identity, model_label(cfg, overrides), [], stage_processes(cfg.model.sft.args, processes)
            )
            stage.overrides = [*own, *BUILD_ONLY, f"hydra.sweep.subdir={stage.subdir}"]
            stages[identity] = stage
        stages[identity].dependents.append(i)
    return list(stages.values())


def sft_key(cfg: DictConfig, base_path: str) -> dict:
    """Everything the merged model depends on; the effective batch is stated even though ``args`` implies
    it, because it is the fact a model trained on another number of processes must share to be reused."""
    s, lora = cfg.model.sft, cfg.model.lora
    return {
        "format": SFT_FORMAT,
        "effective_batch": effective_batch(s.args),
        "base": str(Path(base_path).resolve()) if Path(base_path).exists() else base_path,
        "data": OmegaConf.to_container(s.data, resolve=True),
        "args": OmegaConf.to_container(changed_only(s.args)),
        "lora": None if lora is None else OmegaConf.to_container(changed_only(lora)),
        "dtype": str(cfg.model.dtype),
        "chat": bool(cfg.model.chat),
    }


def run_sft(cfg: DictConfig, base_path: str, root: Path, peft_config) -> str:
    """The merged SFT model's folder under ``root``, trained only if no job has built it yet."""
    key = sft_key(cfg, base_path)
    final = root / content_key(key)
    if (final / DONE_FILE).exists():
        log.info("SFT stage already done: %s", final)
    world = distributed.world_size()
    args = cfg.model.sft.args
    if world == 1 or split_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps, world):

        def build(folder: Path) -> None:
            _train(cfg, base_path, folder, peft_config, key)

        return str(build_once(final, DONE_FILE, build, processes="all"))

    def build_alone(folder: Path) -> None:
        _train_in_child(cfg, base_path, folder)

    log.info(
        "SFT stage: an effective batch of %d rows cannot be shared by %d processes: the main process "
        "trains it alone while the others wait",
        effective_batch(args),
        world,
    )
    return str(build_once(final, DONE_FILE, build_alone, processes="main"))


# What makes a process part of a multi-process launch (torchrun, SLURM tasks through submitit, MPI): the
# child that trains the SFT stage alone is started without it, so that it neither joins nor waits for a
# process group.
_LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PMI_RANK",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_SIZE",
)


def _train_in_child(cfg: DictConfig, base_path: str, folder: Path) -> None:
    """``_train`` in a new single-process Python (this process belongs to a process group, which a
    Trainer would join), on this process's own GPU."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("TORCHELASTIC_")}
    local = os.environ.get("LOCAL_RANK", "0")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[int(local)] if visible else local
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=folder, delete=False) as f:
        OmegaConf.save(cfg, f.name, resolve=True)
    try:
        subprocess.run(
            [sys.executable, "-m", "sage.train.sft", f.name, base_path, str(folder)], env=env, check=True
        )
    except subprocess.CalledProcessError as e:
        raise RuntimeError(
            f"the SFT stage failed in its own process (exit code {e.returncode}); see its log above"
        ) from None
    finally:
        os.unlink(f.name)


def _train(cfg: DictConfig, base_path: str, folder: Path, peft_config, key: dict) -> None:
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from sage.models import end_of_turn_token, policy_dtype
    from sage.trl_checks import cpu_precision

    s = cfg.model.sft
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    dataset = keep_whole_rows(instantiate_node(s.data, chat=cfg.model.chat), tokenizer, s.args.max_length)
    world = distributed.world_size()
    micro, accumulation = split_batch(
        s.args.per_device_train_batch_size, s.args.gradient_accumulation_steps, world
    )
    # A chat model learns to end its turn with the template's end-of-turn token, which is not always the
    # tokenizer's eos (base Qwen2.5-Math: <|im_end|> vs <|endoftext|>). TRL's eos_token makes it the eos of
    # the saved tokenizer and a stop id of the saved generation_config, so RL rollouts, vLLM and our
    # evaluator stop where the model ends its answer. model.sft.args.eos_token, when set, wins.
    stop = s.args.get("eos_token") or (end_of_turn_token(tokenizer) if cfg.model.chat else None)
    args = instantiate_node(
        changed_only(s.args),
        output_dir=str(folder / "trainer"),
        save_strategy="no",  # only the merged result is kept
        model_init_kwargs={
            "dtype": policy_dtype(str(cfg.model.dtype), lora=peft_config is not None),
            **(s.args.model_init_kwargs or {}),
        },
        **({"eos_token": stop} if stop else {}),
        **cpu_precision(s.args, "model.sft.args"),  # model.sft.args.bf16 without a GPU: the CPU's autocast
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
    )
    trainer = SFTTrainer(
        model=base_path, args=args, train_dataset=dataset, peft_config=peft_config, processing_class=tokenizer
    )
    trainer.train()  # every process of a multi-process run trains; the main one merges and writes
    if not distributed.is_main():
        return
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    info = {
        "key": key,
        "optimiser_steps": trainer.state.global_step,
        "batch": {"processes": world, "per_device": micro, "accumulation": accumulation},
        "log": trainer.state.log_history,
    }
    (folder / DONE_FILE).write_text(json.dumps(info, indent=2))
    log.info(
        "SFT stage trained on %d process(es) (%d rows per forward pass x %d accumulation steps x %d "
        "processes = %d rows per optimiser step, %d steps), merged and written once",
        world,
        micro,
        accumulation,
        world,
        micro * accumulation * world,
        trainer.state.global_step,
    )


def conversation_length(tokenizer, row: dict) -> int:
    """Tokens of a prompt-completion row as TRL's SFT tokenisation makes them: the chat template over the
    whole conversation, or the text with the eos TRL appends (tests/test_sft_data.py checks it against
    TRL's own tokenisation)."""
    if isinstance(row["prompt"], list):
        rendered = tokenizer.apply_chat_template(
            row["prompt"] + row["completion"], tokenize=True, return_dict=True
        )
        return len(rendered["input_ids"])
    text = row["prompt"] + row["completion"]
    if not text.endswith(tokenizer.eos_token):
        text += tokenizer.eos_token
    return len(tokenizer(text)["input_ids"])


def keep_whole_rows(dataset, tokenizer, max_length: int | None):
    """The rows whose whole conversation fits ``max_length`` tokens (TRL would cut the others' end: the
    answer, its closing tags and the end-of-turn token); how many were kept and dropped is logged."""
    if max_length is None:
        return dataset
    lengths = [conversation_length(tokenizer, row) for row in dataset]
    kept = [i for i, n in enumerate(lengths) if n <= max_length]
    log.info(
        "SFT data: %d of %d rows kept; %d dropped as longer than max_length=%d tokens (longest: %d)",
        len(kept),
        len(lengths),
        len(lengths) - len(kept),
        max_length,
        max(lengths, default=0),
    )
    if not kept:
        raise ValueError(
            f"model.sft.args.max_length={max_length}: no SFT row fits (shortest: {min(lengths)} tokens)"
        )
    return dataset.select(kept)


def main() -> None:
    """``python -m sage.train.sft <config.yaml> <base model> <folder>``: the SFT stage alone, in the
    process ``run_sft`` starts for it when the effective batch cannot be shared."""
    from sage.config import register_configs
    from sage.models import lora_config

    register_configs()  # TRL's and peft's schemas: what changed_only and lora_config compare against
    config, base_path, folder = sys.argv[1:]
    cfg = OmegaConf.load(config)
    _train(cfg, base_path, Path(folder), lora_config(cfg), sft_key(cfg, base_path))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
