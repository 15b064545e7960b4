"""Grading: the one path by which completions are scored, in training rewards, the periodic evaluation and
every final evaluation.

Completions are model output, which is adversarial input for sympy (malformed, huge, or a LaTeX "bomb"
whose simplification never ends). Every score comes from :class:`GradingPool`: pebble's process pool with
a per-call time limit (a worker stuck past it, even in C code that no signal interrupts, is killed and
replaced) and a memory cap per worker. What is ours: answers are extracted in the parent, identical
(answer, gold, verifier) items are graded once, and a call that fails in any way scores 0. What an answer
is and when it equals the gold is ``sage.data.verifiers``'s business.
"""

from __future__ import annotations

import logging
import multiprocessing
import resource
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Any

from pebble import ProcessExpired, ProcessPool

from sage.data.verifiers import (
    DEFAULT_VERIFIER,
    GRADE_TIMEOUT_S,
    MAX_ANSWER_CHARS,
    VERIFIERS,
    answer_limit,
    extract_answer,
    grade_answer,
)

log = logging.getLogger(__name__)

KILL_GRACE_S = 1.0
"""Past its own SIGALRM deadline, a call gets this long before pebble kills its worker."""
WORKER_MEMORY_BYTES = 4 << 30
"""Address-space cap of a worker: a power tower must raise MemoryError, not take the node's RAM."""


def _init_worker(memory_bytes: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, resource.RLIM_INFINITY))
    grade_answer("1", "1")  # import antlr/sympy now: a call's time limit counts grading only


class GradingPool:
    """Grade many (completion, gold) pairs on ``workers`` processes, each call limited to ``timeout_s``.

    A call over its deadline scores 0 inside the worker (Math-Verify's SIGALRM); a worker that has not
    answered ``KILL_GRACE_S`` later is killed by pebble and replaced, and that item scores 0, as does one
    whose worker died (killed by the OOM killer, say). Workers use the 'spawn' context, safe in a process
    that has loaded torch, and are recycled after ``max_tasks`` calls so that sympy's caches cannot grow
    without bound.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = GRADE_TIMEOUT_S,
        *,
        max_tasks: int = 10_000,
        memory_bytes: int = WORKER_MEMORY_BYTES,
        max_answer_chars: int = MAX_ANSWER_CHARS,
    ) -> None:
        if workers < 1 or timeout_s <= 0 or max_answer_chars < 1:
            raise ValueError(
                f"need workers >= 1, timeout_s > 0 and max_answer_chars >= 1; "
                f"got {workers}, {timeout_s}, {max_answer_chars}"
            )
        self.timeout_s = timeout_s
        self.max_answer_chars = (
            max_answer_chars  # grading.max_answer_chars (sage.data.verifiers.answer_limit)
        )
        self._options = {
            "max_workers": workers,
            "max_tasks": max_tasks,
            "initializer": _init_worker,
            "initargs": (memory_bytes,),
            "context": multiprocessing.get_context("spawn"),
        }
        self._pool: ProcessPool | None = ProcessPool(**self._options)

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (a busy one is killed: nothing is waiting for its result any more)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def grade_many(
        self, completions: Sequence[str], golds: Sequence[str], verifiers: Sequence[str] | None = None
    ) -> list[float]:
        """Scores in the order of ``completions``; ``verifiers`` names each one's rule (a key of VERIFIERS;
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
        if self._pool is None:
            raise RuntimeError("GradingPool is closed")
        item_index: dict[tuple[str, str, str], int] = {}
        positions: list[int | None] = []
        for completion, gold, verifier in zip(completions, golds, verifiers, strict=True):
            answer = _safe_extract(completion)
            if answer is None or len(answer) > answer_limit(str(gold), self.max_answer_chars):
                positions.append(None)
                continue
            positions.append(item_index.setdefault((answer, str(gold), verifier), len(item_index)))
        scores = self._grade_unique(list(item_index))
        return [0.0 if p is None else scores[p] for p in positions]

    def _grade_unique(self, items: list[tuple[str, str, str]]) -> list[float]:
        scores: list[float | None] = [None] * len(items)
        lost = 0
        for attempt in range(2):
            pending = [i for i, s in enumerate(scores) if s is None]
            try:
                futures = {
                    i: self._pool.schedule(
                        grade_answer,
                        args=items[i][:2],
                        kwargs={
                            "verifier": items[i][2],
                            "timeout_s": self.timeout_s,
                            "max_chars": self.max_answer_chars,
                        },
                        timeout=self.timeout_s + KILL_GRACE_S,
                    )
                    for i in pending
                }
                for i, future in futures.items():
                    try:
                        scores[i] = float(future.result())
                    except (FutureTimeout, ProcessExpired):
                        scores[i] = 0.0
                        lost += 1
                break
            except BrokenProcessPool:
                # pebble gives up on the whole pool when a worker dies while none is running a call;
                # a new pool grades what is left, once
                if attempt:
                    raise
                log.warning("grading: the worker pool broke (a worker died while idle); restarting it")
                self._pool.stop()
                self._pool.join()
                self._pool = ProcessPool(**self._options)
        if lost:
            log.warning(
                "grading: %d of %d calls were killed (over the time limit, or their worker died); scored 0",
                lost,
                len(items),
            )
        return [float(s) for s in scores]


