"""The MLflow side of a grid (``sage-train -m``) or an Optuna study: run names and one parent run.

- ``name_keys``: the overrides whose values differ between the jobs of a grid; sage's launchers hand them
  to every job as ``tracking.name_keys``, and ``sage.run_names.run_name`` puts their values in the run name.
- ``open_parent``: the driver process (launcher or sweeper) opens the grid's parent run before it submits
  anything, and every job gets ``tracking.parent_run_id``, so its run is the parent's child
  (``mlflow.parentRunId``). A grid's parent is found by its sweep dir (tag ``sage.sweep_dir``), a study's
  by its name and storage (tag ``sage.optuna_study``: a study resumed into another sweep dir is the same
  study): rerunning the same grid or study reuses its parent and never makes a second one.
- ``close_parent``: when the grid ends, ``sage-report`` over the parent's children is written into the
  sweep dir's ``report/`` and logged into the parent as artifacts (``report/report.md``,
  ``report/figures/*.png``, ``report/tables/*.csv``), and the grid prints its answer: the differences
  against the reference row with their intervals, one line per compared pair with the problems it lost and
  gained and where its pass@k curves cross, the report's folder and the parent run's MLflow URL.
- ``compared``: the parent run's name, what the grid compared (``experiment=grpo,grpo_branch x seed=1,2``),
  over every launch into its sweep dir (``grid_jobs``): an extended grid's parent is renamed to match.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from sage.durable import write_atomically
from sage.parent_runs import DRIVER_TAG, PARENT_KIND, PARENT_NOTE, STUDY_TAG, SWEEP_TAG, log_report_files
from sage.tracking import NOTE_TAG, PARENT_TAG, open_store, redact, resolve_uri

log = logging.getLogger(__name__)

JOBS_FILE = ".grid_jobs.json"  # in a sweep dir: the jobs of every launch into it (grid_jobs)
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


def compared(job_overrides: Sequence[Sequence[str]], limit: int = 200) -> str | None:
    """What a grid compares, as its parent run's name: each name key with its values in the order given,
    ``experiment=grpo,grpo_branch x seed=1,2``; None when the jobs do not differ (one job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = name_keys(job_overrides)
    if not keys:
        return None
    parser = OverridesParser.create()
    values: dict[str, list[str]] = {k: [] for k in keys}
    for overrides in job_overrides:
        for o in parser.parse_overrides(list(overrides)):
            value = o.get_value_element_as_str()
            if o.key_or_group in values and value not in values[o.key_or_group]:
                values[o.key_or_group].append(value)
    name = " x ".join(f"{k}={','.join(v)}" for k, v in values.items())
    return name if len(name) <= limit else name[: limit - 3] + "..."


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


def grid_jobs(sweep_dir: Path, job_overrides: Sequence[Sequence[str]]) -> list[list[str]]:
    """Every job the launches into ``sweep_dir`` asked for, in order, this launch's included: what the grid
    compares once extended (a second launch with more seeds or methods). Kept in ``JOBS_FILE`` there,
    written by the driver that holds the sweep dir (``sage.run_folder.GridWritersCheck``)."""
    path = Path(sweep_dir) / JOBS_FILE
    jobs = json.loads(path.read_text()) if path.is_file() else []
    jobs += [list(o) for o in job_overrides if list(o) not in jobs]
    write_atomically(path, json.dumps(jobs, indent=1))
    return jobs


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
    # when this driver started: sage-report --grid latest picks the grid whose driver ran last, also an
    # extension that has not started a run yet
    started = str(int(time.time() * 1000))
    if earlier:
        run_id = earlier[0].info.run_id
        # an extended grid compares more than its first launch did: the name says what it compares now
        client.update_run(run_id, status="RUNNING", name=name)
        client.set_tag(run_id, DRIVER_TAG, started)
        log.info("MLflow parent run %s of %s (continued) in %s", run_id, value, redact(uri))
        return run_id
    tags = {tag: value, "sage.kind": PARENT_KIND, NOTE_TAG: PARENT_NOTE, DRIVER_TAG: started}
    run_id = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    log.info("MLflow parent run %s of %s (new) in %s", run_id, value, redact(uri))
    return run_id


def close_parent(tracking: DictConfig, run_id: str | None, ok: bool, folder: Path | None = None) -> None:
    """Write sage-report's output over the parent's children into ``folder``/report (a temporary folder
    when None: an Optuna study has no one sweep dir), log it into the parent, print the grid's answer
    (:func:`answer`), and end the parent: FINISHED if every job succeeded, else FAILED. A report that
    cannot be made (no finished run yet) is said in the printed answer and in the tag ``sage.report``; the
    grid's own result does not depend on it."""
    if run_id is None:
        return
    uri = resolve_uri(tracking.uri)
    client, exp_id = open_store(uri, tracking.experiment)
    children = f"tags.`{PARENT_TAG}` = '{run_id}'"
    with contextlib.ExitStack() as stack:
        root = (
            Path(folder) if folder is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        out = root / "report" / "report.md"
        problem, notes = log_report(client, run_id, uri, tracking.experiment, children, out)
        client.set_tag(run_id, "sage.report", problem or "report/report.md")
        if problem:
            log.warning("sage-report over the grid's runs (parent run %s) failed: %s", run_id, problem)
        name = client.get_run(run_id).info.run_name
        where = out if folder is not None and not problem else None
        print(
            answer(
                out.read_text() if not problem else "",
                notes,
                problem,
                where,
                run_url(uri, exp_id, run_id),
                name,
            )
        )
    client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")


def log_report(
    client, run_id: str, uri: str, experiment: str, filter_string: str, out: Path
) -> tuple[str | None, list[str]]:
    """Run sage-report on ``experiment`` and ``filter_string`` into ``out`` (its figures and tables beside
    it) and log it into run ``run_id`` under ``report/``: (the reason it failed or None, its notes)."""
    from analysis import report

    args = ["--tracking-uri", uri, "--experiment", experiment, "--filter", filter_string]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        code = report.main([*args, "--out", str(out)])
    said = errors.getvalue().strip().splitlines()
    notes = [line.removeprefix("note: ") for line in said if line.startswith("note: ")]
    if code != 0:
        return (said[-1] if said else f"exit {code}"), notes
    log_report_files(client, run_id, out, out.parent / "figures", out.parent / "tables")
    return None, notes


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI: on the tracking server itself, or, for a local store, on the UI that
    ``mlflow ui --backend-store-uri <uri>`` serves at its default address."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{redact(uri).rstrip('/')}/{page}"
    return f"http://127.0.0.1:5000/{page} (mlflow ui --backend-store-uri {redact(uri)})"


def answer(
    markdown: str, notes: Sequence[str], problem: str | None, report: Path | None, url: str, name: str
) -> str:
    """What a grid prints when it ends: the report's differences against the reference row (its table,
    with intervals), or the line that says why there are none; the report's "Which problems moved" table
    (one line per compared pair and dataset); where the full report is."""
    lines = [f"grid {name!r} finished"]
    if problem:
        lines.append(f"no report: {problem}")
    else:
        table = section(markdown, "## Differences against ", exclude="## Differences against the start model")
        if table:
            lines += [
                table[0].removeprefix("## ") + " (95% t intervals; * the interval excludes 0)",
                *table[1:],
            ]
        else:
            why = [n for n in notes if n.startswith("no differences")] or [
                "the report has no differences table"
            ]
            lines += [f"no differences table: {w}" for w in why]
        moved = section(markdown, "## Which problems moved")
        if moved:
            lines += [
                moved[0].removeprefix("## ")
                + " (problems lost / gained at pass@k, mean over seed pairs [95% t interval]; the k at which "
                "the other row's pass@k curve catches up)",
                *moved[1:],
            ]
    if report is not None:
        lines.append(f"full report: {report} (figures/ and tables/ beside it)")
    lines.append(f"MLflow parent run: {url}; its artifacts under report/ hold the same report")
    return "\n".join(lines)


def section(markdown: str, heading: str, exclude: str | None = None) -> list[str]:
    """The heading line of the first section starting with ``heading`` (not ``exclude``) and its table."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(heading) and not (exclude and line.startswith(exclude)):
            table: list[str] = []
            for ln in lines[i + 1 :]:
                if ln.startswith("## "):
                    break
                if ln.startswith("|"):
                    table.append(ln)
            return [line, *table] if table else []
    return []
