"""Where things live on disk: the config tree, the cache root, and the shared base-model evaluation cells."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from sage import distributed

log = logging.getLogger(__name__)

# An absolute path: relative config paths resolve differently under a console script and `python -m`.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


def check_output_dir(path: str | os.PathLike[str], key: str = "output_dir") -> None:
    """A folder a run can write into: an existing folder, or one that can be created, whose nearest
    existing ancestor is a folder that takes a new file (tried, not inferred from permission bits, which a
    root user or a read-only mount make misleading). A one-line ConfigError naming ``key`` otherwise;
    nothing is left behind either way."""
    from sage.config import ConfigError  # deferred: sage.config is imported after this module's users

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
    from sage.config import ConfigError

    try:
        check_output_dir(output_dir)
    except ConfigError as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return str(output_dir)


def register_resolvers() -> None:
    """``${sage.run_dir:...}`` for the config tree (conf/train.yaml's hydra.run.dir)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("sage.run_dir"):
        OmegaConf.register_new_resolver("sage.run_dir", hydra_run_dir)


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


def _tmp_prefix(final: Path) -> str:
    return f".tmp-{final.name}-"


def _remove_stale_builds(final: Path) -> None:
    """Temporary folders of earlier builds of ``final`` whose process was killed before its ``finally``
    (SIGKILL, preemption, OOM). Called under ``final``'s lock, so no live build owns them."""
    for stale in final.parent.glob(_tmp_prefix(final) + "*"):
        log.info("removing the folder of an interrupted build: %s", stale.name)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def folder_lock(final: Path) -> Iterator[None]:
    """Held by the one process that may create or replace ``final`` (a lock file beside it); the others
    wait on it. The lock is released when its holder dies."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tmp_folder_for(final: Path) -> Path:
    """A new temporary folder of this writer beside ``final``, to be renamed onto it; the folders of killed
    earlier writers are removed first (call under ``folder_lock(final)``)."""
    _remove_stale_builds(final)
    return Path(tempfile.mkdtemp(prefix=_tmp_prefix(final), dir=final.parent))


def build_once(final: Path, marker: str, build: Callable[[Path], None], collective: bool = False) -> Path:
    """``final`` built by ``build(tmp_folder)`` exactly once, however many processes ask at the same time.

    The jobs of a grid on a cold cache all ask at once: one builds while the others wait on a lock and
    then use its result, instead of each redoing the same work on shared cores. ``build`` writes ``marker``
    last; the folder appears by an atomic rename, complete or not at all, so a killed build leaves nothing
    half-written. (The lock is released when its holder dies; the rename still guards file systems where
    flock does not reach across hosts.)

    ``collective``: ``build`` is a collective step of a multi-process run (the SFT stage trains on every
    process and writes on the main one): see ``_build_collectively``.
    """
    if (final / marker).exists():
        return final
    if collective and distributed.world_size() > 1:
        return _build_collectively(final, marker, build)
    with folder_lock(final):
        if (final / marker).exists():
            log.info("built by a concurrent job: %s", final)
            return final
        tmp = tmp_folder_for(final)
        try:
            build(tmp)
            if not (tmp / marker).exists():
                raise RuntimeError(f"the build of {final} did not write {marker}")
            os.replace(tmp, final)
        except OSError:
            if not (final / marker).exists():
                raise
            log.info("a concurrent build of %s finished first; using it", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_collectively(final: Path, marker: str, build: Callable[[Path], None]) -> Path:
    """``build_once`` for a build every process of a run takes part in. The main process holds the lock
    (other jobs of a grid wait on it, as in ``build_once``) and decides whether to build; every process then
    calls ``build`` on the same temporary folder (only the main one writes there), and the main one renames
    it into place before the others go on."""
    lock, tmp = None, None
    if distributed.is_main():
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(final.parent / f".{final.name}.lock", "w")  # noqa: SIM115 (held across the collective build)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / marker).exists():
            _remove_stale_builds(final)
            tmp = tempfile.mkdtemp(prefix=_tmp_prefix(final), dir=final.parent)
    tmp = distributed.broadcast(tmp)
    try:
        if tmp is not None:
            build(Path(tmp))
            if distributed.is_main():
                if not (Path(tmp) / marker).exists():
                    raise RuntimeError(f"the build of {final} did not write {marker}")
                os.replace(tmp, final)
    finally:
        if lock is not None:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            lock.close()
        distributed.barrier()
    return final
