"""hydra-submitit-launcher's launchers (``submitit_local`` / ``submitit_slurm``) with three changes for sage:

- A job that fails (exception, ``scancel``, SIGKILL, node failure) comes back as a FAILED ``JobReturn``
  instead of an exception that discards the other jobs' results: a grid still fails at the end (Hydra's
  basic sweeper reads every return value), but a sweeper can mark one trial failed and carry on.
- A requeued job (SLURM preemption or timeout through submitit's checkpoint/requeue, ``scontrol requeue``,
  a node failure with ``--requeue``) whose output dir already holds ``rl/checkpoint-*`` runs with
  ``resume=true``: training continues from the last checkpoint and the same MLflow run (sage.tracking
  keeps the run id in the output dir).
- The local launcher runs at most ``parallelism`` jobs at a time (submitit's local executor starts them
  all at once), and the SLURM launcher polls ``sacct`` at least every ``status_poll_max_s`` seconds (submitit
  backs off to 10 minutes), so a job killed outright is reported failed promptly.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


def job_output_dir(config: DictConfig) -> Path:
    """Where sage-train writes this job: ``output_dir``, else Hydra's sweep dir / subdir."""
    if config.get("output_dir"):
        return Path(config.output_dir)
    return Path(config.hydra.sweep.dir) / str(config.hydra.sweep.subdir)


def has_checkpoint(out: Path) -> bool:
    return any((out / "rl").glob("checkpoint-*"))


class _SageSubmitit:
    """Mixin over hydra-submitit-launcher's BaseSubmititLauncher (see the module docstring)."""

    # Keys of our own that submitit's executors do not know; popped before the base class sees them.
    OWN_KEYS: tuple[str, ...] = ()

    def __init__(self, **params: Any) -> None:
        own = {k: params.pop(k) for k in self.OWN_KEYS}
        super().__init__(**params)  # type: ignore[call-arg]
        self.own = own

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        Singleton.set_state(singleton_state)
        setup_globals()
        loader = self.hydra_context.config_loader  # type: ignore[attr-defined]
        overrides = list(sweep_overrides)
        config = self._compose(loader, overrides, job_num)
        out = job_output_dir(config)
        if has_checkpoint(out) and not config.get("resume", False):
            log.warning("requeued job %d: %s holds a checkpoint, continuing with resume=true", job_num, out)
            overrides = [o for o in overrides if not o.lstrip("+").startswith("resume=")] + ["resume=true"]
            config = self._compose(loader, overrides, job_num)
        return run_job(
            hydra_context=self.hydra_context,  # type: ignore[attr-defined]
            task_function=self.task_function,  # type: ignore[attr-defined]
            config=config,
            job_dir_key=job_dir_key,
            job_subdir_key="hydra.sweep.subdir",
        )

    def _compose(self, loader: Any, overrides: list[str], job_num: int) -> DictConfig:
        import submitit

        config = loader.load_sweep_config(self.config, overrides)  # type: ignore[attr-defined]
        with open_dict(config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            job.num = job_num
        # so that ${hydra:...} in the sweep subdir resolves (set_config makes its argument read-only)
        HydraConfig.instance().set_config(copy.deepcopy(config))
        return config

    def _job_params(self, job_overrides, initial_job_idx: int) -> list[tuple]:
        params = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append(
                (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            )
        return params

    def _executor(self):
        """submitit's executor with the launcher's parameters (as hydra-submitit-launcher builds it)."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        init = {"folder": self.params["submitit_folder"]}  # type: ignore[attr-defined]
        if "max_num_timeout" in self.params:  # type: ignore[attr-defined]
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]  # type: ignore
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)  # type: ignore[attr-defined]
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in base else f"{self._EXECUTOR}_{k}": v  # type: ignore[attr-defined]
                for k, v in self.params.items()  # type: ignore[attr-defined]
                if k not in {"submitit_folder", "max_num_timeout"}
            }
        )
        return executor

    def _prepare_sweep_dir(self) -> None:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))  # type: ignore[attr-defined]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")  # type: ignore[attr-defined]

    @staticmethod
    def _result(job, job_num: int, overrides: list[str]) -> JobReturn:
        try:
            return job.results()[0]
        except Exception as e:  # a failed or killed job: report it, keep the other jobs' results
            log.error("job #%d (%s %s) failed: %s", job_num, job.job_id, " ".join(overrides), str(e)[-2000:])
            ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
            ret._return_value = RuntimeError(
                f"job #{job_num} (submitit id {job.job_id}) failed: {str(e).strip().splitlines()[0]}"
            )
            ret.hydra_cfg = None
            return ret


class SageLocalLauncher(_SageSubmitit, LocalLauncher):
    OWN_KEYS = ("parallelism",)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        self._prepare_sweep_dir()
        executor = self._executor()
        params = self._job_params(job_overrides, initial_job_idx)
        width = max(1, int(self.own["parallelism"]))
        running: dict[int, Any] = {}
        results: dict[int, JobReturn] = {}
        pending = list(range(len(params)))
        while pending or running:
            while pending and len(running) < width:
                i = pending.pop(0)
                running[i] = executor.submit(self, *params[i])
            for i, job in list(running.items()):
                if job.done():
                    results[i] = self._result(job, params[i][2], params[i][0])
                    del running[i]
            time.sleep(0.5)
        return [results[i] for i in range(len(params))]


class SageSlurmLauncher(_SageSubmitit, SlurmLauncher):
    OWN_KEYS = ("status_poll_max_s",)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        from submitit.slurm.slurm import SlurmJob

        # submitit's sacct watcher backs off up to 600 s; a killed job is only seen at the next poll.
        SlurmJob.watcher._delay_s = int(self.own["status_poll_max_s"])
        self._prepare_sweep_dir()
        executor = self._executor()
        params = self._job_params(job_overrides, initial_job_idx)
        jobs = executor.map_array(self, *zip(*params, strict=True))
        return [self._result(job, p[2], p[0]) for job, p in zip(jobs, params, strict=True)]
