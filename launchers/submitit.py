"""sage's submitit launchers (``hydra/launcher=local|slurm``, options in conf/hydra/launcher/): their schemas
and hydra-submitit-launcher's ``submitit_local`` / ``submitit_slurm`` with seven changes:

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
- An SFT stage the grid's jobs need and the cache lacks runs first, as one job of its own sized to its
  batch (``sage.train.sft.sft_stages``); the jobs that start from it wait for it (SLURM: ``afterok``;
  locally: in order), and if it fails they never run and the grid ends in one line.
- The driver says how the grid goes as it goes: a line when a job starts (on SLURM, with its node) and one
  when it ends (its state, wall time and trained pass@1).

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
from hydra.experimental.callback import Callback
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import OmegaConf

from sage.train.sft import SFT_SUBDIR, SFTStage, sft_stages

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


def slurm_refusal(partition: str | None) -> str | None:
    """Why a SLURM grid cannot be submitted from here, in one line, or None: no SLURM client on PATH, a
    controller ``sinfo`` cannot reach, or a partition the cluster does not have."""
    import shutil
    import subprocess

    missing = [b for b in ("sbatch", "sinfo", "sacct") if shutil.which(b) is None]
    if missing:
        return (
            f"hydra/launcher=slurm: no SLURM client here ({', '.join(missing)} not on PATH); submit from the "
            "cluster's login node, or run the grid here with hydra/launcher=local"
        )
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "hydra/launcher=slurm: sinfo did not answer within 30 s: is the SLURM controller up?"
    if r.returncode != 0:
        said = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return f"hydra/launcher=slurm: sinfo failed ({said}): is the SLURM controller up?"
    partitions = [p.rstrip("*") for p in r.stdout.split()]
    if partition is not None and partition not in partitions:
        return (
            f"hydra.launcher.partition={partition}: this cluster has no such partition; it has "
            f"{', '.join(partitions) or 'none'}"
        )
    return None


class LauncherCheck(Callback):
    """``hydra.callbacks.launcher_ready`` (conf/train.yaml): a grid whose launcher cannot launch from here
    stops in one line (exit code 2) when the multirun starts, before a sweeper makes a study, a parent run,
    a sweep dir or its lock."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        import sys

        launcher = OmegaConf.select(config, "hydra.launcher")
        if launcher is None or not str(launcher.get("_target_", "")).endswith("SageSlurmLauncher"):
            return
        line = slurm_refusal(launcher.get("partition"))
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            sys.exit(2)


STAGE_FAILED = "the SFT stage failed: "  # an SFT job's failure as its log says it (_SageSubmitit.__call__)


def with_resume_auto(overrides: list[str]) -> list[str]:
    """The job's overrides plus ``resume=auto``, unless they already choose ``resume``."""
    keys = {o.get_key_element() for o in OverridesParser.create().parse_overrides(overrides)}
    return overrides if "resume" in keys else [*overrides, "resume=auto"]


def submission_warnings(config, jobs: int, mounts: str | None = None) -> list[str]:
    """What makes a SLURM grid fail or corrupt its records, said before it is submitted
    (``sage.train.cluster_warnings``, the plan's own warnings): the SQLite MLflow store written by
    several jobs or nodes, and the cache (``$SAGE_CACHE_DIR``, ``sage.paths.cache_dir``), the SQLite file or
    the sweep dir on a node-local filesystem. Shared is decided by the filesystem type of the folder's mount
    in this machine's /proc/mounts (nfs, lustre, gpfs, ...), not by its path: /tmp is local on most clusters
    and $HOME shared on most, but neither is a rule, and the submitting node sees the same mounts as the
    jobs' nodes on any cluster where a grid can work at all."""
    from sage.train.cluster_warnings import cluster_warnings

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


def stage_line(stage: SFTStage, job_id: str, processes: int) -> str:
    """The driver's line when it submits an SFT job."""
    size = f"{stage.processes} process(es)" + (
        f" (its batch cannot use the jobs' {processes})" if stage.processes < processes else ""
    )
    return (
        f"sft: job {job_id} builds the SFT stage of {stage.model} on {size}; "
        f"{len(stage.dependents)} job(s) start after it succeeds"
    )


