"""What a person sees in MLflow's own UI after a small real grid: headless Chromium renders the runs page
and the parent run's artifact page served by a real `mlflow server`, and the rendered DOM is checked for
distinct run names and the grid report's figure (`make services-install` installs Debian's chromium). The grid
is logged by sage's own start_run, log_eval and parent-run code (tests/test_grid_tracking.py::log_grid), its
training left out to keep the test short."""

from __future__ import annotations

import json
import shutil
import subprocess
from urllib.parse import quote

import pytest

pytestmark = pytest.mark.integration


def rendered(url: str) -> str:
    """The DOM of ``url`` once MLflow's single-page app has fetched and drawn its data."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium not found; install it with: make services-install", pytrace=False)
    r = subprocess.run(
        # the virtual time budget lets the page's requests and rendering finish before the DOM is dumped
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=30000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_ui_shows_named_runs_and_the_grid_report(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient
    from support import log_grid  # tests/ is on sys.path (its conftest.py)

    parent_id = log_grid(mlflow_server, tmp_path, "ui-grid")
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("ui-grid").experiment_id
    parent = client.get_run(parent_id)
    figures = [f.path for f in client.list_artifacts(parent_id, "report/figures")]
    assert figures, "the grid's parent run holds no report figure"

    # the runs page lists the grid's parent run; its runs are nested under it (collapsed until expanded)
    runs_page = rendered(f"{mlflow_server}/#/experiments/{exp}/runs?workflowType=machine_learning")
    assert parent.info.run_name in runs_page, "the grid's parent run is not on the rendered runs page"
    # the compare view of the grid's runs names each of them, as its chart legends do
    children = [
        r.info.run_id for r in client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    ]
    query = f"runs={quote(json.dumps(children))}&experiments={quote(json.dumps([exp]))}"
    compare_page = rendered(f"{mlflow_server}/#/compare-runs?{query}")
    names = ["grpo-s0", "grpo-s1", "grpo_branch-s0", "grpo_branch-s1"]
    assert [n for n in names if n not in compare_page] == [], "run names missing from the compare view"
    figure = figures[0]
    artifacts_page = rendered(f"{mlflow_server}/#/experiments/{exp}/runs/{parent_id}/artifacts/{figure}")
    assert figure.rsplit("/", 1)[-1] in artifacts_page, "the report figure is not listed on the artifact page"
