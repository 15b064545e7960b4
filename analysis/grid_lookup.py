"""Which grid ``sage-report --grid`` names: its parent run in the store (``latest``: the grid whose driver
ran last), and the line the command prints about it. The report then reads that parent's runs only."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from analysis import load
from analysis.load import ReportError
from sage.parent_runs import DRIVER_TAG, PARENT_KIND, REPORT_TAG, STUDY_TAG, SWEEP_TAG
from sage.tracking import PARENT_TAG


def find_grid(client, experiment: str, grid: str) -> tuple[object, int | None]:
    """The parent run ``--grid`` names, and for ``latest`` when its driver ran (ms; else None): ``latest``
    (``latest_grid``: the grid whose driver ran last, not an Optuna study), else the one whose run name
    (what it compared), sweep dir (absolute, or its last folder), study or run id is ``grid``. A
    ReportError listing the experiment's grids when none is."""
    names = load.experiment_names(experiment)
    ids = [e.experiment_id for e in map(client.get_experiment_by_name, names) if e is not None]
    if not ids:
        raise ReportError(f"--grid {grid}: no experiment {experiment!r} in the store")
    found = client.search_runs(
        ids, f"tags.`sage.kind` = '{PARENT_KIND}'", order_by=["attributes.start_time DESC"], max_results=5000
    )
    parents = [p for p in found if REPORT_TAG not in p.data.tags]  # not sage-report --log-to-mlflow's own
    if not parents:
        raise ReportError(f"--grid {grid}: experiment(s) {experiment!r} hold no grid (sage-train -m)")
    if grid == "latest":
        return latest_grid(client, ids, parents, experiment)

    def known_as(p) -> set[str]:
        sweep = p.data.tags.get(SWEEP_TAG, "")
        study = p.data.tags.get(STUDY_TAG, "")
        return {p.info.run_id, p.info.run_name, sweep, Path(sweep).name, study} - {""}

    match = [p for p in parents if known_as(p) & {grid, str(Path(grid).resolve())}]
    if not match:
        listed = ", ".join(repr(p.info.run_name) for p in parents[:8])
        raise ReportError(
            f"--grid {grid!r}: no grid of that name, sweep dir or run id in {experiment}; its grids, latest "
            f"first: {listed}{' ...' if len(parents) > 8 else ''} (or --grid latest)"
        )
    return match[0], None


def latest_grid(client, ids: Sequence[str], parents: Sequence, experiment: str) -> tuple[object, int]:
    """(parent run, when in ms) of the grid whose driver ran last: ``sage-train -m`` into a sweep dir (an
    Optuna study is not a grid here), at the latest time its driver opened its parent run (``DRIVER_TAG``),
    or its parent run or one of its runs started or ended. An extended grid continues the parent run its
    first launch made, so the parent's start alone would name a grid or study started in between."""
    grids = {p.info.run_id: p for p in parents if SWEEP_TAG in p.data.tags}
    if not grids:
        studies = ", ".join(repr(p.info.run_name) for p in parents[:8])
        raise ReportError(
            f"--grid latest: experiment(s) {experiment!r} hold no grid launched into a sweep dir (sage-train "
            f"-m), only Optuna studies: {studies}; name one with --grid <its name>"
        )
    last = {
        r: max(p.info.start_time or 0, p.info.end_time or 0, int(p.data.tags.get(DRIVER_TAG, 0)))
        for r, p in grids.items()
    }
    for order in ("start_time", "end_time"):  # the newest start and end of any grid's run
        token = None
        while True:
            page = client.search_runs(
                ids,
                f"tags.`{PARENT_TAG}` LIKE '%'",
                order_by=[f"attributes.{order} DESC"],
                max_results=100,
                page_token=token,
            )
            child = next(
                (c for c in page if c.data.tags.get(PARENT_TAG) in grids and getattr(c.info, order)), None
            )
            if child is not None:
                parent = child.data.tags[PARENT_TAG]
                last[parent] = max(last[parent], getattr(child.info, order))
                break
            token = page.token
            if not token:
                break
    chosen = max(last, key=lambda r: (last[r], grids[r].info.start_time or 0))
    return grids[chosen], last[chosen]


def grid_line(parent, when: int | None = None) -> str:
    """The line sage-report --grid prints: which grid it reports (name, sweep dir or study, parent run),
    and for --grid latest why that one."""
    tags = parent.data.tags
    where = f" in sweep dir {tags[SWEEP_TAG]}" if SWEEP_TAG in tags else ""
    where += f", Optuna study {tags[STUDY_TAG]}" if STUDY_TAG in tags else ""
    why = ""
    if when is not None:
        at = datetime.fromtimestamp(when / 1000, UTC)
        why = f" the grid whose driver ran last (at {at:%Y-%m-%d %H:%M:%S} UTC),"
    return f"grid:{why} {parent.info.run_name!r}{where} (parent run {parent.info.run_id}): its runs only"
