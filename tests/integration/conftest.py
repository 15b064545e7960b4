"""Session fixtures that run the real services from scripts/*.sh.

- ``slurm_cluster``: reuses a SLURM cluster whose ``sinfo`` already answers (e.g. started by CI),
  otherwise runs ``scripts/slurm_cluster.sh start`` and stops it again at the end of the session
  (only if it started it). Yields an environment dict (``os.environ`` plus ``SLURM_CONF``) for
  subprocesses, and sets ``SLURM_CONF`` in ``os.environ`` for the session, because submitit calls
  sbatch/sacct/scancel with the inherited environment.
- ``mlflow_server``: a private MLflow server on a free port; yields the tracking URI.
- ``postgres_url``: a private PostgreSQL on a free port; yields a ``postgresql+psycopg://`` URL.

A missing binary makes the fixture FAIL (not skip) with the command that installs it: these tests
exist to prove the services work on this machine, so a silent skip would hide exactly that.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
SLURM_STATE_DIR = os.environ.get("SAGE_SLURM_STATE_DIR", "/tmp/sage-slurm")
READY_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


def _have(binary: str) -> bool:
    # Daemons live in /usr/sbin, which is not always on a non-root PATH.
    return shutil.which(binary) is not None or os.access(f"/usr/sbin/{binary}", os.X_OK)


def _require(binaries: list[str], install_cmd: str) -> None:
    missing = [b for b in binaries if not _have(b)]
    if missing:
        pytest.fail(
            f"missing {', '.join(missing)}; install with: {install_cmd}",
            pytrace=False,
        )


def _run_script(args: list[str], timeout: float) -> str:
    """Runs a launcher script, returns its stdout; fails the fixture with its stderr on error."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(args)} did not finish in {timeout} s; stderr: {e.stderr}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}",
            pytrace=False,
        )
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_state(env: dict[str, str]) -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


@pytest.fixture(scope="session")
def slurm_cluster():
    _require(
        ["sbatch", "sinfo", "sacct", "scancel", "slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd"],
        "scripts/slurm_cluster.sh install",
    )
    # An already running cluster: the caller's SLURM_CONF, else our script's default location.
    conf = os.environ.get("SLURM_CONF") or f"{SLURM_STATE_DIR}/etc/slurm.conf"
    started = False
    if not (os.path.exists(conf) and _node_state({**os.environ, "SLURM_CONF": conf}) in READY_NODE_STATES):
        out = _run_script([str(SCRIPTS / "slurm_cluster.sh"), "start", SLURM_STATE_DIR], timeout=180)
        exports = [ln for ln in out.splitlines() if ln.startswith("export SLURM_CONF=")]
        assert exports, f"slurm_cluster.sh start printed no SLURM_CONF export: {out!r}"
        conf = exports[-1].split("=", 1)[1].strip().strip("'\"")
        started = True
    env = {**os.environ, "SLURM_CONF": conf}
    state = _node_state(env)
    assert state in READY_NODE_STATES, f"SLURM node not ready (state {state!r}, SLURM_CONF={conf})"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        yield env
    if started:
        _run_script([str(SCRIPTS / "slurm_cluster.sh"), "stop", SLURM_STATE_DIR], timeout=120)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    if not (REPO / ".venv/bin/mlflow").exists() and not _have("mlflow"):
        pytest.fail("mlflow not found; install with: .venv/bin/pip install -e '.[dev]'", pytrace=False)
    state = tmp_path_factory.mktemp("mlflow-server")
    script = str(SCRIPTS / "mlflow_server.sh")
    uri = _run_script([script, "start", str(state), str(_free_port())], timeout=180).strip().splitlines()[-1]
    assert uri.startswith("http://127.0.0.1:"), uri
    try:
        yield uri
    finally:
        _run_script([script, "stop", str(state)], timeout=60)


@pytest.fixture(scope="session")
def postgres_url():
    if not glob.glob("/usr/lib/postgresql/*/bin/pg_ctl") and not _have("pg_ctl"):
        pytest.fail("PostgreSQL server not found; install with: apt-get install -y postgresql", pytrace=False)
    try:
        import psycopg  # noqa: F401  (SQLAlchemy needs it for postgresql+psycopg://)
    except ImportError:
        pytest.fail("psycopg 3 missing; install with: .venv/bin/pip install 'psycopg[binary]'", pytrace=False)
    # Not under tmp_path: pytest's base temp dir is mode 0700 (root), and the server runs as `postgres`.
    state = tempfile.mkdtemp(prefix="sage-pg-test-", dir="/tmp")
    os.chmod(state, 0o755)
    script = str(SCRIPTS / "postgres.sh")
    try:
        url = _run_script([script, "start", state, str(_free_port())], timeout=120).strip().splitlines()[-1]
        assert url.startswith("postgresql+psycopg://"), url
        yield url
    finally:
        _run_script([script, "stop", state], timeout=60)
        shutil.rmtree(state, ignore_errors=True)
