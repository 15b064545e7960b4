"""Registers sage's submitit launchers with Hydra: ``hydra/launcher=local|slurm`` (options in
conf/hydra/launcher/, implementation and schemas in launchers/submitit.py). The option files start with
``defaults: [base_sage_local]`` / ``[base_sage_slurm]``, so a misspelt key fails at composition, before
anything is submitted."""

from hydra.core.config_store import ConfigStore

from launchers.submitit import SageLocalLauncher, SageLocalQueueConf, SageSlurmLauncher, SageSlurmQueueConf

__all__ = ["SageLocalLauncher", "SageSlurmLauncher"]

ConfigStore.instance().store(
    group="hydra/launcher", name="base_sage_local", node=SageLocalQueueConf, provider="sage"
)
ConfigStore.instance().store(
    group="hydra/launcher", name="base_sage_slurm", node=SageSlurmQueueConf, provider="sage"
)
