"""How sage's commands start and end: the shared set-up of the Hydra entry points (sage-train, sage-eval,
the guide diagnostics), and their exits. A ConfigError ends a command in one line and exit code 2, a full
disk in one line naming where and exit code 1, Ctrl-C and SIGTERM in one line saying what was kept and
exit codes 130 and 143.

An interrupted command is gone as soon as its run is closed: ``exit_on_config_error`` closes the MLflow run
KILLED, prints the one line and exits with 130 or 143; every ``finally`` of the run (its writer lock, a
lock it waited on, the grading pool) has run by then. What the interpreter's own exit then does is the
teardown of every imported module: one garbage collection over torch's, transformers' and TRL's objects,
seconds on an idle machine and many times that on a loaded one. SLURM kills a preempted job ``KillWait``
seconds (30 by default) after its SIGTERM, and a user who typed Ctrl-C waits for the prompt. So an
interrupted command does what the interpreter's exit does up to that teardown (non-daemon threads joined,
the atexit handlers run: logging's flush, multiprocessing's finalisers, MLflow's), flushes stdio, and stops
there (``quick_exit_when_interrupted``). A command that ends any other way exits as before.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sage.errors import NO_SPACE_TEXT, ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig


def run_command(app: Callable[[], Any], register: Callable[[], None], quoted: tuple[str, ...] = ()) -> None:
    """An entry point's ``main``: ``app`` (its ``@hydra.main`` function) over the configs in conf/, after
    ``register`` stored its schemas, with each ``<key>=<path>`` of ``quoted`` readable by Hydra as written
    (``sage.hydra_errors.quote_paths``). Composition errors are one line, and an interrupted command is gone
    once its run is closed."""
    from sage.hydra_errors import quote_paths, run_app
    from sage.paths import CONF_DIR
    from sage.reaper import reap_on_exit

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    reap_on_exit()  # a killed run's vLLM engine processes die with it
    # Registered here, not at import: the schemas mirror TRL's and peft's config classes, whose import loads
    # torch and transformers, and every process that multiprocessing spawns (the grading workers) imports
    # the entry point's module again as its __main__.
    register()
    # a grid's job folder as it prints (experiment=grpo_branch,seed=1/final) is taken as written
    sys.argv[1:] = quote_paths(sys.argv[1:], quoted)
    with quick_exit_when_interrupted():  # SIGTERM: gone once the run is closed, not after the teardown
        run_app(app, CONF_DIR)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM and ``kill`` send before a kill) raised in the main thread. A KeyboardInterrupt,
    so that everything that closes on Ctrl-C closes on it the same way: the MLflow run as KILLED, the
    grading pool, finished checkpoints and cells kept."""


def interrupted_state(rerun: str | Callable[[], str]) -> str:
    """What an interruption left, naming only what exists: the MLflow runs this process closed KILLED and
    what a rerun continues, or, before any run started (building the base model, say), that nothing was
    recorded. ``rerun``: how to continue, or a function that says what the command's folder holds and
    what a rerun does (asked only once the run is closed)."""
    from sage.killed import killed_runs

    if not killed_runs():
        return "no MLflow run had started and nothing was recorded; rerun the same command to start"
    if callable(rerun):
        try:
            return f"the MLflow run is marked KILLED; {rerun()}"
        except Exception:  # noqa: BLE001 (an interruption's last line must not become a traceback)
            rerun = "rerun the same command"
    return f"the MLflow run is marked KILLED; finished checkpoints and evaluation cells are kept ({rerun})"


