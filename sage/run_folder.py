"""A run folder (sage-train's ``output_dir``) holds one config, one writer and one MLflow run, and keeps its
results.

- **Identity.** The resolved config minus the keys a resume may change is recorded in ``identity.json``
  when a run starts in the folder. A run into a folder that holds anything of a run (a ``final/``, a
  checkpoint, ``config.yaml``, ``identity.json``) with another identity is one line naming the keys that
  differ, whatever ``resume`` says, before anything in the folder changes. Those keys are listed once, here:
  ``EXTENDING_KEYS`` extend a run or measure it differently (``trl.max_steps``, ``eval.*``), and
  ``NO_RESULT_KEYS`` change no number the run reports (where it logs, how often it saves, ...).
  sage-report never splits rows on the second list. A sweep job's folder is named by its overrides minus
  the second list (``job_dir``), so a grid rerun with a changed sweep gives each job its own config's folder.
- **One writer.** ``sage.durable.writer_lock`` holds an exclusive lock on ``<output_dir>/.writer.lock`` for
  the life of the run. The file names the holder (pid and host), so a second writer's one line can name it;
  it is removed when the run ends. A grid's driver holds its sweep dir the same way (``GridWritersCheck``),
  and refuses a grid whose job folder another run is writing (``held_grid_job``).
- **Nothing is deleted.** ``keep_earlier_final`` moves a ``final/`` that an extended run replaces, with
  the ``sage-eval`` results inside it, to ``final-step-N/``; it waits for a ``sage-eval`` reading that
  ``final/`` (``sage.durable.reading``: a shared lock on ``.final.readers.lock`` beside it) to end first.
"""

from __future__ import annotations

import atexit
import fnmatch
import functools
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from sage.durable import _acquire, active_writer, no_readers, write_atomically
from sage.errors import ConfigError

log = logging.getLogger(__name__)

# Keys whose value changes no number a run reports: where and how it logs, how often it checkpoints, its
# folder and resume mode. A resume may change them, sage-report does not split rows on them, and a sweep
# job's folder name leaves them out.
NO_RESULT_KEYS = (
    "output_dir",
    "resume",
    "tracking.*",
    "trl.save_*",  # save_steps, save_strategy, save_total_limit, save_only_model, save_on_each_node
    "trl.logging_*",
    "trl.log_*",  # log_level, log_completions, ...
    "trl.report_to",
    "trl.project",
    "trl.run_name",
    "trl.push_to_hub",
    "trl.hub_*",
    "trl.ddp_timeout",
    "trl.skip_memory_metrics",
    "trl.disable_tqdm",
)
# Keys that extend a run or measure it differently: a resume may change them (a longer run, another
# evaluation), but they change its reported numbers, so reports and folder names keep them.
EXTENDING_KEYS = ("trl.max_steps", "eval.*")

IDENTITY_FILE = "identity.json"
GRID_LOCK_FILE = ".grid.lock"  # held by a grid's driver in its sweep dir
CONFIG_FILE = "config.yaml"  # the resolved config of the run's latest attempt (sage.train.main)


def matches(key: str, patterns: tuple[str, ...]) -> bool:
    """``key`` (dotted) is one of ``patterns`` or lies under one (``tracking.*`` covers tracking.tags.x)."""
    return any(fnmatch.fnmatchcase(key, p) or key == p.removesuffix(".*") for p in patterns)


