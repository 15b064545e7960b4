"""Schema of ``hydra/sweeper=optuna`` and its sampler / pruner options; the search spaces of ``sweeps/*.yaml``
become the config group ``sweep`` (package ``hydra.sweeper``), so ``sweep=<name>`` selects one and a
misspelt key in it fails at composition with the key named.

    sage-train -m hydra/sweeper=optuna sweep=branch_threshold_ratio [hydra/launcher=slurm] [hydra.sweeper.K=V]
"""

import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class Direction(Enum):
    maximize = "maximize"
    minimize = "minimize"


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
    _target_: str = "hydra_plugins.sage_optuna_sweeper.sweeper.SageOptunaSweeper"
    study_name: str = field(default="sage", metadata={"help": "the study (and MLflow tag 'study')"})
    storage: str = field(
        default="sqlite:///${hydra.runtime.cwd}/multirun/optuna/${.study_name}.db",
        metadata={"help": "Optuna storage URL; a stable path, so re-running the command resumes the study"},
    )
    n_trials: int = field(default=24, metadata={"help": "finished trials wanted, those already stored count"})
    n_jobs: int = field(default=4, metadata={"help": "trials per batch handed to the launcher"})
    objectives: list[str] = field(
        default_factory=lambda: ["trained/arith_heldout/pass@1", "trained/arith_heldout/pass@64"],
        metadata={"help": "names in the metrics dict the task function returns"},
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
    prune_on: str | None = field(
        default=None,
        metadata={
            "help": "periodic metric each trial reports to the pruner every eval.every_steps, e.g. "
            "eval/periodic/arith_heldout/pass@1 (single objective only); None: no pruning"
        },
    )
    max_retries: int = field(default=1, metadata={"help": "re-runs of a failed trial's params"})
    max_failures: int = field(default=8, metadata={"help": "failed trials in one invocation before stopping"})
    sampler: Any = MISSING
    pruner: Any = MISSING


def register_sweeps(cs: ConfigStore) -> None:
    """``sweeps/<name>.yaml`` -> ``sweep=<name>``; an unreadable file is reported, not fatal to other runs."""
    try:
        import sweeps
    except ImportError:  # sage not installed: there are no project sweeps to offer
        return
    for folder in sweeps.__path__:
        for path in sorted(Path(folder).glob("*.yaml")):
            try:
                node = OmegaConf.load(path)
            except Exception as e:
                print(f"[sage_optuna_sweeper] skipping {path}: {e}", file=sys.stderr)
                continue
            cs.store(group="sweep", name=path.stem, node=node, package="hydra.sweeper", provider="sage")


cs = ConfigStore.instance()
# Stored at the root package (its content is ``hydra.sweeper``) so that its ``sweep`` entry has the override
# key ``sweep`` (under package hydra.sweeper it would be ``sweep@hydra.sweeper.sweep``). ``_self_`` first:
# the chosen sampler, pruner and sweep file are merged over the schema's defaults.
cs.store(
    group="hydra/sweeper",
    name="optuna",
    node={
        "defaults": [
            "_self_",
            {"/hydra/sweeper/sampler@hydra.sweeper.sampler": "tpe"},
            {"/hydra/sweeper/pruner@hydra.sweeper.pruner": "nop"},
            {"/sweep": None},
        ],
        "hydra": {"sweeper": OptunaSweeperConf},
    },
    package="_global_",
    provider="sage_optuna_sweeper",
)
for _name, _node in [
    ("tpe", TPESamplerConf),
    ("random", RandomSamplerConf),
    ("grid", GridSamplerConf),
    ("nsga2", NSGAIISamplerConf),
]:
    cs.store(group="hydra/sweeper/sampler", name=_name, node=_node, package="hydra.sweeper.sampler")
for _name, _node in [
    ("nop", NopPrunerConf),
    ("median", MedianPrunerConf),
    ("hyperband", HyperbandPrunerConf),
]:
    cs.store(group="hydra/sweeper/pruner", name=_name, node=_node, package="hydra.sweeper.pruner")
register_sweeps(cs)
