"""Schemas of ``hydra/sweeper=optuna`` and of its sampler / pruner options (registered with Hydra by
hydra_plugins/sage_optuna_sweeper), so a misspelt key in a search space of conf/hparams_search/ fails at
composition with the key named.

    sage-train -m hparams_search=branch_threshold_ratio [hydra/launcher=slurm] [hydra.sweeper.K=V]
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING


class Direction(Enum):
    maximize = "maximize"
    minimize = "minimize"


class ChoicesAs(Enum):
    points = "points"
    interval = "interval"


# ---------------------------------------------------------------- samplers (hydra/sweeper/sampler=...)
@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    n_startup_trials: int = field(default=8, metadata={"help": "random trials before the model kicks in"})
    multivariate: bool = True
    constant_liar: bool = field(default=True, metadata={"help": "spread a batch of parallel trials apart"})


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class GridSamplerConf:
    """Every combination of the ``choice(...)``/``range(...)`` params; the sweeper supplies the grid."""

    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True
    seed: int | None = None


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int = 8


# ---------------------------------------------------------------- pruners (hydra/sweeper/pruner=...)
@dataclass
class NopPrunerConf:
    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class MedianPrunerConf:
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5
    n_warmup_steps: int = 0


@dataclass
class HyperbandPrunerConf:
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: str = "auto"
    reduction_factor: int = 3


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.sage_optuna_sweeper.SageOptunaSweeper"
    study_name: str = field(default="sage", metadata={"help": "the study (and MLflow tag 'study')"})
    storage: str = field(
        default="sqlite:///${hydra.runtime.cwd}/multirun/optuna/${.study_name}.db",
        metadata={"help": "Optuna storage URL; a stable path, so re-running the command resumes the study"},
    )
    n_trials: int = field(default=24, metadata={"help": "finished trials wanted, those already stored count"})
    n_jobs: int = field(default=4, metadata={"help": "trials per batch handed to the launcher"})
    objectives: list[str] = field(
        default_factory=lambda: ["pass_at_1/trained/arith_heldout", "pass_at_64/trained/arith_heldout"],
        metadata={"help": "names in the run's metrics.json, as MLflow has them (sage.metrics.metric_name)"},
    )
    weights: list[float] | None = field(
        default=None,
        metadata={"help": "None: one objective per metric (Pareto front); a list: one objective sum(w * m)"},
    )
    directions: list[Direction] = field(
        default_factory=lambda: [Direction.maximize, Direction.maximize],
        metadata={"help": "one per objective (one in all when weights are given)"},
    )
    params: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "override key -> interval(a,b) | int(interval(a,b)) | tag(log,interval(a,b)) | "
            "choice(a,b,..) | range(a,b[,step]) | a fixed value"
        },
    )
    choices_as: ChoicesAs = field(
        default=ChoicesAs.points,
        metadata={
            "help": "points: a choice(a,b,..) param is searched among its values; interval: a choice of "
            "numbers (a paper grid's values) is searched over the interval from its lowest to its highest"
        },
    )
    prune_on: str | None = field(
        default=None,
        metadata={
            "help": "periodic metric each trial reports to the pruner every eval.every_steps, e.g. "
            "pass_at_1/periodic/arith_heldout (single objective only); None: no pruning"
        },
    )
    max_retries: int = field(default=1, metadata={"help": "re-runs of a failed trial's params"})
    max_failures: int = field(default=8, metadata={"help": "failed trials in one invocation before stopping"})
    sampler: Any = MISSING
    pruner: Any = MISSING
