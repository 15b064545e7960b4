"""Schemas of ``hydra/launcher=local|slurm``: hydra-submitit-launcher's, plus the keys our launchers add.

The option files live in ``launchers/hydra/launcher/`` (on the search path through ``pkg://launchers``)
and start with ``defaults: [base_sage_local]`` / ``[base_sage_slurm]``, so a misspelt key fails at
composition, before anything is submitted.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf


@dataclass
class SageLocalQueueConf(LocalQueueConf):
    _target_: str = "hydra_plugins.sage_launchers.launcher.SageLocalLauncher"
    parallelism: int = field(default=2, metadata={"help": "jobs running at once (submitit would start all)"})
    setup: list[str] | None = field(default=None, metadata={"help": "shell lines run before each job"})


@dataclass
class SageSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.sage_launchers.launcher.SageSlurmLauncher"
    status_poll_max_s: int = field(
        default=30, metadata={"help": "longest wait between sacct polls (submitit's own cap: 600 s)"}
    )


ConfigStore.instance().store(
    group="hydra/launcher", name="base_sage_local", node=SageLocalQueueConf, provider="sage"
)
ConfigStore.instance().store(
    group="hydra/launcher", name="base_sage_slurm", node=SageSlurmQueueConf, provider="sage"
)
