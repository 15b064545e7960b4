"""Tracking helpers: no secret reaches MLflow; parallel jobs opening a fresh SQLite store all succeed."""

import subprocess
import sys

from sage.metrics import metric_name
from sage.tracking import flatten, metric_key, redact


def test_redact_and_flatten_drop_secrets():
    assert redact("postgresql+psycopg://optuna:hunter2@db:5432/x") == "postgresql+psycopg://***@db:5432/x"
    assert redact("https://host/path") == "https://host/path"
    flat = flatten({"a": {"api_key": "k", "b": [1, 2]}, "hf_token": "t", "uri": "http://u:p@h"})
    assert flat == {"a.b": "[1, 2]", "uri": "http://***@h"}
    assert metric_key("train/pass@64") == "train/pass_at_64"
    assert metric_name("trained", "math500", "pass@64") == "pass_at_64/trained/math500"  # distinct part first
    assert metric_name("periodic", "math500", "pass@1_std") == "pass_at_1_std/periodic/math500"


def test_parallel_jobs_open_a_fresh_sqlite_store(tmp_path):
    """MLflow's schema creation races when several sweep jobs start on a new store at once."""
    code = (
        "import sys; from sage.tracking import open_store; "
        f"print(open_store('sqlite:///{tmp_path}/m.db', 'exp')[1])"
    )
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=pipe, stderr=pipe, text=True) for _ in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    outs = [out.strip() for out, _ in results]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in results]
    assert len(set(outs)) == 1  # one experiment, created once
