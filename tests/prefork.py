"""``python -m sage.train|sage.eval|analysis.report`` for the tests, forked from an interpreter that has
already imported torch, transformers, TRL, peft and MLflow.

Why: nearly every CLI test starts an entry point, and each fresh interpreter spends most of its CPU on those
imports before it reads its first argument; over the suite that is the larger part of its time. A forked
child of a pre-imported server skips them and is otherwise the run a user gets: its own process and pid,
its own environment, working directory, argv, stdout/stderr and exit code, the module run as ``__main__``
through runpy (so multiprocessing's spawned workers re-import the entry module, as they do under
``python -m``), and the interpreter's exit (non-daemon threads joined, atexit handlers run, among them
multiprocessing's finalisers; only the teardown of the modules is skipped, see :func:`_exit`).

What it cannot reproduce, so those runs start a fresh interpreter (:func:`run` decides, per call):
- a variable that a library reads when it is imported (``HF_HUB_OFFLINE``, ``OMP_NUM_THREADS``, ...)
  with another value than the server's;
- anything but the entry modules of :data:`MODULES` and the console scripts of :data:`SCRIPTS`
  (``torchrun``, ``make``, ``python -c``);
- stdin input, ``Popen``.
The README's console-script commands come here; its ``make run`` and torchrun, the signal and kill tests
(Popen) and the distributed ones start fresh interpreters.

``SAGE_TEST_PREFORK=0`` turns it off (every call starts a fresh interpreter); ``SAGE_TEST_PREFORK_LOG=<file>``
appends a line per fresh interpreter, naming the test and why.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

MODULES = ("sage.train", "sage.eval", "analysis.report", "sage.train.plan", "sage.eval.testbed_measure")
BIN = Path(sys.executable).parent
SCRIPTS = ("sage-train", "sage-eval", "sage-report")  # the console scripts, run as scripts
# Read by a library while it is imported: a request must carry the server's values, or run fresh.
IMPORT_TIME_PREFIXES = (
    "HF_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "CUDA_",
    "TOKENIZERS_",
    "PYTHON",
    "LD_",
    "ACCELERATE_",
    "DATASETS_",
    "TRL_",
    "VLLM_",
    "MPLBACKEND",
)
# Set by torch in the test session's own process, to their defaults, when it first compiles (the kernel
# tests): a run given them computes the same paths.
SET_WHEN_USED = {"TORCHINDUCTOR_CACHE_DIR"}
# What the server imports before it serves: the entry modules and what they import lazily on a run.
PRELOAD = (
    "sage.train.main",
    "sage.eval.main",
    "analysis.report",
    "sage.train.trainer",
    "sage.train.sft",
    "sage.eval.evaluate",
    "sage.grading",
    "sage.testbed.model",
    "sage.testbed.task",
    "trl",
    "peft",
    "mlflow",
    "mlflow.tracking",
    "datasets",
    "pandas",
    "math_verify",
    "matplotlib.pyplot",
)


def _send(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


# --------------------------------------------------------------------------------------------- server


def _serve(path: str) -> None:
    import gc
    import importlib
    import threading

    for name in PRELOAD:
        if name == "matplotlib.pyplot":
            import matplotlib

            matplotlib.use("Agg")
        importlib.import_module(name)
    # fork copies only the calling thread: a thread started by an import would leave its locks held in
    # every child
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        raise RuntimeError(f"prefork server: imports started threads {extra}; it cannot fork safely")
    gc.freeze()  # the children's collections leave the preloaded objects (and their pages) alone
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    server.settimeout(1.0)
    # the environment after the imports: some set variables of their own (scikit-learn's KMP_*), and the
    # test session, which imported the same libraries, carries them too
    print(json.dumps(dict(os.environ)), flush=True)
    while True:
        while True:  # reap the monitors of finished requests
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.getppid() != parent:  # the pytest worker is gone
            return
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request = _recv(conn)
        if request is None:
            conn.close()
            continue
        if os.fork() == 0:
            server.close()
            _monitor(conn, request)  # never returns in the run's child; exits in the monitor
        conn.close()


def _monitor(conn: socket.socket, request: dict) -> None:
    """In a child of the server: fork the run, tell the client its pid, wait, report its exit status."""
    pid = os.fork()
    if pid == 0:
        conn.close()
        try:
            _become_run(request)
            code = 0
        except SystemExit as stop:
            code = stop.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        _exit(code or 0)
    try:
        _send(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
    finally:
        os._exit(0)


def _exit(code: int) -> None:
    """The interpreter's exit, up to its teardown: wait for non-daemon threads, run the atexit handlers
    (multiprocessing joins its children and logging flushes there), flush stdio. The teardown of every
    module is skipped: in a fork of the server it would copy the whole inherited heap page by page, for
    nothing a run leaves behind."""
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _become_run(request: dict) -> None:
    import runpy
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    for target, name in ((1, "stdout"), (2, "stderr")):
        fd = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    if "script" in request:
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])  # what running a script puts first
        runpy.run_path(request["script"], run_name="__main__")
    else:
        sys.argv = [request["module"], *request["args"]]  # runpy sets argv[0] to the module's file
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# --------------------------------------------------------------------------------------------- client


# The environment of the test session, before any test changes it: the server's, whichever test starts it.
_SESSION_ENV = dict(os.environ)


class _Server:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="sage-prefork-")
        self.path = os.path.join(self.dir, "s")
        self.env = {**_SESSION_ENV, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.path],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"prefork server did not start (exit {self.proc.wait()})")
        self.loaded_env = json.loads(line)
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # its socket

    def differs(self, env: dict[str, str]) -> list[str]:
        """The import-time variables of ``env`` a fresh interpreter would import with other values than
        the server did (none: the server can run it)."""
        keys = {k for k in (*env, *self.env) if k.startswith(IMPORT_TIME_PREFIXES)} - SET_WHEN_USED
        return sorted(k for k in keys if env.get(k) not in (self.env.get(k), self.loaded_env.get(k)))


def call_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what the test session's own process left in its environment: an import-time variable
    the call did not set (it has the session's current value) but that differs from the session's start
    was set by a library or an in-process run of an earlier test (vLLM's engine, ``distributed.init``,
    scikit-learn's import), not by the call: the run gets the session's starting value."""
    out = dict(env)
    for k in {*env, *os.environ, *_SESSION_ENV}:
        if not k.startswith(IMPORT_TIME_PREFIXES):
            continue
        if env.get(k) == os.environ.get(k) != _SESSION_ENV.get(k):
            if k in _SESSION_ENV:
                out[k] = _SESSION_ENV[k]
            else:
                out.pop(k, None)
    return out


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None:
        _server = _Server()
    return _server


