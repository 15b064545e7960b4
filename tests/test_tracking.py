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


def test_only_the_main_process_opens_the_store_at_start(tmp_path, monkeypatch):
    """Every process of a run used to open the MLflow store at start, though only the main one records. With
    a store that cannot be opened, rank 0 fails in one line naming tracking.uri; rank 1 does not touch the
    store and goes on to join the process group (stopped here, where distributed.init would start)."""
    import pytest
    from hydra import compose, initialize_config_dir

    from sage import distributed
    from sage.config import ConfigError, register_configs
    from sage.paths import CONF_DIR
    from sage.train import main

    class JoinedGroup(Exception):
        pass

    def init(timeout_s):
        raise JoinedGroup

    corrupt = tmp_path / "m.db"
    corrupt.write_text("not a SQLite database\n" * 100)
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"tracking.uri=sqlite:///{corrupt}"])
    monkeypatch.setattr(distributed, "init", init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    unopenable = r"^tracking.uri=sqlite:///.*m.db: the MLflow store cannot be opened"
    with pytest.raises(ConfigError, match=unopenable):
        main.train(cfg)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(JoinedGroup):
        main.train(cfg)
