"""The MLflow side of a grid (``sage-train -m``) or an Optuna study: run names and one parent run.

- ``name_keys``: the overrides whose values differ between the jobs of a grid; sage's launchers hand them
  to every job as ``tracking.name_keys``, and ``sage.tracking.run_name`` puts their values in the run name.
- ``open_parent``: the driver process (launcher or sweeper) opens the grid's parent run before it submits
  anything, and every job gets ``tracking.parent_run_id``, so its run is the parent's child
  (``mlflow.parentRunId``). A grid's parent is found by its sweep dir (tag ``sage.sweep_dir``), a study's
  by its name and storage (tag ``sage.optuna_study``: a study resumed into another sweep dir is the same
  study): rerunning the same grid or study reuses its parent and never makes a second one.
- ``close_parent``: when the grid ends, ``sage-report`` over the parent's children is logged into it as
  artifacts (``report/report.md``, ``report/figures/*.png``, ``report/tables/*.csv``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from sage.parent_runs import PARENT_KIND, PARENT_NOTE, log_report_files
from sage.tracking import NOTE_TAG, PARENT_TAG, open_store, redact, resolve_uri

log = logging.getLogger(__name__)

SWEEP_TAG = "sage.sweep_dir"  # the parent of a grid: the sweep dir it was launched into
STUDY_TAG = "sage.optuna_study"  # the parent of an Optuna study: study_key's value
# Overrides that never tell two jobs' results apart (where a job writes, logs, resumes): not in run names.
UNNAMED = ("hydra", "tracking", "callbacks", "resume", "output_dir")


def name_keys(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """The keys of the overrides whose value differs between the jobs (or that some jobs lack), in the
    order they were given: ``experiment=grpo,grpo_branch seed=1,2 rollout=fast`` -> [experiment, seed]."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    values: dict[str, list[str]] = {}
    for overrides in job_overrides:
        for o in parser.parse_overrides(list(overrides)):
            values.setdefault(o.key_or_group, []).append(o.get_value_element_as_str())
    n = len(job_overrides)
    return [
        k for k, v in values.items() if k.split(".", 1)[0] not in UNNAMED and (len(set(v)) > 1 or len(v) < n)
    ]


def sets(overrides: Sequence[str], key: str) -> bool:
    """Whether ``overrides`` set ``key`` (with or without a +/++/~ prefix)."""
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def with_grid(overrides: Sequence[str], keys: Sequence[str], parent_id: str | None) -> list[str]:
    """A job's overrides plus its grid's name keys and parent run, unless it sets them itself (the Optuna
    sweeper sets both for its trials; a user may name a run with ``tracking.run_name``)."""
    out = list(overrides)
    if keys and not sets(out, "tracking.name_keys"):
        out.append(f"tracking.name_keys=[{','.join(keys)}]")
    if parent_id and not sets(out, "tracking.parent_run_id"):
        out.append(f"tracking.parent_run_id={parent_id}")
    return out


def grid_key(sweep_dir: Path) -> tuple[str, str]:
    """(tag, value) that finds a grid's parent run: its sweep dir, absolute."""
    return SWEEP_TAG, str(Path(sweep_dir).resolve())


def study_key(study_name: str, storage: str) -> tuple[str, str]:
    """(tag, value) that finds an Optuna study's parent run: the study's name and its storage (password
    hidden), wherever its launches write."""
    return STUDY_TAG, f"{study_name} in {redact(storage)}"


def open_parent(tracking: DictConfig, key: tuple[str, str], name: str) -> str | None:
    """The id of the parent run found by ``key`` (``grid_key`` or ``study_key``): the one an earlier launch
    made (set RUNNING again), else a new one. None with ``tracking.enabled=false``."""
    if not tracking.enabled:
        return None
    uri = resolve_uri(tracking.uri)
    client, exp_id = open_store(uri, tracking.experiment)
    tag, value = key
    earlier = client.search_runs([exp_id], f"tags.`{tag}` = '{value}'", max_results=1)
    if earlier:
        run_id = earlier[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        log.info("MLflow parent run %s of %s (continued) in %s", run_id, value, redact(uri))
        return run_id
    tags = {tag: value, "sage.kind": PARENT_KIND, NOTE_TAG: PARENT_NOTE}
    run_id = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    log.info("MLflow parent run %s of %s (new) in %s", run_id, value, redact(uri))
    return run_id


def close_parent(tracking: DictConfig, run_id: str | None, ok: bool) -> None:
    """Log sage-report's output over the parent's children into it, and end it: FINISHED if every job
    succeeded, else FAILED. A report that cannot be made (no finished run yet) is said in a logged line
    and in the tag ``sage.report``; the grid's own result does not depend on it."""
    if run_id is None:
        return
    uri = resolve_uri(tracking.uri)
    client, _ = open_store(uri, tracking.experiment)
    children = f"tags.`{PARENT_TAG}` = '{run_id}'"
    problem = log_report(client, run_id, uri, tracking.experiment, children)
    client.set_tag(run_id, "sage.report", problem or "report/report.md")
    if problem:
        log.warning("sage-report over the grid's runs (parent run %s) failed: %s", run_id, problem)
    client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")


def log_report(client, run_id: str, uri: str, experiment: str, filter_string: str) -> str | None:
    """Run sage-report on ``experiment`` and ``filter_string`` into a temporary folder and log it into run
    ``run_id`` under ``report/``; the reason it failed, else None."""
    from analysis import report

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report" / "report.md"
        args = ["--tracking-uri", uri, "--experiment", experiment, "--filter", filter_string]
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            code = report.main([*args, "--out", str(out)])
        if code != 0:
            return errors.getvalue().strip().splitlines()[-1] if errors.getvalue().strip() else f"exit {code}"
        log_report_files(client, run_id, out, out.parent / "figures", out.parent / "tables")
    return None
