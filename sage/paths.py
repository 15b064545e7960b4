"""Where things live on disk: the config tree, the cache root, and the shared base-model evaluation cells.
How files there are written whole and locked is ``sage.durable``'s."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from sage.errors import ConfigError

# An absolute path: relative config paths resolve differently under a console script and `python -m`.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def check_output_dir(path: str | os.PathLike[str], key: str = "output_dir") -> None:
    """A folder a run can write into: an existing folder, or one that can be created, whose nearest
    existing ancestor is a folder that takes a new file (tried, not inferred from permission bits, which a
    root user or a read-only mount make misleading). A one-line ConfigError naming ``key`` otherwise;
    nothing is left behind either way."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{key}={path} is a file; give a folder (new or existing)")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={path} cannot be created: {existing} is a file")
    try:
        fd, probe = tempfile.mkstemp(prefix=".sage-write-probe-", dir=existing)
    except OSError as e:
        raise ConfigError(f"{key}={path} is not writable: {existing}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def hydra_run_dir(output_dir: str | None, default: str) -> str:
    """``hydra.run.dir`` of sage-train: ``output_dir`` when one is given (Hydra's run files, .hydra/ and
    the log, go inside it instead of a new ``outputs/<date>/<time>`` in the current folder), else
    ``default``. Hydra creates this folder before the task function runs, so an unusable ``output_dir`` is
    reported here, as the one line and exit code 2 of every config error, before Hydra's own traceback."""
    if output_dir is None:
        return default
    try:
        check_output_dir(output_dir)
    except ConfigError as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    keep_hydra_record(output_dir)
    return str(output_dir)


def sweep_job_dir(overrides, _root_) -> str:
    """``hydra.sweep.subdir`` (``job_dir``); the job folder's Hydra record is kept as ``hydra_run_dir``
    keeps a run's."""
    from sage.run_folder import job_dir

    name = job_dir(overrides)
    sweep_dir = _root_.hydra.sweep.dir if "hydra" in _root_ else None
    if sweep_dir is not None:
        keep_hydra_record(Path(str(sweep_dir)) / name)
    return name


# Hydra writes its record of a run (.hydra/config.yaml, hydra.yaml, overrides.yaml) into the run's folder
# before the task function runs. A refused command leaves the folder as it found it, so the record there
# before is read when the folder's name is resolved (before Hydra writes) and put back on a refusal
# (``restore_hydra_record``). None: the folder had no record.
_HYDRA_RECORDS: dict[Path, dict[str, bytes] | None] = {}


def keep_hydra_record(run_dir: str | os.PathLike[str]) -> None:
    """The Hydra record in ``run_dir`` as it is before this command writes it (the first look counts)."""
    record = Path(run_dir).resolve() / ".hydra"
    if record in _HYDRA_RECORDS:
        return
    files = sorted(record.iterdir()) if record.is_dir() else None
    _HYDRA_RECORDS[record] = None if files is None else {p.name: p.read_bytes() for p in files if p.is_file()}


def restore_hydra_record() -> None:
    """The current Hydra job's record as it was before this command wrote it: a refused command writes
    nothing. Only the main process of a multi-process run restores it (the others wrote the same files)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or os.environ.get("RANK", "0") != "0":
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is None:
        return
    record = (Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).resolve()
    if record not in _HYDRA_RECORDS:
        return
    before = _HYDRA_RECORDS[record]
    if before is None:
        shutil.rmtree(record, ignore_errors=True)
        return
    for p in record.iterdir() if record.is_dir() else []:
        if p.is_file() and p.name not in before:
            p.unlink()
    record.mkdir(parents=True, exist_ok=True)
    for name, data in before.items():
        (record / name).write_bytes(data)


def register_resolvers() -> None:
    """``${sage.run_dir:...}`` and ``${sage.job_dir:...}`` for the config tree (conf/train.yaml's
    hydra.run.dir and hydra.sweep.subdir)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("sage.run_dir"):
        OmegaConf.register_new_resolver("sage.run_dir", hydra_run_dir)
    if not OmegaConf.has_resolver("sage.job_dir"):
        OmegaConf.register_new_resolver("sage.job_dir", sweep_job_dir)


# Every entry point and test that composes conf/ imports this module (CONF_DIR) before Hydra resolves it.
register_resolvers()


def cache_dir() -> Path:
    """Root of everything built once per machine (testbed models, shared base evaluations)."""
    return Path(os.environ.get("SAGE_CACHE_DIR") or Path.home() / ".cache" / "sage")


def base_results_dir(model_path: str) -> Path:
    """Evaluation cells of a start model, shared by every run (and ``sage-eval``) that starts from it."""
    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "eval" / key


def content_key(config: dict) -> str:
    """A short stable hash of a JSON-able description of what a build depends on."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
