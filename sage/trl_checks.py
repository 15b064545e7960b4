"""TRL's keys checked before any model or MLflow run exists: sage-train and the plan
(``python -m sage.train.plan``) run :func:`check_trl` on the composed config.

Three kinds of check, each failure one line naming the key:
- the ranges TRL does not check itself: the clip range (``trl.epsilon``, ``trl.epsilon_high``,
  ``trl.delta``), the sampling temperature, batch sizes and accumulation, ``model.max_completion_length``
  (positive, and within the model's context where the config tells it);
- the optimiser step of a ``trl`` preset that fixes it (``trl=paper``: 8 prompts x 8 completions): a run
  whose processes x per-device batch x accumulation differs is refused unless ``allow_batch_change=true``;
- TRL's own validation: ``trl.GRPOConfig`` (and ``trl.SFTConfig`` for a model with an SFT stage) built from
  the config as sage-train builds it, in a throwaway folder, with its error turned into one line.

The objects built here never set up devices: ``TrainingArguments`` would join the launcher's process group
on construction (before sage's own ``distributed.init`` and its timeout), so they see the run's number of
processes without touching it. The plan checks a config for another machine (``here=False``): what depends
on this machine's devices (bf16 on a GPU) is left to sage-train, which runs where the job runs. Without a GPU,
``bf16: true`` trains under the CPU's bfloat16 autocast, as the cluster does on its GPUs
(:func:`cpu_precision`).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sage.config import ConfigError
from sage.hardware import cpu_computes_bfloat16
from sage.targets import changed_only

# GRPOConfig's keys that sage-train supplies from keys of their own (sage.config.GRPO_RUNTIME): the key a
# user sets for each.
RUNTIME_KEYS = {
    "max_completion_length": "model.max_completion_length",
    "seed": "seed",
    "beta": "divergence.beta",
    "use_bias_correction_kl": "divergence.importance_weighted",
}
TESTBED_SOURCE = "sage.testbed.model.build_tiny_model"


def grpo_runtime(cfg: DictConfig) -> dict[str, Any]:
    """What sage-train passes GRPOConfig besides the ``trl`` node (one key per fact): the seed, the
    divergence's beta and importance weighting, the model's completion length and load dtype."""
    from sage.models import policy_dtype  # full fine-tuning keeps float32 master weights

    dtype = policy_dtype(str(cfg.model.dtype), lora=cfg.model.lora is not None)
    return {
        "seed": cfg.seed,
        "beta": cfg.divergence.beta,
        "use_bias_correction_kl": bool(cfg.divergence.get("importance_weighted", False)),
        "max_completion_length": cfg.model.max_completion_length,
        "model_init_kwargs": {"dtype": dtype, **(cfg.trl.model_init_kwargs or {})},
    }


def cpu_precision(node: DictConfig, prefix: str) -> dict[str, Any]:
    """What a TRL config with ``bf16: true`` needs besides its node to train on this machine's CPU, as the
    cluster trains: under bfloat16 autocast (transformers refuses ``bf16`` without a GPU unless ``use_cpu``
    says the CPU is meant). A CPU without bfloat16 arithmetic would emulate every product of the step, so it
    is refused in one line naming the key (``prefix``: where the node sits). Empty where CUDA trains."""
    import torch

    if torch.cuda.is_available() or not node.get("bf16"):
        return {}
    if not cpu_computes_bfloat16():
        raise ConfigError(
            f"{prefix}.bf16=true: this CPU has no bfloat16 arithmetic (no AVX512-BF16 or AMX), so every "
            f"product of the step would be emulated; set {prefix}.bf16=false to train in float32"
        )
    return {"use_cpu": True}


# ---------------------------------------------------------------- ranges TRL does not check


def _positive(key: str, value: Any, what: str) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{key} must be a finite number > 0 (got {value}): {what}")


def _at_least_one(key: str, value: Any) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key} must be >= 1 (got {value})")


def check_ranges(cfg: DictConfig) -> None:
    """The values TRL takes without a word and fails on (or silently misuses) once the run has started."""
    t = cfg.trl
    _positive("trl.epsilon", t.epsilon, "the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    for key in ("epsilon_high", "delta"):  # None: epsilon's value, and no upper clip (TRL's defaults)
        if t.get(key) is not None:
            _positive(f"trl.{key}", t[key], "a clip bound of the importance ratio (null: TRL's default)")
    _positive("trl.temperature", t.temperature, "the training rollouts' sampling temperature")
    if not 0 < t.top_p <= 1:  # NaN fails too
        raise ConfigError(f"trl.top_p must be in (0, 1] (got {t.top_p})")
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        _at_least_one(f"trl.{key}", t[key])
    if cfg.model.get("sft") is not None:
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            _at_least_one(f"model.sft.args.{key}", cfg.model.sft.args[key])
    length = cfg.model.max_completion_length
    _at_least_one("model.max_completion_length", length)
    context, where = model_context(cfg.model.source)
    if context is not None and length > context:
        raise ConfigError(
            f"model.max_completion_length={length} is longer than the model's context of {context} tokens "
            f"({where}): a completion must fit beside its prompt; give at most {context}"
        )


def model_context(source: DictConfig) -> tuple[int | None, str]:
    """(the model's context in tokens, where that was read), as far as the config tells before the model is
    built: a testbed model's, a local folder's config.json, a hub model's config.json in the local hub
    cache; (None, "") where it cannot tell (a hub model not downloaded yet, a GGUF package)."""
    if source.get("_target_") == TESTBED_SOURCE:
        from sage.testbed.model import CHAT_MAX_POSITIONS, MAX_POSITIONS

        if source.get("chat"):
            return CHAT_MAX_POSITIONS, "the testbed chat model's max_position_embeddings"
        return MAX_POSITIONS, "the testbed model's max_position_embeddings"
    repo = source.get("repo_id")
    if not repo:
        return None, ""
    config = Path(str(repo)) / "config.json"
    if not config.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(repo), "config.json")
        if not isinstance(cached, str):
            return None, ""
        config = Path(cached)
    context = json.loads(config.read_text()).get("max_position_embeddings")
    return (int(context), f"max_position_embeddings of {repo}") if context else (None, "")


# ---------------------------------------------------------------- the preset's batch


def preset_batch(preset: str) -> tuple[int, int]:
    """(completions per forward pass, accumulation steps) that ``conf/trl/<preset>.yaml`` states: the
    preset's optimiser step as one process takes it, TRL's defaults where the file is silent. A preset that
    also sets keys outside ``trl`` (the paper's seed) holds its TRL keys under ``trl:``."""
    from trl import GRPOConfig

    from sage.paths import CONF_DIR

    node = OmegaConf.load(Path(CONF_DIR) / "trl" / f"{preset}.yaml")
    node = node.get("trl", node)  # a `# @package _global_` preset
    defaults = GRPOConfig.__dataclass_fields__
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps")
    micro, accumulation = (int(node.get(k, defaults[k].default)) for k in keys)
    return micro, accumulation


def batch_said(
    preset: str, stated: tuple[int, int], micro: int, accumulation: int, processes: int
) -> str | None:
    """What an optimiser step of ``micro`` x ``accumulation`` x ``processes`` completions does to the step
    ``trl=<preset>`` states (``stated``: its micro-batch and accumulation on one process), with the setting
    that keeps the preset's (the accumulation first: the micro-batch is what must fit in memory); None when
    it takes the preset's."""
    keep, takes = stated[0] * stated[1], micro * accumulation * processes
    if takes == keep:
        return None
    if keep % (micro * processes) == 0:
        fix = f"pass trl.gradient_accumulation_steps={keep // (micro * processes)} to keep {keep}"
    elif keep % (accumulation * processes) == 0:
        fix = f"pass trl.per_device_train_batch_size={keep // (accumulation * processes)} to keep {keep}"
    else:
        fix = (
            f"no trl.gradient_accumulation_steps keeps {keep} with {micro} per forward pass on {processes} "
            f"processes: choose trl.per_device_train_batch_size x trl.gradient_accumulation_steps x "
            f"processes = {keep}"
        )
    plural = "es" if processes > 1 else ""
    return (
        f"trl={preset} states {keep} completions per optimiser step ({stated[0]} per forward pass x "
        f"{stated[1]} accumulation steps on one process); {micro} x {accumulation} x {processes} "
        f"process{plural} takes {takes}: {fix}"
    )


def check_batch(cfg: DictConfig, processes: int, preset: str | None) -> str | None:
    """A run whose optimiser step (processes x ``trl.per_device_train_batch_size`` x
    ``trl.gradient_accumulation_steps``) differs from what its ``trl`` preset states is refused in one line
    naming the setting that restores it, where the preset fixes its batch (``allow_batch_change: false``,
    as ``trl=paper`` sets it: a different step is a different recipe, reported as the paper's). With
    ``allow_batch_change=true`` (the schema's default, so ``trl=testbed``'s) it runs; on several processes
    this returns the warning line that says what it takes instead. ``preset``: Hydra's choice of the trl
    group (None: composed without Hydra's record of its choices, nothing to compare with)."""
    if preset is None or cfg.trl.max_steps == 0:  # no optimiser step (a base row, an SFT stage's own job)
        return None
    t = cfg.trl
    micro, accumulation = int(t.per_device_train_batch_size), int(t.gradient_accumulation_steps)
    said = batch_said(preset, preset_batch(preset), micro, accumulation, processes)
    if said is None:
        return None
    if not cfg.get("allow_batch_change", True):
        takes = micro * accumulation * processes
        raise ConfigError(f"{said}, or allow_batch_change=true to train on {takes} on purpose")
    # one process takes the step its keys state: a changed micro-batch or accumulation is the step the
    # command asks for
    return f"warning: {said}" if processes > 1 else None


# ---------------------------------------------------------------- TRL's own validation


def _planned(cls: type, processes: int, here: bool) -> type:
    """``cls`` (a TrainingArguments) that sees ``processes`` processes and never sets up devices."""
    import torch

    class Planned(cls):
        distributed_state = None

        @property
        def _setup_devices(self) -> torch.device:
            self._n_gpu = int(here and torch.cuda.is_available())
            return torch.device("cuda" if self._n_gpu else "cpu")

        @property
        def world_size(self) -> int:
            return processes

    Planned.__name__ = Planned.__qualname__ = cls.__name__
    return Planned


def _named(message: str, prefix: str, values: dict[str, Any]) -> str:
    """The keys a library's error names (as words, else by a quoted value), with their values."""
    words = list(dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message)))
    keys = [k for k in words if k in values]
    if not keys:  # e.g. an unknown enum value: "nosuch is not a valid OptimizerNames"
        keys = [k for k, v in values.items() if isinstance(v, str) and v in words]

    def key(k: str) -> str:
        return RUNTIME_KEYS[k] if k in RUNTIME_KEYS and prefix == "trl" else f"{prefix}.{k}"

    def shown(v: Any) -> str:  # as the command line writes it
        return json.dumps(v) if v is None or isinstance(v, bool) else str(v)

    return ", ".join(f"{key(k)}={shown(values[k])}" for k in keys) or prefix


