"""sage's submitit launchers (``hydra/launcher=local|slurm``, options in conf/hydra/launcher/): their schemas
and hydra-submitit-launcher's ``submitit_local`` / ``submitit_slurm`` with five changes:

- A job that fails (exception, ``scancel``, SIGKILL, node failure) comes back as a FAILED ``JobReturn``
  instead of an exception that discards the other jobs' results: a grid still fails at the end (Hydra's
  basic sweeper reads every return value), but a sweeper can mark one trial failed and carry on.
- Every job runs with ``resume=auto`` unless its overrides choose ``resume``: a requeued job (SLURM
  preemption or timeout through submitit's checkpoint/requeue, ``scontrol requeue``, a node failure with
  ``--requeue``) is the same command again, and sage-train continues from the checkpoint it left.
- The local launcher runs at most ``parallelism`` jobs at a time (submitit's local executor starts them
  all at once), and the SLURM launcher asks ``sacct`` at least every ``status_poll_max_s`` seconds
  (submitit's own polling backs off to 10 minutes), so a job killed outright is reported failed promptly.
- The SLURM launcher warns at submission, a line each, about a SQLite MLflow store several jobs or nodes
  write and about a folder every job must see on a node-local filesystem (``submission_warnings``).

Registered for Hydra by hydra_plugins/sage_launchers (Hydra only instantiates plugins from that package).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
# this machine's mounts, whose filesystem types say which folders the jobs' nodes share
PROC_MOUNTS = Path("/proc/mounts")


@dataclass
class SageLocalQueueConf(LocalQueueConf):
    _target_: str = "hydra_plugins.sage_launchers.SageLocalLauncher"
    parallelism: int = field(default=2, metadata={"help": "jobs running at once (submitit would start all)"})
    setup: list[str] | None = field(default=None, metadata={"help": "shell lines run before each job"})


@dataclass
class SageSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.sage_launchers.SageSlurmLauncher"
    status_poll_max_s: int = field(
        default=30, metadata={"help": "longest wait between sacct polls (submitit's own backs off to 600 s)"}
    )


def with_resume_auto(overrides: list[str]) -> list[str]:
    """The job's overrides plus ``resume=auto``, unless they already choose ``resume``."""
    keys = {o.get_key_element() for o in OverridesParser.create().parse_overrides(overrides)}
    return overrides if "resume" in keys else [*overrides, "resume=auto"]


def submission_warnings(config, jobs: int, mounts: str | None = None) -> list[str]:
    """What makes a SLURM grid fail or corrupt its records, said before it is submitted
    (``sage.train.memory.cluster_warnings``, the plan's own warnings): the SQLite MLflow store written by
    several jobs or nodes, and the cache (``$SAGE_CACHE_DIR``, ``sage.paths.cache_dir``), the SQLite file or
    the sweep dir on a node-local filesystem. Shared is decided by the filesystem type of the folder's mount
    in this machine's /proc/mounts (nfs, lustre, gpfs, ...), not by its path: /tmp is local on most clusters
    and $HOME shared on most, but neither is a rule, and the submitting node sees the same mounts as the
    jobs' nodes on any cluster where a grid can work at all."""
    from sage.train.memory import cluster_warnings

    if mounts is None:
        mounts = PROC_MOUNTS.read_text() if PROC_MOUNTS.is_file() else ""
    # what the checks read: the store sage-train and sage-eval resolve (tracking.uri, else the environment)
    view = OmegaConf.create(
        {
            "tracking": {"uri": OmegaConf.select(config, "tracking.uri")},
            "hydra": {"sweep": {"dir": str(config.hydra.sweep.dir)}},
        }
    )
    return cluster_warnings(view, config.hydra.launcher, jobs, mounts)


def failed_return(job, job_num: int, overrides: list[str], error: Exception) -> JobReturn:
    """A FAILED JobReturn whose ``return_value`` raises a one-line error naming the job."""
    ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    ret.return_value = RuntimeError(
        f"job #{job_num} (submitit id {job.job_id}) failed: {str(error).strip().splitlines()[0]}"
    )
    return ret