def failed_line(stage: SFTStage, job_id: str, why: str, log_path: str) -> str:
    """The one line of a grid whose SFT job failed (its dependents never ran)."""
    return (
        f"the SFT job {job_id} ({stage.model}) failed: {why}; its {len(stage.dependents)} dependent job(s) "
        f"did not run (its log: {log_path})"
    )


def failed_return(job, job_num: int, overrides: list[str], error: Exception) -> JobReturn:
    """A FAILED JobReturn whose ``return_value`` raises a one-line error naming the job."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return failed(overrides, f"job #{job_num} (submitit id {job.job_id}) failed: {lines[0]}")


def failed(overrides: list[str], line: str) -> JobReturn:
    """A FAILED JobReturn whose ``return_value`` raises ``line`` as the grid's one-line end
    (``sage.hydra_errors.GridFailed``)."""
    from sage.hydra_errors import GridFailed

    ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    ret.return_value = GridFailed(line)
    return ret


def wall(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def trained_pass_at_1(ret: JobReturn) -> str:
    """``, pass@1 <dataset> <value>`` for each dataset a finished job evaluated its trained model on."""
    value = ret.return_value if ret.status == JobStatus.COMPLETED else None
    if not isinstance(value, dict):
        return ""
    prefix = "pass_at_1/trained/"
    shown = [f"{k[len(prefix) :]} {float(v):.3f}" for k, v in sorted(value.items()) if k.startswith(prefix)]
    return f", pass@1 {', '.join(shown)}" if shown else ""


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
        ret = super().__call__(*args, **kwargs)  # type: ignore[misc]
        stage = any(str(o).startswith(f"hydra.sweep.subdir={SFT_SUBDIR}/") for o in args[0])
        if stage and ret.status != JobStatus.COMPLETED:
            # Hydra returns a job's failure as a value, so the job's process would exit 0 and SLURM would
            # count the SFT job a success: its afterok dependents would start. Raised, it exits non-zero.
            raise RuntimeError(f"{STAGE_FAILED}{ret._return_value}")
        return ret

    def _job_params(self, job_overrides, initial_job_idx: int, parent_id: str | None = None) -> list[tuple]:
        from sage.grid import name_keys, with_grid

        keys = name_keys(job_overrides)
        params = []
        self.labels = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            shown = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in keys]
            self.labels.append(f"#{idx}" + (f" [{' '.join(shown)}]" if shown else ""))
            overrides = with_grid(with_resume_auto(list(overrides)), keys, parent_id)
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        return params

    def _stage_params(self, stage: SFTStage, job_num: int) -> tuple:
        """The call arguments of an SFT job (sage.train.sft.sft_stages); numbered after the grid's jobs."""
        return (stage.overrides, "hydra.sweep.dir", job_num, f"job_id_for_{job_num}", Singleton.get_state())

    def _plan_stages(self, job_overrides) -> list[SFTStage]:
        """The SFT stages the grid's jobs need and the cache lacks, each job composed as it will run."""
        from sage.train.plan import processes_per_job

        def compose(overrides: list[str]):
            return self.hydra_context.config_loader.load_sweep_config(self.config, overrides)  # type: ignore

        self.processes = processes_per_job(self.config.hydra.launcher, None)  # type: ignore[attr-defined]
        return sft_stages(compose, job_overrides, self.processes)

    def _stage_executor(self, stage: SFTStage, **changes: Any):
        """The executor of an SFT job: one node, the processes its batch can use, and as many GPUs when the
        grid's jobs ask for GPUs per node."""
        size: dict[str, Any] = {"nodes": 1, "tasks_per_node": stage.processes, **changes}
        if self.params.get("gpus_per_node"):  # type: ignore[attr-defined]
            size["gpus_per_node"] = stage.processes
        return self._executor(**size)

    def _executor(self, **changes: Any):
        """submitit's executor with the launcher's parameters (as hydra-submitit-launcher builds it), with
        ``changes`` to them (an SFT job's size, a dependency)."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        params = {**self.params, **changes}  # type: ignore[attr-defined]
        init = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params["max_num_timeout"]  # type: ignore
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)  # type: ignore[attr-defined]
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in base else f"{self._EXECUTOR}_{k}": v  # type: ignore[attr-defined]
                for k, v in params.items()
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
        self.stages = self._plan_stages(job_overrides)
        self.first_stage_num = initial_job_idx + len(job_overrides)
        self.started: dict[int, float] = {}  # job index -> when the driver saw it start
        self.params_of = self._job_params(job_overrides, initial_job_idx, self.parent_id)
        return self._executor(), self.params_of

    def _finish(self, results: list[JobReturn]) -> list[JobReturn]:
        """The grid's parent run gets sage-report's output over its runs (also in the sweep dir's report/),
        the grid prints its differences and where the report is, and the parent ends."""
        from sage.grid import close_parent

        if self.parent_id is not None:
            ok = all(r.status == JobStatus.COMPLETED for r in results)
            close_parent(self.config.tracking, self.parent_id, ok, self.sweep_dir)  # type: ignore[attr-defined]
        # submitit makes its folder pattern (.submitit/%j) literally too, and leaves it empty
        pattern = Path(str(self.params["submitit_folder"]))  # type: ignore[attr-defined]
        if "%" in pattern.name and pattern.is_dir() and not any(pattern.iterdir()):
            pattern.rmdir()
        return results

    @staticmethod
    def _result(job, job_num: int, overrides: list[str]) -> JobReturn:
        try:
            return job.results()[0]
        except Exception as e:  # a failed or killed job: report it, keep the other jobs' results
            log.error("job #%d (%s %s) failed: %s", job_num, job.job_id, " ".join(overrides), str(e)[-2000:])
            return failed_return(job, job_num, overrides, e)

    def _note_start(self, i: int, job, label: str) -> None:
        """Say once that a job has started: on SLURM when the scheduler reports it running, with its node."""
        if i in self.started:
            return
        if self._EXECUTOR == "slurm":  # type: ignore[attr-defined]
            if job.state not in ("RUNNING", "COMPLETING", "COMPLETED"):
                return
            node = job.get_info().get("NodeList")
            where = f" on {node}" if node and node != "None assigned" else ""
        else:
            where = ""
        self.started[i] = time.monotonic()
        log.info(f"{label} started{where} (submitit id {job.job_id})")

    def _ended(self, i: int, label: str, ret: JobReturn) -> None:
        """The line of a job that has ended: its state, its wall time since it started, its pass@1."""
        took = f" after {wall(time.monotonic() - self.started[i])}" if i in self.started else ""
        log.info(f"{label} {ret.status.name}{took}{trained_pass_at_1(ret)}")

    def _collect(self, jobs: dict[int, Any], params: list[tuple], results: dict[int, JobReturn], force: bool):
        """Move the finished ones of ``jobs`` (index -> submitit job) into ``results``, a line each.
        ``force``: the first check asks the scheduler now (one call covers every job submitit watches), the
        others read that."""
        for i, job in list(jobs.items()):
            done = job.done(force_check=force)
            force = False
            if not done:  # a job first seen finished gets no start line, and no wall time
                self._note_start(i, job, self.labels[i])
            else:
                results[i] = self._result(job, params[i][2], params[i][0])
                self._ended(i, self.labels[i], results[i])
                del jobs[i]

    @staticmethod
    def _stage_outcome(job) -> str | None:
        """None if the SFT job succeeded, else why it failed in one line: sage-train's own ``error:`` line
        from the job's log where it wrote one (a refusal or a failed stage), else the failure's last line."""
        try:
            ret = job.results()[0]
            if ret.status == JobStatus.COMPLETED:
                return None
            why = str(ret._return_value) if ret._return_value is not None else ret.status.name
        except Exception as e:  # killed, cancelled, or the job's process exited
            why = str(e) or type(e).__name__
        try:
            said = [ln for ln in Path(job.paths.stderr).read_text(errors="replace").splitlines() if ln]
        except OSError:
            said = []
        # the reason __call__ raised (a failure Hydra returned), else sage-train's own `error:` line
        errors = [ln.split(STAGE_FAILED, 1)[1] for ln in said if STAGE_FAILED in ln]
        errors = errors or [ln.removeprefix("error: ") for ln in said if ln.startswith("error: ")]
        lines = errors or [ln for ln in why.strip().splitlines() if ln.strip()] or ["no reason given"]
        return lines[-1].strip()[:300]

    def _watch_stages(
        self, stage_jobs: dict[int, Any], waiting: dict[int, Any], results: dict[int, JobReturn], force: bool
    ) -> None:
        """Check the running SFT jobs (index into ``self.stages`` -> submitit job). A finished one is said in
        a line; a failed one ends its dependents unrun (cancelled where submitted: ``waiting``), each a
        FAILED result carrying the one line."""
        for k, job in list(stage_jobs.items()):
            if not job.done(force_check=force):
                continue
            force = False
            del stage_jobs[k]
            stage = self.stages[k]
            why = self._stage_outcome(job)
            if why is None:
                log.info(
                    f"sft: job {job.job_id} built the SFT stage of {stage.model}; its jobs start from it"
                )
                continue
            line = failed_line(stage, job.job_id, why, str(job.paths.stderr))
            log.error(line)
            for i in stage.dependents:
                held = waiting.pop(i, None)
                if held is not None:
                    held.cancel(check=False)
                results[i] = failed(self.params_of[i][0], line)


class SageLocalLauncher(_SageSubmitit, LocalLauncher):
    OWN_KEYS = ("parallelism",)

    def launch(self, job_overrides, initial_job_idx: int) -> list[JobReturn]:
        executor, params = self._start(job_overrides, initial_job_idx)
        width = max(1, int(self.own["parallelism"]))
        results: dict[int, JobReturn] = {}
        # the SFT stages first, each one job (at most `width` at once), before any job that starts from one
        stages = list(range(len(self.stages)))
        stage_jobs: dict[int, Any] = {}
        while stages or stage_jobs:
            while stages and len(stage_jobs) < width:
                k = stages.pop(0)
                stage = self.stages[k]
                stage_jobs[k] = self._stage_executor(stage).submit(
                    self, *self._stage_params(stage, self.first_stage_num + k)
                )
                log.info(stage_line(stage, stage_jobs[k].job_id, self.processes))
            self._watch_stages(stage_jobs, {}, results, force=False)
            time.sleep(0.5)
        running: dict[int, Any] = {}
        pending = [i for i in range(len(params)) if i not in results]
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
        stage_jobs: dict[int, Any] = {}
        held = {i for stage in self.stages for i in stage.dependents}
        groups = [([i for i in range(len(params)) if i not in held], executor)]
        for k, stage in enumerate(self.stages):
            job = self._stage_executor(stage).submit(
                self, *self._stage_params(stage, self.first_stage_num + k)
            )
            stage_jobs[k] = job
            log.info(stage_line(stage, job.job_id, self.processes))
            extra = dict(self.params.get("additional_parameters") or {})  # type: ignore[attr-defined]
            # afterok: the jobs start only once the SFT job has succeeded; kill_on_invalid_dep: if it fails,
            # SLURM cancels them rather than leaving them pending for ever
            extra.update(dependency=f"afterok:{job.job_id}", kill_on_invalid_dep="yes")
            groups.append((stage.dependents, self._executor(additional_parameters=extra)))
        running: dict[int, Any] = {}
        for indexes, group_executor in groups:
            if indexes:
                jobs = group_executor.map_array(self, *zip(*(params[i] for i in indexes), strict=True))
                running.update(zip(indexes, jobs, strict=True))
        results: dict[int, JobReturn] = {}
        poll_s, polled = float(self.own["status_poll_max_s"]), time.monotonic()
        while running or stage_jobs:
            force = time.monotonic() - polled >= poll_s
            polled = time.monotonic() if force else polled
            self._watch_stages(stage_jobs, running, results, force)
            self._collect(running, params, results, force and not stage_jobs)
            time.sleep(1)
        return self._finish([results[i] for i in range(len(params))])
