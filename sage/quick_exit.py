"""An interrupted entry point (Ctrl-C, SIGTERM) is gone as soon as its run is closed.

``sage.config.exit_on_config_error`` closes the MLflow run KILLED, prints the one line and exits with 130
or 143; every ``finally`` of the run (its writer lock, a lock it waited on, the grading pool) has run by
then. What the interpreter's own exit then does is the teardown of every imported module: one garbage
collection over torch's, transformers' and TRL's objects, seconds on an idle machine and many times that
on a loaded one. SLURM kills a preempted job ``KillWait`` seconds (30 by default) after its SIGTERM, and a
user who typed Ctrl-C waits for the prompt. So an interrupted command does what the interpreter's exit does
up to that teardown (non-daemon threads joined, the atexit handlers run: logging's flush, multiprocessing's
finalisers, MLflow's), flushes stdio, and stops there. A run that ends any other way exits as before.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator

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