class _SageSubmitit:
    """Mixin over hydra-submitit-launcher's BaseSubmititLauncher (see the module docstring)."""

    # Keys of our own that submitit's executors do not know; popped before the base class sees them.
    OWN_KEYS: tuple[str, ...] = ()

    def __init__(self, **params: Any) -> None:
        own = {k: params.pop(k) for k in self.OWN_KEYS}
        super().__init__(**params)  # type: ignore[call-arg]
        self.own = own

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """One task of a job. With several tasks (``hydra.launcher.tasks_per_node``, ``nodes``), each is one
        process of a multi-process run: torch's distributed environment (rank, world size, rank 0's host
        and a port) is exported from SLURM's before the job starts, as torchrun would set it. GPUs are not
        re-mapped: with ``gpus_per_node`` every task sees the node's GPUs and takes the one of its local
        rank (accelerate does)."""
        import submitit

        if submitit.JobEnvironment().num_tasks > 1:
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        return super().__call__(*args, **kwargs)  # type: ignore[misc]

    def _job_params(self, job_overrides, initial_job_idx: int, parent_id: str | None = None) -> list[tuple]:
        from sage.grid import name_keys, with_grid

        keys = name_keys(job_overrides)
        params = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            overrides = with_grid(with_resume_auto(list(overrides)), keys, parent_id)
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
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

    def _start(self, job_overrides, initial_job_idx: int) -> tuple[Any, list[tuple]]:
        """Make the sweep dir and the grid's MLflow parent run (``sage.grid``; not when a sweeper that
        owns one, Optuna's, launches); submitit's executor and each job's call arguments."""
        from sage.grid import compared, grid_jobs, grid_key, open_parent, sets

        sweep_dir = Path(str(self.config.hydra.sweep.dir))  # type: ignore[attr-defined]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_dir = sweep_dir
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")  # type: ignore[attr-defined]
        self.parent_id = None
        tracking = self.config.get("tracking")  # type: ignore[attr-defined]
        if tracking is not None and not any(sets(o, "tracking.parent_run_id") for o in job_overrides):
            # named by what the grid compares, so the MLflow UI lists grids by content, not by time
            name = compared(grid_jobs(sweep_dir, job_overrides)) or f"grid-{sweep_dir.name}"
            self.parent_id = open_parent(tracking, grid_key(sweep_dir), name=name)
        return self._executor(), self._job_params(job_overrides, initial_job_idx, self.parent_id)

    def _finish(self, results: list[JobReturn]) -> list[JobReturn]:
        """The grid's parent run gets sage-report's output over its runs (also in the sweep dir's report/),
        the grid prints its differences and where the report is, and the parent ends."""
        from sage.grid import close_parent

        if self.parent_id is not None:
            ok = all(r.status == JobStatus.COMPLETED for r in results)
            close_parent(self.config.tracking, self.parent_id, ok, self.sweep_dir)  # type: ignore[attr-defined]
        return results

    @staticmethod
    def _result(job, job_num: int, overrides: list[str]) -> JobReturn:
        try:
            return job.results()[0]
        except Exception as e:  # a failed or killed job: report it, keep the other jobs' results
            log.error("job #%d (%s %s) failed: %s", job_num, job.job_id, " ".join(overrides), str(e)[-2000:])
            return failed_return(job, job_num, overrides, e)

    def _collect(self, jobs: dict[int, Any], params: list[tuple], results: dict[int, JobReturn], force: bool):
        """Move the finished ones of ``jobs`` (index -> submitit job) into ``results``. ``force``: the first
        check asks the scheduler now (one call covers every job submitit watches), the others read that."""
        for i, job in list(jobs.items()):
            if job.done(force_check=force):
                results[i] = self._result(job, params[i][2], params[i][0])
                del jobs[i]
            force = False


class SageLocalLauncher(_SageSubmitit, LocalLauncher):
    OWN_KEYS = ("parallelism",)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        executor, params = self._start(job_overrides, initial_job_idx)
        width = max(1, int(self.own["parallelism"]))
        running: dict[int, Any] = {}
        results: dict[int, JobReturn] = {}
        pending = list(range(len(params)))
        while pending or running:
            while pending and len(running) < width:
                i = pending.pop(0)
                running[i] = executor.submit(self, *params[i])
            self._collect(running, params, results, force=False)
            time.sleep(0.5)
        return self._finish([results[i] for i in range(len(params))])


class SageSlurmLauncher(_SageSubmitit, SlurmLauncher):
    OWN_KEYS = ("status_poll_max_s",)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        for line in submission_warnings(self.config, len(job_overrides)):  # before anything is submitted
            log.warning(line)
        executor, params = self._start(job_overrides, initial_job_idx)
        running = dict(enumerate(executor.map_array(self, *zip(*params, strict=True))))
        results: dict[int, JobReturn] = {}
        poll_s, polled = float(self.own["status_poll_max_s"]), time.monotonic()
        while running:
            force = time.monotonic() - polled >= poll_s
            polled = time.monotonic() if force else polled
            self._collect(running, params, results, force)
            time.sleep(1)
        return self._finish([results[i] for i in range(len(params))])
