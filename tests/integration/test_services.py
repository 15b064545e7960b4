"""Integration tests against real services (SLURM + accounting, MLflow server, PostgreSQL).

Run: .venv/bin/python -m pytest tests/integration/test_services.py -q -m integration
Every wait is bounded (a daemon thread + timeout), so a broken service fails a test instead of
hanging the session.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.integration

RESULT_TIMEOUT_S = 60


def _result_within(job, timeout: float = RESULT_TIMEOUT_S):
    """Returns ("ok", value) or ("raised", exception) from job.result(), failing after `timeout` s.

    job.result() itself has no timeout and, without accounting, never returns for a SIGKILLed job;
    a daemon thread keeps the test from hanging (and does not block interpreter exit).
    """
    box: dict = {}

    def target():
        try:
            box["out"] = ("ok", job.result())
        except BaseException as e:  # noqa: BLE001 - we report whatever result() raised
            box["out"] = ("raised", e)

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        subprocess.run(["scancel", str(job.job_id)], check=False)
        pytest.fail(f"job {job.job_id}: result() did not return within {timeout} s (state {job.state})")
    out = box["out"]
    print(f"job {job.job_id}: result() -> {out[0]} after {time.monotonic() - t0:.1f} s")
    return out


def _sacct_state(job_id: str, env: dict[str, str], final: bool = True, timeout: float = 30) -> str:
    """The job's state in accounting (allocation line only, -X); waits for a final state if asked."""
    deadline = time.monotonic() + timeout
    state = ""
    while True:
        out = subprocess.run(
            ["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"],
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
        )
        assert out.returncode == 0, f"sacct failed: {out.stderr}"
        state = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
        if not final or (state and state not in {"PENDING", "RUNNING", "REQUEUED", "COMPLETING"}):
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(1)


def _executor(tmp_path, **extra):
    import submitit

    ex = submitit.AutoExecutor(folder=tmp_path / "submitit")
    assert ex.cluster == "slurm", "sbatch is not on PATH, so submitit would not use SLURM"
    ex.update_parameters(slurm_partition="debug", timeout_min=5, cpus_per_task=1, **extra)
    return ex


def test_submitit_job_completes(slurm_cluster, tmp_path):
    def add(a, b):  # local function: cloudpickle ships it by value, the job need not import this module
        return a + b

    job = _executor(tmp_path, name="sage-it-ok").submit(add, 40, 2)
    kind, value = _result_within(job)
    assert kind == "ok", f"job raised: {value!r}"
    assert value == 42
    assert _sacct_state(job.job_id, slurm_cluster) == "COMPLETED"


def test_sigkilled_job_is_reported_failed(slurm_cluster, tmp_path):
    def die():
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    from submitit.core.utils import UncompletedJobError

    job = _executor(tmp_path, name="sage-it-kill").submit(die)
    kind, exc = _result_within(job)
    assert kind == "raised", "a SIGKILLed job must not return a result"
    assert isinstance(exc, UncompletedJobError), repr(exc)
    state = _sacct_state(job.job_id, slurm_cluster)
    assert state in {"FAILED", "OUT_OF_MEMORY", "NODE_FAIL"}, f"sacct state {state!r}"


def test_scancelled_job_is_reported_cancelled(slurm_cluster, tmp_path):
    def sleeper():
        import time

        time.sleep(600)

    from submitit.core.utils import UncompletedJobError

    job = _executor(tmp_path, name="sage-it-cancel").submit(sleeper)
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while _sacct_state(job.job_id, slurm_cluster, final=False) != "RUNNING":
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job.job_id)], env=slurm_cluster, check=False)
            pytest.fail(f"job {job.job_id} never started running")
        time.sleep(0.5)
    subprocess.run(["scancel", str(job.job_id)], env=slurm_cluster, check=True, timeout=15)
    kind, exc = _result_within(job)
    assert kind == "raised", "a cancelled job must not return a result"
    assert isinstance(exc, UncompletedJobError), repr(exc)
    state = _sacct_state(job.job_id, slurm_cluster)
    assert state.startswith("CANCELLED"), f"sacct state {state!r}"  # e.g. "CANCELLED by 0"


def test_mlflow_server_logs_and_reads_back(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    exp_id = client.create_experiment(f"sage-it-{uuid.uuid4().hex[:8]}")
    run = client.create_run(exp_id, run_name="it")
    client.log_param(run.info.run_id, "lr", "1e-4")
    for step, value in enumerate([0.25, 0.5, 0.75]):
        client.log_metric(run.info.run_id, "pass_at_1", value, step=step)
    # The artifact goes through the server's proxy (--artifacts-destination), not the local disk.
    client.log_text(run.info.run_id, "hello", "notes/hello.txt")
    client.set_terminated(run.info.run_id)

    fresh = MlflowClient(tracking_uri=mlflow_server)
    got = fresh.get_run(run.info.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["lr"] == "1e-4"
    assert got.data.metrics["pass_at_1"] == 0.75
    history = fresh.get_metric_history(run.info.run_id, "pass_at_1")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    local = fresh.download_artifacts(run.info.run_id, "notes/hello.txt", str(tmp_path))
    assert open(local).read() == "hello"


def test_optuna_study_on_postgres(postgres_url):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"sage-it-{uuid.uuid4().hex[:8]}"
    study = optuna.create_study(
        study_name=name,
        storage=postgres_url,
        direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=0),
    )
    study.optimize(lambda t: (t.suggest_float("x", -10, 10) - 2) ** 2, n_trials=3)

    loaded = optuna.load_study(study_name=name, storage=postgres_url)
    complete = loaded.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == 3
    assert loaded.best_value == min(t.value for t in complete)
    optuna.delete_study(study_name=name, storage=postgres_url)
