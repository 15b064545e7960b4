"""Registers sage's Optuna 5 sweeper with Hydra: ``hydra/sweeper=optuna`` with its ``sampler`` and ``pruner``
groups (the study loop is sweeps/optuna.py, the schemas sweeps/config.py; the search spaces that select it
are conf/hparams_search/)."""

from hydra.core.config_store import ConfigStore

import sweeps.optuna
from sweeps.config import (
    GridSamplerConf,
    HyperbandPrunerConf,
    MedianPrunerConf,
    NopPrunerConf,
    NSGAIISamplerConf,
    OptunaSweeperConf,
    RandomSamplerConf,
    TPESamplerConf,
)


class SageOptunaSweeper(sweeps.optuna.SageOptunaSweeper):
    """sweeps.optuna.SageOptunaSweeper, as ``hydra/sweeper=optuna`` (Hydra instantiates only plugin classes
    defined in a hydra_plugins module)."""


cs = ConfigStore.instance()
# ``_self_`` first: the chosen sampler and pruner are merged over the schema's defaults.
cs.store(
    group="hydra/sweeper",
    name="optuna",
    node={
        "defaults": [
            "_self_",
            {"/hydra/sweeper/sampler@hydra.sweeper.sampler": "tpe"},
            {"/hydra/sweeper/pruner@hydra.sweeper.pruner": "nop"},
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