def build_checked(node: DictConfig, prefix: str, processes: int, here: bool, **runtime: Any) -> None:
    """Build the TRL config ``node`` describes (its ``_target_``), as sage-train builds it, so that TRL's
    validation runs now; what it raises becomes one line naming the keys it is about (``prefix``: where the
    node sits in the config)."""
    from hydra.utils import get_class

    values = OmegaConf.to_container(changed_only(node), resolve=True, enum_to_str=True)
    cls = _planned(get_class(values.pop("_target_")), processes, here)
    if not here:  # a plan for another machine: this one's bf16 support says nothing about the job's GPUs
        values["use_cpu"] = True
    else:
        values.update(cpu_precision(node, prefix))
    every = {**OmegaConf.to_container(node, resolve=True, enum_to_str=True), **runtime}
    with tempfile.TemporaryDirectory(prefix="sage-trl-check-") as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said again when sage-train builds the run's own
        try:
            cls(**{**values, **runtime, "output_dir": folder})
        except (ValueError, TypeError, ArithmeticError, NotImplementedError) as e:
            said = " ".join(str(e).split())
            raise ConfigError(f"{_named(said, prefix, every)}: {cls.__name__} refuses it: {said}") from e


def check_trl(cfg: DictConfig, processes: int, preset: str | None, *, here: bool = True) -> str | None:
    """Every check of this module, before any model or MLflow run: the ranges, the preset's batch, TRL's
    GRPOConfig (and SFTConfig where the model has an SFT stage). Returns the batch's warning line, if any
    (:func:`check_batch`). ``here``: False for a plan made for another machine."""
    check_ranges(cfg)
    warning = check_batch(cfg, processes, preset)
    build_checked(cfg.trl, "trl", processes, here, **grpo_runtime(cfg))
    if cfg.model.get("sft") is not None:
        build_checked(cfg.model.sft.args, "model.sft.args", processes, here, save_strategy="no")
    return warning
