"""The fork study's page rebuilds without its runs or its store (issue 48): `make reproduce-fork-report` on a
copy of the committed data files (the study's snapshot, `sage-report --export`; each comparison's
per-problem counts; its wall time) and the pages it includes writes the committed tables, figures, primary
comparison and testbed.md, byte for byte but for the lines that say when and where it was assembled."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
# what reproduce-fork-report reads besides the data files: pages written by hand or by other commands
INCLUDED = ("testbed_fork_base.md", "fork_reading.md")


def assembled_lines(page: str, results: Path) -> list[str]:
    """The page without the lines naming the commit and time it was assembled at, its results folder read
    as docs/results."""
    page = page.replace(os.path.relpath(results, REPO), "docs/results").replace(str(results), "docs/results")
    return [
        line
        for line in page.splitlines()
        if not line.startswith(
            ("Provenance: experiment `testbed-fork` in `docs/results/data/", "Assembled by")
        )
    ]


@pytest.mark.slow
def test_the_fork_studys_page_rebuilds_from_the_committed_data_alone(tmp_path):
    shutil.copytree(RESULTS / "data", tmp_path / "data")
    for name in INCLUDED:
        shutil.copy(RESULTS / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'absent' / 'mlflow.db'}"  # no store is read
    r = subprocess.run(
        ["make", "--no-print-directory", "reproduce-fork-report", f"RESULTS={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "absent").exists()  # MLflow would have made the store's file on opening it
    for folder in ("tables_fork", "figures_fork"):
        names = sorted(p.name for p in (RESULTS / folder).iterdir())
        assert names == sorted(p.name for p in (tmp_path / folder).iterdir()), folder
        for name in names:
            assert (tmp_path / folder / name).read_bytes() == (RESULTS / folder / name).read_bytes(), name
    for page in ("testbed_fork_primary.md", "testbed_fork_timings.md"):
        assert assembled_lines((tmp_path / page).read_text(), tmp_path) == assembled_lines(
            (RESULTS / page).read_text(), RESULTS
        ), page
    rebuilt = assembled_lines((tmp_path / "testbed.md").read_text(), tmp_path)
    committed = assembled_lines((RESULTS / "testbed.md").read_text(), RESULTS)
    assert rebuilt == committed
    assert len(committed) == len((RESULTS / "testbed.md").read_text().splitlines()) - 2  # two lines left out
