"""The MLflow parent runs that hold a report: a grid's or study's (``sage.grid`` opens and closes it) and the
one ``sage-report --log-to-mlflow`` logs into. Apart from both, so that the grid driver can run sage-report
and sage-report can log into a parent without either importing the other."""

from __future__ import annotations

from pathlib import Path

from sage.tracking import NOTE_TAG

SWEEP_TAG = "sage.sweep_dir"  # the parent of a grid: the sweep dir it was launched into
STUDY_TAG = "sage.optuna_study"  # the parent of an Optuna study: sage.grid.study_key's value
DRIVER_TAG = "sage.driver_started"  # when a grid's driver last opened its parent run (ms since the epoch)
REPORT_TAG = "sage.report_of"  # the parent made by sage-report --log-to-mlflow: what it reports on
PARENT_KIND = "grid"  # its sage.kind: sage-report lists it and leaves it out of every table
PARENT_NOTE = (
    "The parent run of a grid or study: its runs are nested under it. Its artifacts under report/ are "
    "sage-report's output over those runs: report.md, figures/*.png, tables/*.csv."
)


def log_report_files(client, run_id: str, markdown: Path, figures: Path, tables: Path) -> None:
    """A written report into run ``run_id``: ``report/<name>.md``, ``report/figures``, ``report/tables``."""
    client.log_artifact(run_id, str(markdown), artifact_path="report")
    for folder in (figures, tables):
        if folder.is_dir() and any(folder.iterdir()):
            client.log_artifacts(run_id, str(folder), artifact_path=f"report/{folder.name}")


def report_parent(client, experiment: str, key: str) -> str:
    """The parent run sage-report --log-to-mlflow logs into for ``key`` (experiment, filter, run ids):
    the one an earlier call made, else a new one in the first experiment named."""
    from mlflow.exceptions import MlflowException

    name = experiment.split(",")[0].strip()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        raise MlflowException(f"no experiment {name!r}")
    quote = '"' if "'" in key else "'"  # a filter such as tags.guide != 'none'
    earlier = client.search_runs(
        [exp.experiment_id], f"tags.`{REPORT_TAG}` = {quote}{key}{quote}", max_results=1
    )
    if earlier:
        return earlier[0].info.run_id
    tags = {REPORT_TAG: key, "sage.kind": PARENT_KIND, NOTE_TAG: PARENT_NOTE}
    return client.create_run(exp.experiment_id, run_name=f"report-{name}", tags=tags).info.run_id
