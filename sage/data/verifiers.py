"""The verifiable reward: Math-Verify equivalence of the completion's final answer with the gold answer.

Grading runs sympy on model output, which is adversarial input: it can be malformed, huge, or a LaTeX
"bomb" whose simplification never ends. So every entry point here returns a score and never raises,
answers longer than ``MAX_ANSWER_CHARS`` are refused before sympy sees them, and each call is bounded in
time: in the main thread by a SIGALRM deadline, across many calls by :class:`GradingPool`, whose worker
processes are killed and replaced when they hang in code that signals cannot interrupt.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import re
import resource
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from sage.data.prompts import SOLUTION_END, SOLUTION_START

MAX_ANSWER_CHARS = 1000
GRADE_TIMEOUT_S = 5.0

# Both sides are wrapped in \boxed{} before parsing, so the boxed content is the only thing to extract:
# bare gold LaTeX such as `3\sqrt{13}` would otherwise be read by the "find a number" heuristics as `3`.
_BOXED_LATEX = LatexExtractionConfig(boxed_match_priority=0)
_GOLD_CONFIG = (_BOXED_LATEX,)
# A model may also write a plain expression such as `1/2` or `2**10`; Expr extraction is the fallback.
_PRED_CONFIG = (_BOXED_LATEX, ExprExtractionConfig())

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")


class _DropTimeoutDisabledWarning(logging.Filter):
    """Math-Verify warns once that its own timeouts are off; they are off on purpose (see `_deadline`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


class _GradeTimeout(BaseException):
    """A BaseException, so that the `except Exception` clauses inside sympy and Math-Verify cannot swallow
    the deadline and keep computing."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise `_GradeTimeout` in the block after `seconds` of wall time.

    Math-Verify's own timeouts use `signal.alarm` per parse/compare step (whole seconds, several steps per
    call, and a ValueError outside the main thread), so we disable them and put one sub-second deadline
    around the whole call instead. Signals only reach the main thread: elsewhere the block runs unbounded,
    which is why bulk grading goes through `GradingPool` (each worker grades in its main thread).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise _GradeTimeout

    previous = signal.signal(signal.SIGALRM, _raise)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        # Separate finally: if the alarm fires just before it is disarmed, the handler is still restored.
        signal.signal(signal.SIGALRM, previous)


def _brace_depths(text: str, start: int, depth: int) -> Iterator[tuple[int, int]]:
    """(index, depth after it) of each unescaped brace of ``text[start:]``, counting from ``depth``;
    ``\\{`` and ``\\}`` are literal braces and do not count."""
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char in "{}":
            depth += 1 if char == "{" else -1
            yield i, depth
        i += 1


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces (`\\{` does not count), or
    None when there is none or the last one is unclosed (a truncated generation has no final answer)."""
    openers = list(_BOX_OPENER.finditer(text))
    if not openers:
        return None
    start = openers[-1].end()
    for i, depth in _brace_depths(text, start, 1):
        if depth == 0:
            return text[start:i]
    return None


def balanced_braces(text: str) -> bool:
    """Whether the unescaped braces of `text` pair up (``\\{`` and ``\\}`` are literal set braces). An
    unbalanced answer is malformed LaTeX: Math-Verify would still recover ``\\frac{14}{3}`` from
    ``{{{\\frac{14}{3}`` and score it, but a malformed answer scores 0."""
    depth = 0
    for _, depth in _brace_depths(text, 0, 0):
        if depth < 0:
            return False
    return depth == 0


def extract_answer(completion: str) -> str | None:
    """The final answer: text between the last `<SOLUTION>` and the next `</SOLUTION>`, else (no solution
    tag at all) the last `\\boxed{}`. An unclosed last `<SOLUTION>` gives None rather than falling back to a
    `\\boxed{}` in the working: the model used the format and was cut off before answering."""
    start = completion.rfind(SOLUTION_START)
    if start < 0:
        return last_boxed_content(completion)
    start += len(SOLUTION_START)
    end = completion.find(SOLUTION_END, start)
    return completion[start:end].strip() if end >= 0 else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    """Cached because the evaluator grades hundreds of samples against the same gold answer."""
    return parse(f"\\boxed{{{gold}}}", extraction_config=_GOLD_CONFIG, parsing_timeout=None)


def math_equivalent(answer: str, gold: str) -> bool:
    """Math-Verify equivalence of two answers, both parsed as the content of a \\boxed{}."""
    predicted = parse(f"\\boxed{{{answer}}}", extraction_config=_PRED_CONFIG, parsing_timeout=None)
    return bool(verify(_parse_gold(gold), predicted, timeout_seconds=None))


_KK_STATEMENT = r"\b{name}\s+is\s+an?\s+(knight|knave)\b"
_KK_GOLD_LINE = re.compile(
    r"^\s*(?:\(\d+\)\s*)?(?P<name>\S(?:.*\S)?)\s+is\s+an?\s+(?P<role>knight|knave)\s*\.?\s*$", re.IGNORECASE
)


def knights_knaves_assignment(gold: str) -> dict[str, str]:
    """{name: "knight" | "knave"} of a Knights-and-Knaves solution in the dataset's format, one person per
    line: "(1) Zoey is a knave\\n(2) Oliver is a knight". Raises ValueError naming a line it cannot read."""
    assignment = {}
    for line in gold.strip().splitlines():
        match = _KK_GOLD_LINE.match(line)
        if match is None:
            raise ValueError(f"knights_knaves gold line {line!r} is not '(i) <name> is a knight|knave'")
        assignment[match["name"]] = match["role"].lower()
    if not assignment:
        raise ValueError("knights_knaves gold answer is empty")
    return assignment


def knights_knaves_equivalent(answer: str, gold: str) -> bool:
    """True when the answer assigns every person of the gold solution their role and no other.

    The rule of the K&K graders (Logic-RL's ``parse_model_answer``): for each gold name, the answer must
    state "<name> is a knight|knave"; an answer that states both roles for someone (hedging) is wrong, and
    so is one that leaves anyone out. Case and extra wording around the statements do not matter."""
    for name, role in knights_knaves_assignment(gold).items():
        pattern = _KK_STATEMENT.format(name=re.escape(name))
        stated = {m.lower() for m in re.findall(pattern, answer, flags=re.IGNORECASE)}
        if stated != {role}:
            return False
    return True


VERIFIERS: dict[str, Callable[[str, str], bool]] = {
    "math": math_equivalent,
    "knights_knaves": knights_knaves_equivalent,
}
"""How a row's answer is checked, by the name in its optional ``verifier`` field (default "math"): the
benchmark loader sets it (sage.data.benchmarks), so a dataset is always graded by the rule it was made for."""
DEFAULT_VERIFIER = "math"


def row_verifier(row: Mapping[str, Any]) -> str:
    """The verifier named by a data row (``DEFAULT_VERIFIER`` when it names none); ValueError naming the row
    and the allowed names for an unknown one, so a bad row fails before any sampling."""
    name = row.get("verifier", DEFAULT_VERIFIER)
    if name not in VERIFIERS:
        raise ValueError(f"row {row.get('id', '?')!r}: verifier {name!r} is not one of {sorted(VERIFIERS)}")
    return name


def grade_answer(
    answer: str | None, gold: str, *, verifier: str = DEFAULT_VERIFIER, timeout_s: float = GRADE_TIMEOUT_S
) -> float:
    """1.0 if the extracted `answer` is equivalent to `gold` under `verifier` (a key of VERIFIERS), else
    0.0 (also for a missing, oversized, unparseable or too-slow answer). Never raises for a bad answer, only
    KeyboardInterrupt/SystemExit, and KeyError for an unknown verifier (a caller's bug, not model output)."""
    equivalent = VERIFIERS[verifier]
    if not answer or len(answer) > MAX_ANSWER_CHARS or not balanced_braces(answer):
        return 0.0
    try:
        with _deadline(timeout_s):
            return 1.0 if equivalent(answer, str(gold)) else 0.0
    except (Exception, _GradeTimeout):
        return 0.0


def grade(
    completion: str, gold: str, *, verifier: str = DEFAULT_VERIFIER, timeout_s: float = GRADE_TIMEOUT_S
) -> float:
    """Score one completion against its gold answer: 1.0 if equivalent, else 0.0. Never raises."""
    try:
        answer = extract_answer(completion)
    except Exception:
        return 0.0
    return grade_answer(answer, gold, verifier=verifier, timeout_s=timeout_s)


def _completion_text(completion: str | list[dict[str, str]]) -> str:
    """TRL passes plain strings for base models and message lists for chat models."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def math_verify_reward(
    completions: Sequence[str | list[dict[str, str]]], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """TRL reward function: `answer` is the dataset column of gold answers, one per completion; the other
    dataset columns arrive in `kwargs` and are ignored."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} gold answers")
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        try:
            text = _completion_text(completion)
        except Exception:
            text = ""
        scores.append(grade(text, gold))
    return scores


