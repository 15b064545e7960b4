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
