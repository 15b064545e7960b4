"""Where things live on disk: the config tree, the cache root, and the shared base-model evaluation cells."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sage import distributed
from sage.errors import ConfigError
from sage.progress import duration

log = logging.getLogger(__name__)

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


def _tmp_prefix(final: Path) -> str:
    return f".tmp-{final.name}-"


def _remove_stale_builds(final: Path) -> None:
    """Temporary folders of earlier builds of ``final`` whose process was killed before its ``finally``
    (SIGKILL, preemption, OOM). Called under ``final``'s lock, so no live build owns them."""
    for stale in final.parent.glob(_tmp_prefix(final) + "*"):
        log.info("removing the folder of an interrupted build: %s", stale.name)
        shutil.rmtree(stale, ignore_errors=True)


LOCK_WAIT_EVERY_S = 60.0
"""While a process waits on another's lock, a line this often says it still waits, and on whom."""


@contextlib.contextmanager
def folder_lock(final: Path, every_s: float | None = None) -> Iterator[None]:
    """Held by the one process that may create or replace ``final`` (a lock file beside it); the others
    wait on it. The lock is released when its holder dies.

    The holder writes who it is into the lock file (pid, host, since when), so that a process that finds
    the lock taken says in one line whom it waits for, and again every ``every_s`` seconds (default
    ``LOCK_WAIT_EVERY_S``) while it waits: minutes of a cold build by another job are not silence."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = final.parent / f".{final.name}.lock"
    # opened without truncating: the file holds the current holder's record, read by those who wait
    with open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(lock, path, final, LOCK_WAIT_EVERY_S if every_s is None else every_s)
        _record_holder(lock, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        try:
            yield
        finally:
            _record_holder(lock, None)  # released: the next waiter reads no stale holder


def _record_holder(lock, record: dict | None) -> None:
    """Write (or clear) the holder's record in its lock file: a courtesy to those who wait, never worth
    failing the build for (a full disk)."""
    try:
        lock.seek(0)
        lock.truncate()
        if record is not None:
            lock.write(json.dumps(record))
        lock.flush()
    except OSError:
        pass


def lock_holder(path: Path) -> str:
    """Who holds the lock file ``path``, as its holder recorded it: ``pid 123 on host h since 14:02:07 (3m10s
    ago)``; ``another process (pid unknown)`` where it has not (yet) written its record."""
    try:
        record = json.loads(path.read_text())
        since = datetime.datetime.fromtimestamp(record["since"]).strftime("%H:%M:%S")
        ago = duration(time.time() - record["since"])
        return f"pid {record['pid']} on host {record['host']} since {since} ({ago} ago)"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (pid unknown)"


def _wait_for_lock(lock, path: Path, final: Path, every_s: float) -> None:
    """Block until ``lock`` is ours, saying once whom we wait for and then every ``every_s`` seconds."""
    import threading

    start = time.monotonic()
    log.info("waiting for the lock of %s, held by %s (lock file %s)", final, lock_holder(path), path.name)
    done = threading.Event()

    def remind() -> None:
        while not done.wait(every_s):
            elapsed = duration(time.monotonic() - start)
            log.info(
                "still waiting for the lock of %s (%s so far), held by %s", final, elapsed, lock_holder(path)
            )

    reminder = threading.Thread(target=remind, name="lock-wait", daemon=True)
    reminder.start()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    finally:
        done.set()
        reminder.join()
    log.info("the lock of %s is ours after %s of waiting", final, duration(time.monotonic() - start))


def tmp_folder_for(final: Path) -> Path:
    """A new temporary folder of this writer beside ``final``, to be renamed onto it; the folders of killed
    earlier writers are removed first (call under ``folder_lock(final)``)."""
    _remove_stale_builds(final)
    return Path(tempfile.mkdtemp(prefix=_tmp_prefix(final), dir=final.parent))


def build_once(final: Path, marker: str, build: Callable[[Path], None], processes: str = "caller") -> Path:
    """``final`` built by ``build(tmp_folder)`` exactly once, however many processes ask at the same time.

    The jobs of a grid on a cold cache all ask at once: one builds while the others wait on a lock and
    then use its result, instead of each redoing the same work on shared cores. ``build`` writes ``marker``
    last; the folder appears by an atomic rename, complete or not at all, so a killed build leaves nothing
    half-written. (The lock is released when its holder dies; the rename still guards file systems where
    flock does not reach across hosts.)

    ``processes``: who calls this in a multi-process run (torchrun, several SLURM tasks).
    - ``"caller"``: only the calling process builds and waits (what a single-process run does);
    - ``"main"``: every process of the run calls it; the main process builds alone (transformers writes a
      model's weights from rank 0 only) and the others wait for it;
    - ``"all"``: every process of the run calls it and takes part in ``build`` (the SFT stage trains on
      every process and writes on the main one).
    See ``_build_in_run`` for how the others wait.
    """
    if processes not in ("caller", "main", "all"):
        raise ValueError(f"processes={processes!r}: one of caller, main, all")
    if processes != "caller" and distributed.initialized() and distributed.world_size() > 1:
        return _build_in_run(final, marker, build, collective=processes == "all")
    if (final / marker).exists():
        return final
    with folder_lock(final):
        if (final / marker).exists():
            log.info("built by a concurrent job: %s", final)
            return final
        _build_into(final, marker, build, tmp_folder_for(final))
    return final


def _build_into(final: Path, marker: str, build: Callable[[Path], None], tmp: Path) -> None:
    """``build(tmp)``, checked for its marker and renamed onto ``final`` (by the process holding
    ``final``'s lock)."""
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


def _build_in_run(final: Path, marker: str, build: Callable[[Path], None], collective: bool) -> Path:
    """``build_once`` for every process of a multi-process run: the main process takes the lock and
    decides (``MainDecision``): "ready" (built, by another job or by itself when the build is its alone),
    "build" (a collective build into a temporary folder the others join) or "failed"."""
    decision = MainDecision(final, f"{final.name} (built once, shared by the jobs of a grid)")
    if distributed.is_main():
        final.parent.mkdir(parents=True, exist_ok=True)
        with decision.telling_failures():
            with folder_lock(final):
                if (final / marker).exists():
                    log.info("built by a concurrent job: %s", final)
                else:
                    tmp = tmp_folder_for(final)
                    if collective:
                        decision.tell({"build": str(tmp)})
                    _build_into(final, marker, build, tmp)
            if not decision.told:
                decision.tell({"ready": True})
    else:
        told = decision.hear()
        if "build" in told:
            build(Path(told["build"]))
    decision.close()  # every process has its decision and the main one has renamed the build
    return final


def write_atomically(path: Path, text: str) -> None:
    """Written whole or not at all: a process waiting for the file never reads half of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class MainDecision:
    """What the main process of a multi-process run decided about ``about`` (build it, use it, sample it),
    told to the run's other processes through a file named by the run's token.

    Only the main process waits on another job's work, and it waits on the file lock; the others wait for
    this file on the file system, never inside a collective: a collective would time out
    (``trl.ddp_timeout``) while another job of the grid builds or samples for longer than that, and kill
    this job. ``close`` is the first collective after it, when no process waits on anything but this
    run's own work."""

    def __init__(self, about: Path, what: str) -> None:
        self.path = about.parent / f".{about.name}.{distributed.run_token()}.decision"
        self.what = what
        self.told = False

    def tell(self, decision: dict) -> None:
        write_atomically(self.path, json.dumps(decision))
        self.told = True

    @contextlib.contextmanager
    def telling_failures(self) -> Iterator[None]:
        """The main process's side: an error before it has told a decision is told as "failed", so that
        the others, who wait for one, stop too."""
        try:
            yield
        except BaseException as e:
            if not self.told:
                self.tell({"failed": f"{type(e).__name__}: {e}"})
            raise

    def hear(self) -> dict:
        """The other processes' side: the main process's decision, once it is written."""
        told = json.loads(distributed.wait_for_file(self.path, f"the main process's decision on {self.what}"))
        if "failed" in told:
            raise RuntimeError(f"the main process failed on {self.what}: {told['failed']}")
        return told

    def close(self) -> None:
        distributed.barrier()  # every process has read the decision: the file can go
        if distributed.is_main():
            self.path.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, memoised per (path, size, mtime) so that one process hashes a large
    checkpoint once however often it is evaluated (sage.eval.checkpoint) or converted (sage.models)."""
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
