"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Each option file in ``conf/<group>/`` starts with ``defaults: [base_<schema>]``, so a misspelt key or a
wrong type fails at composition with the key named, before any model is loaded. Cross-group rules that a
per-group schema cannot see are checked by ``validate`` before any expensive work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message is one line that says what to change."""


# Enums make OmegaConf reject a wrong value at composition and list the allowed ones; the str mixin keeps
# them equal to their names for the code they are passed to.
class LossType(StrEnum):
    grpo = "grpo"
    bnpo = "bnpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"


class ScaleRewards(StrEnum):
    group = "group"
    batch = "batch"
    none = "none"


class ISLevel(StrEnum):
    token = "token"
    sequence = "sequence"


class Estimator(StrEnum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class Normalisation(StrEnum):
    minmax = "minmax"
    rank = "rank"
    zscore = "zscore"


class SurprisalSource(StrEnum):
    policy = "policy"
    ref = "ref"


class VllmMode(StrEnum):
    colocate = "colocate"
    server = "server"


class Resume(StrEnum):
    """What sage-train does with the checkpoints already in its output_dir (see ``resume_mode``)."""

    false = "false"  # refuse them: a new run must not overwrite a recorded one
    true = "true"  # continue from the last one; an error if there is none
    auto = "auto"  # continue if there is one, else start (what the launchers give every job)


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# ---------------------------------------------------------------- model
@dataclass
class LoraConfig:
    r: int = field(default=8, metadata={"help": "LoRA rank"})
    alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (alpha / r)"})
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class SFTStageConfig:
    """Supervised stage for base models; its merged output is the RL start AND the reference policy."""

    data: Any = field(default=MISSING, metadata={"help": "_target_ returning a Dataset(prompt, completion)"})
    epochs: float = 2.0
    learning_rate: float = 2e-4
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    weight_decay: float = 0.01
    warmup_steps: int = 5
    lr_scheduler_type: str = "linear"
    optim: str = "adamw_torch"
    max_length: int = 2048
    max_steps: int = field(default=-1, metadata={"help": "-1: run the full epochs"})
    seed: int = 3407


@dataclass
class ModelConfig:
    source: Any = field(default=MISSING, metadata={"help": "_target_ returning a local path or hub id"})
    chat: bool = field(default=True, metadata={"help": "prompts as system+user chat (False: bare text)"})
    dtype: DType = DType.bfloat16
    lora: LoraConfig | None = field(default=None, metadata={"help": "None: full fine-tuning"})
    max_completion_length: int = 2048
    branch_threshold: float = field(
        default=1.2,
        metadata={"help": "default entropy threshold of guide=branch for this model (paper: 1.2 nats)"},
    )
    sft: SFTStageConfig | None = field(default=None, metadata={"help": "None: no SFT stage"})


# ---------------------------------------------------------------- data
@dataclass
class ArithDataConfig:
    _target_: str = "sage.testbed.task.arith_dataset"
    n: int = 2000
    seed: int = 0


@dataclass
class MathDataConfig:
    _target_: str = "sage.data.datasets.math_prompts"
    source: str = MISSING
    split: str = "train"
    problem_field: str = "prompt"
    answer_field: str = "solution"
    limit: int | None = 2000


# ---------------------------------------------------------------- algorithm (TRL's own knobs)
@dataclass
class AlgorithmConfig:
    loss_type: LossType = field(default=LossType.grpo, metadata={"help": "TRL's aggregation rule"})
    scale_rewards: ScaleRewards = field(default=ScaleRewards.group, metadata={"help": "Dr.GRPO: none"})
    epsilon: float = 0.2
    epsilon_high: float | None = field(default=None, metadata={"help": "None: = epsilon; DAPO 0.28"})
    importance_sampling_level: ISLevel = field(default=ISLevel.token, metadata={"help": "GSPO: sequence"})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "DAPO's overlong masking"})
    filter_zero_variance_groups: bool = field(
        default=False, metadata={"help": "DAPO: drop groups whose rewards are all equal from the loss"}
    )
    num_iterations: int = 1
    steps_per_generation: int | None = None


# ---------------------------------------------------------------- divergence
@dataclass
class ReverseKLConfig:
    _target_: str = "sage.objective.divergences.ReverseKL"
    beta: float = 0.05
    estimator: Estimator = field(default=Estimator.k3, metadata={"help": "see sage/divergences.py"})
    importance_weighted: bool = field(
        default=False, metadata={"help": "x pi/pi_old (TRL's use_bias_correction_kl); paper: false"}
    )


@dataclass
class ForwardKLConfig:
    _target_: str = "sage.objective.divergences.ForwardKL"
    beta: float = 0.05


@dataclass
class NoDivergenceConfig:
    _target_: str = "sage.objective.divergences.NoDivergence"
    beta: float = 0.0


# ---------------------------------------------------------------- guide
@dataclass
class NoGuideConfig:
    _target_: str = "sage.objective.guides.NoGuide"


@dataclass
class RandomGuideConfig:
    _target_: str = "sage.objective.guides.RandomGuide"
    _partial_: bool = True  # the trainer supplies the schedule
    eps_start: float = 0.1
    eps_end: float = 0.0
    sigma_start: float = 0.15
    sigma_end: float = 0.05
    q_min: float = 0.6
    q_max: float = 1.4
    seed: int = 0


@dataclass
class TokenGuideConfig:
    _target_: str = "sage.objective.guides.TokenGuide"
    _partial_: bool = True
    alpha_start: float = 0.3
    alpha_end: float = 0.1
    sigma_start: float = 0.25
    sigma_end: float = 0.1
    normalisation: Normalisation = Normalisation.minmax
    source: SurprisalSource = field(default=SurprisalSource.policy, metadata={"help": "whose surprisal"})
    q_min: float = 0.6
    q_max: float = 1.4
    seed: int = 0


@dataclass
class BranchGuideConfig:
    _target_: str = "sage.objective.guides.BranchGuide"
    ratio: float = 0.3
    threshold: float = 1.2
    q_min: float = 0.6
    q_max: float = 1.4


# ---------------------------------------------------------------- schedule
@dataclass
class ConstantScheduleConfig:
    _target_: str = "sage.objective.schedules.ConstantSchedule"


@dataclass
class CosineScheduleConfig:
    _target_: str = "sage.objective.schedules.CosineSchedule"
    _partial_: bool = True  # the trainer supplies max_steps
    cycles: int = 8
    decay: float = 0.9


# ---------------------------------------------------------------- rollout
@dataclass
class RolloutConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = 0.01
    use_vllm: bool = False
    vllm_mode: VllmMode = VllmMode.colocate
    vllm_gpu_memory_utilization: float = 0.5
    vllm_tensor_parallel_size: int = 1


# ---------------------------------------------------------------- eval
@dataclass
class EvalConfig:
    datasets: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "name -> _target_ returning rows {id, problem, answer}"}
    )
    n_samples: int = 64
    ks: list[int] = field(default_factory=lambda: [1, 8, 64])
    limit: int | None = field(default=None, metadata={"help": "first N problems of each dataset"})
    seeds: list[int] = field(default_factory=lambda: [0])
    temperature: float = 0.3
    top_p: float = 0.95
    max_new_tokens: int | None = field(default=None, metadata={"help": "None: model.max_completion_length"})
    batch_size: int = field(default=512, metadata={"help": "sequences per generate call (CPU backend)"})
    at_end: bool = field(default=True, metadata={"help": "evaluate base and trained model after training"})
    every_steps: int | None = field(
        default=None, metadata={"help": "also evaluate every N optimiser steps during training (None: off)"}
    )
    every_n_samples: int = field(default=8, metadata={"help": "samples per problem, periodic evaluation"})


# ---------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    max_steps: int = 100
    learning_rate: float = 1e-4
    prompts_per_step: int = 8
    num_generations: int = 8
    gradient_accumulation_steps: int = 1
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "linear"
    optim: str = "adamw_torch"
    max_grad_norm: float = 1.0
    save_steps: int = 50
    save_total_limit: int | None = 2
    logging_steps: int = 1
    gradient_checkpointing: bool = False
    bf16: bool = False


@dataclass
class TrackingConfig:
    """MLflow: the single record of runs. Secrets (tokens, passwords) come only from the environment."""

    enabled: bool = True
    uri: str | None = field(
        default=None,
        metadata={"help": "None: $MLFLOW_TRACKING_URI, else sqlite:///<runs root>/mlflow.db (embedded)"},
    )
    experiment: str = "sage"
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict, metadata={"help": "extra tags, e.g. study, trial"})
    completions_sample: int | None = field(
        default=None, metadata={"help": "problems per dataset whose completions are saved (None: all)"}
    )


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: Any = MISSING
    algorithm: AlgorithmConfig = MISSING
    divergence: Any = MISSING
    guide: Any = MISSING
    schedule: Any = MISSING
    rollout: RolloutConfig = MISSING
    eval: EvalConfig = MISSING
    trainer: TrainerConfig = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    method: str | None = field(
        default=None, metadata={"help": "method label for reports (set by the experiment/ presets)"}
    )
    seed: int = 0
    output_dir: str | None = field(default=None, metadata={"help": "None: Hydra's run (or sweep job) dir"})
    # Not typed Resume: the command line's resume=true/false arrive as YAML booleans, which OmegaConf 2.3
    # refuses for an Enum; the union still refuses numbers at composition, resume_mode any other string.
    resume: bool | str = field(
        default=False,
        metadata={"help": "false | true | auto: what to do with output_dir's checkpoints (Resume)"},
    )
    callbacks: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "name -> _target_ of a transformers TrainerCallback added to the trainer; each periodic "
            "evaluation hands its metrics to their on_evaluate (e.g. the Optuna sweeper's "
            "+callbacks.optuna_pruning)"
        },
    )


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, name, node in [
        ("model", "base_model", ModelConfig),
        ("data", "base_arith", ArithDataConfig),
        ("data", "base_math", MathDataConfig),
        ("algorithm", "base_algorithm", AlgorithmConfig),
        ("divergence", "base_reverse_kl", ReverseKLConfig),
        ("divergence", "base_forward_kl", ForwardKLConfig),
        ("divergence", "base_none", NoDivergenceConfig),
        ("guide", "base_none", NoGuideConfig),
        ("guide", "base_random", RandomGuideConfig),
        ("guide", "base_token", TokenGuideConfig),
        ("guide", "base_branch", BranchGuideConfig),
        ("schedule", "base_constant", ConstantScheduleConfig),
        ("schedule", "base_cosine", CosineScheduleConfig),
        ("rollout", "base_rollout", RolloutConfig),
        ("eval", "base_eval", EvalConfig),
        ("trainer", "base_trainer", TrainerConfig),
    ]:
        cs.store(group=group, name=name, node=node)


def build(node: Any, **runtime: Any) -> Any:
    """``hydra.utils.instantiate`` whose failures (bad file, bad row, bad value) surface as the one-line
    ConfigError of their cause instead of Hydra's multi-line wrapper."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **runtime)
    except InstantiationException as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{node._target_}: {cause}") from e