# ---------------------------------------------------------------- identity
def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A resolved config as {dotted key: leaf value}; lists stay one value, an empty dict is one."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def identity(cfg) -> dict[str, Any]:
    """The resolved config that defines a run folder's results: every key but those a resume may change."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    flat = _flatten(values)
    # through JSON, as the file holds it: a tuple and a list, or 1 and 1.0, are then the same value
    return json.loads(
        json.dumps({k: v for k, v in flat.items() if not matches(k, NO_RESULT_KEYS + EXTENDING_KEYS)})
    )


def recorded_identity(out: Path) -> dict[str, Any] | None:
    """The identity the folder records; a folder made before identities were recorded has its run's
    ``config.yaml``, from which it is derived. None: no run has started here."""
    if (out / IDENTITY_FILE).is_file():
        return json.loads((out / IDENTITY_FILE).read_text())
    if (out / CONFIG_FILE).is_file():
        from omegaconf import OmegaConf

        return identity(OmegaConf.load(out / CONFIG_FILE))
    return None


def run_traces(out: Path) -> list[str]:
    """What of a run ``out`` holds: a model (``final/``, ``final-step-N/``), a checkpoint, its config."""
    found = [p.name for p in sorted(out.glob("final*")) if p.is_dir() and not p.name.endswith(".partial")]
    found += [f"rl/{p.name}" for p in sorted((out / "rl").glob("checkpoint-*")) if p.is_dir()]
    found += [name for name in (CONFIG_FILE, IDENTITY_FILE) if (out / name).is_file()]
    return found


def check_identity(cfg, out: Path) -> None:
    """A run into ``out`` must have the config of the run whose traces the folder holds, whatever ``resume``
    says (a finished run without checkpoints would otherwise skip RL and report its old model under the new
    config): a ConfigError naming every key that differs otherwise, before the caller changes anything in
    the folder. A folder with a model or checkpoint but no recorded config is refused too: what it holds
    cannot be told apart from another config's run."""
    recorded = recorded_identity(out)
    if recorded is None:
        traces = run_traces(out)
        if traces:
            raise ConfigError(
                f"output_dir={out} holds a run ({', '.join(traces[:4])}) but neither {IDENTITY_FILE} nor "
                f"{CONFIG_FILE}, so its config is unknown: choose another output_dir"
            )
        return
    now = identity(cfg)
    both = sorted(k for k in recorded.keys() & now.keys() if recorded[k] != now[k])
    one_side = sorted(recorded.keys() ^ now.keys())  # what a group chosen differently adds or drops
    if not both and not one_side:
        return
    parts = [f"{k}={_show(now[k])} (the folder's: {_show(recorded[k])})" for k in both[:6]]
    if len(both) > 6:
        parts.append(f"{len(both) - 6} more")
    if one_side:
        extra = ", ".join(one_side[:6]) + (f" and {len(one_side) - 6} more" if len(one_side) > 6 else "")
        parts.append(f"keys only one of them has: {extra}")
    raise ConfigError(
        f"output_dir={out} holds a run of another config: {'; '.join(parts)}; a resume continues the same "
        "config (only trl.max_steps, eval.*, tracking.* and keys that change no result may differ): "
        "choose another output_dir"
    )


def _show(value: Any) -> str:
    return (value if isinstance(value, str) else json.dumps(value))[:60]


def record_identity(cfg, out: Path) -> None:
    """Write the folder's identity (whole or not at all)."""
    write_atomically(out / IDENTITY_FILE, json.dumps(identity(cfg), indent=1, sort_keys=True))


# ---------------------------------------------------------------- sweep job folders
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+@:-]")
_MAX_NAME = 120  # file systems allow 255 bytes; a hash keeps longer names unique