# ---------------------------------------------------------------------------------------------------------
# Process pool

_START_TIMEOUT_S = 120.0  # spawning + importing sympy/antlr while a model trains on the same two cores
_KILL_GRACE_S = 1.0  # past its own SIGALRM deadline, a worker gets this long before it is killed
_WORKER_MEMORY_BYTES = 4 << 30  # a power tower must raise MemoryError, not take the node's RAM


def _worker_main(conn: Connection, timeout_s: float) -> None:
    """Grade chunks of `(index, answer, gold, verifier)` and send `(index, score)` after every item, so that
    the parent knows exactly which item a hung worker is stuck on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, resource.RLIM_INFINITY))
    grade_answer("1", "1", timeout_s=_START_TIMEOUT_S)  # load antlr/sympy before reporting ready
    try:
        conn.send("ready")
        while (chunk := conn.recv()) is not None:
            for index, answer, gold, verifier in chunk:
                conn.send((index, grade_answer(answer, gold, verifier=verifier, timeout_s=timeout_s)))
    except (EOFError, OSError):
        pass  # the parent is gone: nothing left to grade for


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    pending: deque[int] = field(default_factory=deque)
    last_progress: float = field(default_factory=time.monotonic)


class GradingPool:
    """Grade many (completion, gold) pairs on `workers` processes, each call limited to `timeout_s`.

    Completions are reduced to their extracted answer in the parent and identical (answer, gold,
    verifier) items are graded once: of 256 samples of one problem most repeat a handful of answers. Work
    is sent in chunks to amortise IPC. A call over its deadline scores 0 inside the worker; a worker that
    does not answer within `timeout_s + 1 s` (stuck in C, or dead) is killed and replaced, its current item
    scores 0 and the rest of its chunk is re-queued. Workers use the 'spawn' context, safe in a process
    that has loaded torch.
    The constructor returns once every worker is warm; a replacement receives work only after it reports
    ready, so a worker's start-up (seconds of imports under load) never counts against a call's limit.
    """

    def __init__(self, workers: int = 2, timeout_s: float = GRADE_TIMEOUT_S, *, chunk_size: int = 16) -> None:
        if workers < 1 or timeout_s <= 0 or chunk_size < 1:
            raise ValueError(
                f"need workers >= 1, timeout_s > 0, chunk_size >= 1; got {workers}, {timeout_s}, {chunk_size}"
            )
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start_worker() for _ in range(workers)]
        self._await_ready()

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self.timeout_s), daemon=True, name="sage-grader"
        )
        process.start()
        child_conn.close()
        return _Worker(process, parent_conn)

    def _await_ready(self) -> None:
        """Block until every worker has imported sympy/Math-Verify and said so. Without this, a worker still
        starting under CPU load is silently skipped (work goes to the others), so whether a later hang or
        crash hits a warm worker or one that never became ready, and how it is handled, depended on timing."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(w.ready for w in self._workers):
            waiting = [w for w in self._workers if not w.ready]
            ready = wait([w.conn for w in waiting], timeout=max(0.0, deadline - time.monotonic()))
            for worker in waiting:
                if worker.conn in ready:
                    self._receive(worker, [])
                if not worker.ready and (not worker.process.is_alive() or time.monotonic() > deadline):
                    self.close()
                    raise RuntimeError(
                        f"grading worker exited or did not start within {_START_TIMEOUT_S:.0f} s"
                    )

    def close(self) -> None:
        """Stop the workers; one that does not exit promptly is killed."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(timeout=2.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self._workers = []

    def grade_many(
        self, completions: Sequence[str], golds: Sequence[str], verifiers: Sequence[str] | None = None
    ) -> list[float]:
        """Scores in the order of `completions`; `verifiers` names each one's rule (a key of VERIFIERS;
        None: all "math"). Never raises for bad completions; an unknown verifier is a ValueError, raised
        before anything is graded."""
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        if verifiers is None:
            verifiers = [DEFAULT_VERIFIER] * len(golds)
        if len(verifiers) != len(golds):
            raise ValueError(f"{len(verifiers)} verifiers but {len(golds)} gold answers")
        unknown = sorted(set(verifiers) - set(VERIFIERS))
        if unknown:
            raise ValueError(f"unknown verifier(s) {unknown}; known: {sorted(VERIFIERS)}")
        if not self._workers:
            raise RuntimeError("GradingPool is closed")
        item_index: dict[tuple[str, str, str], int] = {}
        positions: list[int | None] = []
        for completion, gold, verifier in zip(completions, golds, verifiers, strict=True):
            answer = _safe_extract(completion)
            if answer is None or len(answer) > MAX_ANSWER_CHARS:
                positions.append(None)
                continue
            positions.append(item_index.setdefault((answer, str(gold), verifier), len(item_index)))
        scores = self._grade_unique(list(item_index))
        return [0.0 if p is None else scores[p] for p in positions]

    def _grade_unique(self, pairs: list[tuple[str, str, str]]) -> list[float]:
        scores = [0.0] * len(pairs)
        queue: deque[int] = deque(range(len(pairs)))
        outstanding = len(pairs)
        while outstanding:
            for position, worker in enumerate(self._workers):
                if worker.ready and not worker.pending and queue and not self._dispatch(worker, queue, pairs):
                    self._workers[position] = self._replace(worker)
            ready = wait([w.conn for w in self._workers], timeout=self._time_to_next_deadline())
            for position, worker in enumerate(self._workers):
                if worker.conn in ready:
                    outstanding -= self._receive(worker, scores)
                if worker.process.is_alive() and not self._overdue(worker):
                    continue
                if worker.pending:  # its first pending item is the one it hung or died on: scores 0
                    worker.pending.popleft()
                    outstanding -= 1
                    queue.extendleft(reversed(worker.pending))
                elif not worker.ready:
                    raise RuntimeError(
                        f"grading worker exited or did not start within {_START_TIMEOUT_S:.0f} s"
                    )
                self._workers[position] = self._replace(worker)
        return scores

    def _dispatch(self, worker: _Worker, queue: deque[int], pairs: list[tuple[str, str, str]]) -> bool:
        """Send the next chunk; False (chunk back on the queue) if the worker died while idle."""
        chunk = [queue.popleft() for _ in range(min(self.chunk_size, len(queue)))]
        try:
            worker.conn.send([(i, *pairs[i]) for i in chunk])
        except OSError:
            queue.extendleft(reversed(chunk))
            return False
        worker.pending.extend(chunk)
        worker.last_progress = time.monotonic()
        return True

    def _receive(self, worker: _Worker, scores: list[float]) -> int:
        """Read every message a worker has sent; returns how many items it finished."""
        finished = 0
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                worker.last_progress = time.monotonic()
                if message == "ready":
                    worker.ready = True
                    continue
                index, score = message
                scores[index] = score
                worker.pending.remove(index)
                finished += 1
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)  # died mid-item (e.g. killed by the OOM killer)
        return finished

    def _limit(self, worker: _Worker) -> float:
        return self.timeout_s + _KILL_GRACE_S if worker.ready else _START_TIMEOUT_S

    def _overdue(self, worker: _Worker) -> bool:
        busy = worker.pending or not worker.ready
        return bool(busy) and time.monotonic() - worker.last_progress > self._limit(worker)

    def _time_to_next_deadline(self) -> float:
        now = time.monotonic()
        waits = [w.last_progress + self._limit(w) - now for w in self._workers if w.pending or not w.ready]
        return max(0.0, min(waits, default=self.timeout_s)) + 0.01

    def _replace(self, worker: _Worker) -> _Worker:
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        return self._start_worker()


def _safe_extract(completion: str) -> str | None:
    try:
        return extract_answer(completion)
    except Exception:
        return None
