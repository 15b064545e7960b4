"""Session-wide isolation: every run of the test session logs to a throwaway MLflow store, never to the
repository's embedded store (subprocesses inherit the variable)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_mlflow_store(tmp_path_factory):
    if os.environ.get("MLFLOW_TRACKING_URI"):
        yield
        return
    root = tmp_path_factory.mktemp("mlflow")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    yield
    del os.environ["MLFLOW_TRACKING_URI"]


# tryfirst: xdist reads the mark in its own collection hook, which must see it
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite on pytest-xdist workers (--dist loadgroup). The integration tests share one
    SLURM cluster, whose session fixture starts and stops it: two workers would each start (and stop) it under
    the other's jobs. So every integration test goes to one worker, in file order; the rest are spread."""
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.xdist_group("services"))