def job_dir(overrides: Any) -> str:
    """A sweep job's folder name (``hydra.sweep.subdir``): its overrides, sorted, bar ``NO_RESULT_KEYS``
    (``resume=auto`` from the launcher, tracking tags, ...). The same config keeps its folder in every rerun
    of a sweep, whatever its job number; a character a folder name should not hold becomes ``_``, and
    then, or when the name is long, a hash of the overrides is appended so that names stay distinct."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([str(o) for o in overrides])
    last = {(o.key_or_group, o.package): o for o in parsed}  # a key given twice: its last value
    kept = sorted(
        o.input_line.lstrip("+") for o in last.values() if not matches(o.key_or_group, NO_RESULT_KEYS)
    )
    name = ",".join(kept) or "default"
    safe = _UNSAFE.sub("_", name)
    if safe != name or len(safe) > _MAX_NAME:
        safe = f"{safe[:_MAX_NAME]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return safe


def safe_name(text: str) -> str:
    """``text`` as one folder name (no separators)."""
    return _UNSAFE.sub("_", text) or "_"


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def held_grid_job(config: Any) -> str | None:
    """The one line for the first job of a grid (``sage-train -m``, Hydra's basic sweeper) whose folder
    another run is writing, or None. The jobs are the sweeper's: ``hydra.sweeper.params`` then the command
    line's overrides, expanded as it expands them; each job's folder is ``hydra.sweep.dir``/``job_dir``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None  # the Optuna sweeper's trials each get a folder of their own (<study>/<trial number>)
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    given = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    try:
        parsed = OverridesParser.create().parse_overrides(given)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # noqa: BLE001 (a sweep only the sweeper can expand, glob(): its jobs' own locks guard)
        return None
    sweep_dir = Path(str(config.hydra.sweep.dir))
    for number, job in enumerate(jobs):
        named = [o.split("=", 1)[1] for o in job if o.lstrip("+").startswith("output_dir=")]
        folder = Path(named[-1]) if named else sweep_dir / job_dir(job)
        who = active_writer(folder)
        if who is not None:
            return (
                f"job #{number} ({' '.join(job)}): output_dir={folder} is being written by another run "
                f"({who}); wait for it to end, or choose another hydra.sweep.dir"
            )
    return None


class GridWritersCheck(Callback):
    """``hydra.callbacks.grid_writers`` (conf/train.yaml): before a grid submits anything, a job whose folder
    another run is writing (a second driver over a running grid's sweep dir) stops the grid with one line
    naming the holder, exit code 2. Submitted, the job would be refused by its writer lock, and a launcher
    reports a job's failure as its own (submitit's: the job's error stream and the driver's traceback).

    A grid's driver also holds its sweep dir (``.grid.lock``) until the grid ends: a second grid into the
    same sweep dir would otherwise run under the first one's MLflow parent run and name, and Hydra's
    ``multirun.yaml`` would keep only the last grid's sweep."""

    def __init__(self) -> None:
        self._driver = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        line = None
        if OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER:
            sweep_dir = Path(str(config.hydra.sweep.dir))
            made = not sweep_dir.exists()
            sweep_dir.mkdir(parents=True, exist_ok=True)
            try:
                refusal = functools.partial(_driven, sweep_dir)
                self._driver = _acquire(sweep_dir, GRID_LOCK_FILE, refusal=refusal)
                # a grid that dies before its end (a mistyped job, a launcher's failure) leaves no lock file,
                # nor the sweep dir it made if nothing else was written there
                atexit.register(_release_grid, sweep_dir, self._driver, made)
            except ConfigError as e:
                line = str(e)
        line = line or held_grid_job(config)
        if line is not None:
            # A callback's exception is only a warning to Hydra: the refusal exits here, before any launch.
            print(f"error: {line}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._driver is not None:
            (Path(str(config.hydra.sweep.dir)) / GRID_LOCK_FILE).unlink(missing_ok=True)  # still held
            self._driver.close()
            self._driver = None


def _release_grid(sweep_dir: Path, driver, made: bool) -> None:
    """At the driver's exit: its lock file removed if it still holds it, and the sweep dir it made removed
    if no job was launched into it."""
    if not driver.closed:
        (sweep_dir / GRID_LOCK_FILE).unlink(missing_ok=True)
        driver.close()
    # Hydra writes its multirun.yaml before the launcher composes a job: a grid refused there wrote no more
    if made and sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
        (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
        sweep_dir.rmdir()


def _driven(sweep_dir: Path, who: str) -> str:
    return (
        f"hydra.sweep.dir={sweep_dir} is being driven by another grid ({who}); wait for it to end, or "
        "choose another hydra.sweep.dir"
    )


def on_main(check: Callable[[], None]) -> None:
    """``check`` run by the main process alone; its ConfigError stops every process of the run with the
    same one line."""
    from sage import distributed

    refused = None
    if distributed.is_main():
        try:
            check()
        except ConfigError as e:
            refused = str(e)
    refused = distributed.broadcast(refused)
    if refused is not None:
        raise ConfigError(refused)


def keep_earlier_final(
    final: Path, step: int, retag: Callable[[dict, str], None] | None = None
) -> Path | None:
    """An extended run replaces ``final/``: the earlier one moves, whole, to ``final-step-<step>/``, so the
    ``sage-eval`` results inside it stay beside the weights they measured. Their ``results.json`` and the
    records of those evaluation runs (``mlflow_run_id.<key>.json``) are updated to the new folder, and
    ``retag(record, new path)`` points each run's ``checkpoint`` tag there. Returns the new folder (None:
    no final/)."""
    if not final.is_dir():
        return None
    name = f"final-step-{step}" if step >= 0 else "final-step-unknown"
    moved = str(final.resolve())
    aside, n = final.with_name(name), 1
    while aside.exists():  # the same step kept before (a run pruned, then extended): keep both
        n += 1
        aside = final.with_name(f"{name}.{n}")
    with no_readers(final):
        os.replace(final, aside)
    log.info("the earlier final model (step %d) and its evaluations are kept in %s", step, aside)
    eval_dir = aside / "eval"
    results = eval_dir / "results.json"
    if results.is_file():  # the model it names is the one that moved
        payload = json.loads(results.read_text())
        if payload.get("checkpoint") == moved:
            write_atomically(results, json.dumps({**payload, "checkpoint": str(aside.resolve())}, indent=1))
    for record_file in sorted(eval_dir.glob("mlflow_run_id*.json")) if eval_dir.is_dir() else []:
        record = json.loads(record_file.read_text())
        record["folder"] = str(eval_dir.resolve())
        record_file.write_text(json.dumps(record))
        if retag is not None:
            retag(record, str(aside.resolve()))
    return aside