def _raise_terminated(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the closing short
    raise Terminated


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# torch.save's C++ writer reports a failed write without its cause ("unexpected pos 576 vs 534").
TORCH_WRITE_FAILED = ("inline_container.cc", "PytorchStreamWriter")
FULL_BELOW_BYTES = 1 << 20


def _chain(error: BaseException) -> list[BaseException]:
    """The error and every exception it was raised from or during, without repeats."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is not None and all(e is not s for s in seen):
            seen.append(e)
            todo += [e.__cause__, e.__context__]
    return seen


def _written_folders(cfg: DictConfig) -> list[Path]:
    """Where a run writes: its output folder (or the checkpoint's eval/), the current folder (Hydra's and
    the default MLflow store), a SQLite store's folder, the cache and the temporary folder; the nearest
    existing folder of each."""
    from hydra.core.hydra_config import HydraConfig

    from sage.paths import cache_dir

    given = [cfg.get("output_dir"), cfg.get("checkpoint")]
    if HydraConfig.initialized():
        given.append(HydraConfig.get().runtime.output_dir)
    tracking = cfg.get("tracking") or {}
    uri = tracking.get("uri") or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if uri.startswith("sqlite:///"):
        given.append(str(Path(uri.removeprefix("sqlite:///")).parent))
    given += [str(Path.cwd()), str(cache_dir()), tempfile.gettempdir()]
    folders: list[Path] = []
    for g in given:
        if not g:
            continue
        folder = Path(g).absolute()
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if folder not in folders:
            folders.append(folder)
    return folders


def full_disk(error: BaseException, cfg: DictConfig) -> str | None:
    """The one line for a failure caused by a full disk (or a full quota), naming where; None for any other
    failure, whose traceback is then shown as it is."""
    chain = _chain(error)
    by_errno = [e for e in chain if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS]
    named = next((e.filename for e in by_errno if e.filename), None)
    if named is not None:
        return f"the disk is full: no space left to write {named}; free space there and rerun"
    said = by_errno or any(t in str(e) for e in chain for t in NO_SPACE_TEXT)
    if not said and not any(t in str(e) for e in chain for t in TORCH_WRITE_FAILED):
        return None
    for folder in _written_folders(cfg):
        available = shutil.disk_usage(folder).free
        if available < FULL_BELOW_BYTES:
            return (
                f"the disk is full: {folder} has {available} bytes left and a write failed; free space "
                "there and rerun"
            )
    if said:  # the space is back (the failed save's partial file was removed): name the run's own folder
        folder = _written_folders(cfg)[0]
        return (
            f"the disk is full: a write failed with no space left on device (the run writes to {folder}); "
            "free space there and rerun"
        )
    return None


def _close_progress_bars() -> None:
    """Progress bars left open would redraw themselves over a last message at exit."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def exit_on_config_error(
    fn: Any, cfg: DictConfig, *, rerun: str | Callable[[], str] = "rerun the same command"
) -> Any:
    """Run an entry point's body; a ConfigError becomes its one-line message and exit code 2; Ctrl-C one
    line and exit code 130 (the shell's for SIGINT), and SIGTERM the same with 143, after the MLflow run was
    closed KILLED; a full disk one line naming where, exit code 1. ``rerun`` says how to continue after an
    interruption (``interrupted_state``)."""
    from sage.hydra_errors import composed

    composed()  # Hydra has composed the config: the run's own failures are reported Hydra's usual way
    # SIGTERM becomes a Ctrl-C only where it still kills outright: under submitit the handler is submitit's,
    # which lets a preempted job live on to its requeue signal.
    ours = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    )
    if ours:
        signal.signal(signal.SIGTERM, _raise_terminated)
    from sage.killed import forget_killed_runs

    forget_killed_runs()  # an interruption names only this command's runs
    try:
        return fn(cfg)
    except ConfigError as e:
        from sage.paths import restore_hydra_record

        restore_hydra_record()  # a refusal leaves the folder as it was, Hydra's record of it included
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        _close_progress_bars()
        what, code = ("interrupted (Ctrl-C)", 130)
        if isinstance(e, Terminated):
            what, code = ("terminated (SIGTERM)", 143)
        print(f"{what}: {interrupted_state(rerun)}", file=sys.stderr)
        sys.exit(code)
    except Exception as e:
        line = full_disk(e, cfg)
        if line is None:
            raise
        _close_progress_bars()
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


INTERRUPTED_CODES = (130, 143)  # exit_on_config_error's for Ctrl-C and SIGTERM (the shell's 128 + signal)


@contextlib.contextmanager
def quick_exit_when_interrupted() -> Iterator[None]:
    """Around an entry point's whole body (outside Hydra and a grid's own closing): its interrupted exit
    skips the modules' teardown."""
    try:
        yield
    except SystemExit as stop:
        if stop.code not in INTERRUPTED_CODES:
            raise
        exit_now(stop.code)


def exit_now(code: int) -> None:
    """The interpreter's exit with ``code``, up to the teardown of its modules."""
    try:
        threading._shutdown()  # what the interpreter's exit does first: join the non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said on it
                pass
        os._exit(code)