def validate(cfg: DictConfig) -> None:
    """Cross-group rules, checked before anything expensive; each failure is one line."""
    if cfg.guide._target_ != NoGuideConfig._target_ and cfg.divergence.beta == 0:
        raise ConfigError(
            f"guide={cfg.guide._target_.rsplit('.', 1)[-1]} reshapes the anchor of a divergence, but "
            "divergence=none has no anchor: choose divergence=reverse_kl (SAGE) or forward_kl, or guide=none"
        )
    if cfg.rollout.use_vllm:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "rollout=vllm needs a CUDA GPU and none is visible; use rollout=hf on this machine"
            )
    t = cfg.trainer
    if t.num_generations < 2:
        raise ConfigError(
            f"trainer.num_generations must be >= 2 for group advantages (got {t.num_generations})"
        )
    check_eval(cfg.eval)
    resume_mode(cfg.resume)
    check_callbacks(cfg)


def periodic_metrics(eval_cfg: DictConfig) -> list[str]:
    """Names of the metrics the periodic evaluation logs (sage.train.callbacks.PeriodicEval)."""
    return [
        f"eval/periodic/{name}/pass@{k}" for name in eval_cfg.datasets for k in (1, eval_cfg.every_n_samples)
    ]


def resume_mode(value: bool | str) -> Resume:
    """``resume=`` as given (a YAML boolean or a string) -> Resume; anything else is a one-line error."""
    if isinstance(value, bool):
        return Resume.true if value else Resume.false
    if value not in set(Resume):
        raise ConfigError(f"resume={value} is not one of {[m.value for m in Resume]}")
    return Resume(value)


def check_callbacks(cfg: DictConfig) -> None:
    """A callback that names a ``metric`` reads it from the periodic evaluation: that must run and log it."""
    for name, node in cfg.callbacks.items():
        if "metric" not in node:
            continue
        if not cfg.eval.every_steps:
            raise ConfigError(
                f"callbacks.{name} reads {node.metric} from the periodic evaluation: "
                "set eval.every_steps (e.g. 10)"
            )
        allowed = periodic_metrics(cfg.eval)
        if node.metric not in allowed:
            raise ConfigError(
                f"callbacks.{name}.metric={node.metric} is not a periodic metric of this run; "
                f"choose from {allowed}"
            )


def check_eval(eval_cfg: DictConfig) -> None:
    """Rules of the eval group shared by sage-train and sage-eval."""
    for k in eval_cfg.ks:
        if not 1 <= k <= eval_cfg.n_samples:
            raise ConfigError(
                f"eval.ks contains {k}; each k must be in 1..eval.n_samples={eval_cfg.n_samples}"
            )


def exit_on_config_error(fn: Any, cfg: DictConfig) -> Any:
    """Run an entry point's body; a ConfigError becomes its one-line message and exit code 2."""
    import sys

    try:
        return fn(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