def _target_of(argv: list[str]) -> tuple[dict, list[str]] | None:
    """What the server runs for ``argv`` (a module or a console script) and its arguments; None when it
    cannot run it."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in MODULES:
        return {"module": argv[2]}, argv[3:]
    if argv and Path(argv[0]).parent == BIN and Path(argv[0]).name in SCRIPTS:
        return {"script": str(argv[0])}, argv[1:]
    return None


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    check: bool = False,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)``, through the server when it can."""
    if not (capture_output and text):
        raise ValueError("prefork.run captures text output only")
    env = dict(os.environ if env is None else env)
    target = _target_of(argv)
    forked_env = call_env(env)
    fresh = target is None or os.environ.get("SAGE_TEST_PREFORK") == "0" or _get_server().differs(forked_env)
    if fresh and os.environ.get("SAGE_TEST_PREFORK_LOG"):  # which runs start fresh, and why
        with open(os.environ["SAGE_TEST_PREFORK_LOG"], "a") as log:
            why = fresh if isinstance(fresh, list) else "not an entry point" if target is None else "off"
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}\t{why}\n")
    if fresh:
        return subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=check
        )
    what, args = target
    server = _get_server()
    with tempfile.TemporaryDirectory(prefix="sage-run-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        request = {
            **what,
            "args": args,
            "env": forked_env,
            "cwd": str(Path(cwd or os.getcwd()).resolve()),
            "stdout": out,
            "stderr": err,
        }
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(server.path)
            _send(sock, request)
            pid = _recv(sock)["pid"]
            sock.settimeout(timeout)
            timed_out = False
            try:
                reply = _recv(sock)
            except TimeoutError:
                reply, timed_out = None, True
            if reply is None:  # timed out (or the monitor died): kill the run, as subprocess.run does
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                if timed_out:
                    raise subprocess.TimeoutExpired(
                        argv, timeout, Path(out).read_text(), Path(err).read_text()
                    )
                raise RuntimeError(f"prefork: lost the run of {argv}")
        finally:
            sock.close()
        result = subprocess.CompletedProcess(
            argv,
            reply["returncode"],
            Path(out).read_text(errors="replace"),
            Path(err).read_text(errors="replace"),
        )
    if check:
        result.check_returncode()
    return result


if __name__ == "__main__":
    _serve(sys.argv[1])