def self_graded(golds: Sequence[str], verifiers: Sequence[str], pool: GradingPool) -> list[bool]:
    """Whether each gold answer, written as a model would (``\\boxed{<gold>}``), grades correct against itself
    through ``pool``: where it does not, no answer can score on its problem. A gold that fails is graded
    once more, so that a call a busy machine pushed past its time limit is not taken for the grader's
    verdict."""
    completions = [f"\\boxed{{{gold}}}" for gold in golds]
    scores = pool.grade_many(completions, golds, verifiers)
    again = [i for i, score in enumerate(scores) if score != 1.0]
    if again:
        retried = pool.grade_many(
            [completions[i] for i in again], [golds[i] for i in again], [verifiers[i] for i in again]
        )
        for i, score in zip(again, retried, strict=True):
            scores[i] = score
    return [score == 1.0 for score in scores]


def grader_fingerprint() -> str:
    """Changes whenever a grade could: the grading code (this module and ``sage.data.verifiers``) and the
    versions of Math-Verify and sympy. Keys what is cached of a grader's verdicts (sage.data.benchmarks)."""
    from importlib.metadata import version
    from pathlib import Path

    from sage.data import verifiers
    from sage.durable import file_digest
    from sage.paths import content_key

    return content_key(
        {
            "code": [file_digest(Path(module.__file__)) for module in (verifiers, sys.modules[__name__])],
            "packages": {name: version(name) for name in ("math-verify", "sympy")},
        }
    )


class PoolReward:
    """TRL reward function that grades through a :class:`GradingPool`: ``answer`` is the dataset column
    of gold answers, one per completion, and an optional ``verifier`` column names each row's rule; TRL
    passes the other dataset columns as keyword arguments, which are ignored. Named
    ``math_verify_reward`` in TRL's logs (``rewards/math_verify_reward/mean``)."""

    __name__ = "math_verify_reward"

    def __init__(self, pool: GradingPool) -> None:
        self.pool = pool

    def __call__(
        self,
        completions: Sequence[str | list[dict[str, str]]],
        answer: Sequence[str],
        verifier: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        if len(completions) != len(answer):
            raise ValueError(f"{len(completions)} completions but {len(answer)} gold answers")
        return self.pool.grade_many([_completion_text(c) for c in completions], list(answer), verifier)


def _completion_text(completion: str | list[dict[str, str]]) -> str:
    """TRL passes plain strings for base models and message lists for chat models."""
    if isinstance(completion, str):
        return completion
    try:
        return completion[-1]["content"] if completion else ""
    except (KeyError, TypeError, IndexError):
        return ""


def _safe_extract(completion: str) -> str | None:
    try:
        return extract_answer(completion)
    except Exception:
        return None
