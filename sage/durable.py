"""Durable files: how sage writes a file or folder that other processes (or a later run) read, and how
those processes take turns. One home for it, so that each rule is written once:

- **Whole or not at all.** ``write_atomically`` (a file), ``publish`` (a folder: fsynced, then one rename),
  ``build_once`` (a folder built by one process however many ask, by a rename onto its name);
  ``MainDecision`` tells a multi-process run's other processes what its main one decided, in such a file.
- **Locks.** ``folder_lock`` (the one builder of a folder; those who wait say on whom), ``writer_lock``
  (the one writer of a run folder, ``LOCK_FILE``), ``reading`` / ``no_readers`` (``sage-eval`` reading a
  checkpoint folder against its move), ``exclusive_lock`` (opening an MLflow SQLite store). A lock is
  released when its holder dies; the lock files that name their holder are read by ``lock_holder`` and
  ``holder``, and ``active_writer`` says whether a folder's writer is at work now.
- **Digests.** ``file_digest`` (memoised per file version: a checkpoint is hashed once) and
  ``cell_file_digest`` (an evaluation cell's file, read afresh each time).
"""

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

LOCK_FILE = ".writer.lock"  # a run folder's writer lock (``writer_lock``)


# ---------------------------------------------------------------- whole or not at all
def write_atomically(path: Path, text: str) -> None:
    """Written whole or not at all: a process waiting for the file never reads half of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fsync_tree(folder: Path) -> None:
    """Every file under ``folder`` and every folder, flushed to the disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """``tmp`` (complete) becomes ``final`` by one rename after its contents are on the disk: a crash
    leaves ``final`` absent or whole, never a folder whose files the disk had not yet written."""
    fsync_tree(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


# ---------------------------------------------------------------- digests
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


def cell_file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- one builder, the others wait
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


# ---------------------------------------------------------------- built once
def _tmp_prefix(final: Path) -> str:
    return f".tmp-{final.name}-"


def _remove_stale_builds(final: Path) -> None:
    """Temporary folders of earlier builds of ``final`` whose process was killed before its ``finally``
    (SIGKILL, preemption, OOM). Called under ``final``'s lock, so no live build owns them."""
    for stale in final.parent.glob(_tmp_prefix(final) + "*"):
        log.info("removing the folder of an interrupted build: %s", stale.name)
        shutil.rmtree(stale, ignore_errors=True)


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


# ---------------------------------------------------------------- one writer of a run folder
@contextlib.contextmanager
def writer_lock(out: Path) -> Iterator[None]:
    """The one writer of ``out`` for the life of the block, in the main process of a run (the others of a
    multi-process run get the same one line when it is refused). The lock is released, and its file
    removed, when the block ends; a holder that dies releases it too (its file then stays, naming it)."""
    held, refused = None, None
    if distributed.is_main():
        try:
            held = _acquire(out)
        except ConfigError as e:
            refused = str(e)
    # The other processes would otherwise wait for the main one in their next collective until the timeout.
    refused = distributed.broadcast(refused)
    if refused is not None:
        raise ConfigError(refused)
    try:
        yield
    finally:
        if held is not None:
            (out / LOCK_FILE).unlink(missing_ok=True)  # still held: no one can take this file meanwhile
            held.close()


def _acquire(out: Path, name: str = LOCK_FILE, refusal: Callable[[str], str] | None = None):
    """An exclusive lock on ``out/name`` whose file names this process (pid, host, since when), or a
    ConfigError: ``refusal(holder)`` (default: the run writer's line)."""
    path = out / name
    while True:
        lock = open(path, "a+")  # noqa: SIM115 (held for the life of the run)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            who = holder(out, name)
            raise ConfigError(
                refusal(who)
                if refusal is not None
                else f"output_dir={out} is being written by another run ({who}); "
                "wait for it to end, or choose another output_dir"
            ) from None
        # A holder that was ending removed the file this one opened: the lock is the file now at the path.
        try:
            current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        lock.close()
    lock.seek(0)
    lock.truncate()
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}))
    lock.flush()
    return lock


def holder(out: Path, name: str = LOCK_FILE) -> str:
    """Who holds ``out``'s lock ``name`` (the writer's), as its file says. The holder writes it just after
    taking the lock, so an empty file is read again for a moment."""
    for _ in range(20):
        try:
            who = json.loads((out / name).read_text())
            since = f" since {who['since']}" if "since" in who else ""
            return f"pid {who['pid']} on host {who['host']}{since}"
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    return "a process that has not yet written its pid and host"


def active_writer(out: Path) -> str | None:
    """Who is writing ``out`` now (its writer lock is held), or None. The test takes a shared lock for an
    instant: a writer starting in that instant is refused as if this were a writer, which only a second
    driver racing the first over the same folder can meet."""
    try:
        lock = open(out / LOCK_FILE, "rb")  # noqa: SIM115 (closed below; never created here)
    except OSError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder(out)
        fcntl.flock(lock, fcntl.LOCK_UN)
    return None


# ---------------------------------------------------------------- readers of a checkpoint folder
def _readers_lock(folder: Path) -> Path:
    """Beside the folder, not in it: a file inside would change the checkpoint's fingerprint, and the lock
    must stay with the name, which an extension gives to its new model."""
    return folder.parent / f".{folder.name}.readers.lock"


@contextlib.contextmanager
def reading(folder: Path) -> Iterator[None]:
    """``sage-eval``'s hold on a checkpoint folder for as long as it reads the weights and writes its
    results into ``<folder>/eval``: a shared lock, so that an extension of the run that moves the folder
    (``keep_earlier_final``) waits for the evaluation to end instead of leaving it without its files. Once
    the lock is held the folder must still be there: a one-line ConfigError otherwise. A folder whose parent
    takes no file (a read-only copy, which no run extends) is read without a lock, as a logged line says."""
    try:
        lock = open(_readers_lock(folder), "a+")  # noqa: SIM115 (held for the block)
    except OSError as e:
        log.info("%s is read without a lock: %s (%s)", folder, _readers_lock(folder), e.strerror or e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # an extension holds it only while it renames the folder
        if not folder.is_dir():
            raise ConfigError(
                f"checkpoint={folder} was moved as this evaluation started (an extended run keeps its "
                "earlier final model as final-step-N/ beside it): evaluate that folder"
            )
        yield


@contextlib.contextmanager
def no_readers(folder: Path) -> Iterator[None]:
    """The other side of ``reading``: held while ``folder`` moves (``sage.run_folder.keep_earlier_final``),
    once every ``sage-eval`` reading it has ended; a logged line says when it waits for one."""
    with open(_readers_lock(folder), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s is being evaluated by sage-eval: waiting for it to end before it moves", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- an MLflow store
@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on the file ``path`` (created, with its folder) for the block, waited for without a
    word: held for an instant (``sage.tracking.open_store`` creating an MLflow store's schema)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
