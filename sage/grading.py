"""Grading: the one path by which completions are scored, in training rewards and in every evaluation.

Completions are model output, which is adversarial input for sympy (malformed, huge, or a LaTeX "bomb"
whose simplification never ends). Every score comes from :class:`GradingPool`: worker processes with a
per-call time limit and a memory cap, killed and replaced when they hang in code that signals cannot
interrupt. What an answer is and when it equals the gold is ``sage.data.verifiers``'s business.
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

from sage.data.verifiers import (
    DEFAULT_VERIFIER,
    GRADE_TIMEOUT_S,
    MAX_ANSWER_CHARS,
    VERIFIERS,
    extract_answer,
    grade,
    grade_answer,
)


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
