"""Registers sage's submitit launchers with Hydra: ``hydra/launcher=local|slurm`` (options in
conf/hydra/launcher/, implementation and schemas in launchers/submitit.py). The option files start with
``defaults: [base_sage_local]`` / ``[base_sage_slurm]``, so a misspelt key fails at composition, before
anything is submitted."""

from hydra.core.config_store import ConfigStore

import launchers.submitit

# Hydra instantiates only plugin classes defined in a hydra_plugins module, so each is named here.


class SageLocalLauncher(launchers.submitit.SageLocalLauncher):
    """launchers.submitit.SageLocalLauncher, as ``hydra/launcher=local``."""


class SageSlurmLauncher(launchers.submitit.SageSlurmLauncher):
    """launchers.submitit.SageSlurmLauncher, as ``hydra/launcher=slurm``."""


for _name, _node in [
    ("base_sage_local", launchers.submitit.SageLocalQueueConf),
    ("base_sage_slurm", launchers.submitit.SageSlurmQueueConf),
]:
    ConfigStore.instance().store(group="hydra/launcher", name=_name, node=_node, provider="sage")
