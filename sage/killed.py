"""The MLflow runs this process closed KILLED (``sage.tracking.start_run`` on Ctrl-C): an interruption's one
line mentions a run only if there is one (``interrupted_state``)."""

from __future__ import annotations

_KILLED_RUNS: list[str] = []


def record_killed(run_id: str) -> None:
    _KILLED_RUNS.append(run_id)


def killed_runs() -> list[str]:
    return list(_KILLED_RUNS)


def forget_killed_runs() -> None:
    """A new command's body starts (``exit_on_config_error``): no run of its own is killed yet."""
    _KILLED_RUNS.clear()
