"""The verifiable reward: Math-Verify equivalence of the completion's final answer with the gold answer.

Grading runs sympy on model output, which is adversarial input: it can be malformed, huge, or a LaTeX
"bomb" whose simplification never ends. So every entry point here returns a score and never raises,
answers longer than their limit (`answer_limit`) are refused before sympy sees them, and each call is
bounded in time: in the main thread by a SIGALRM deadline, across many calls by :class:`GradingPool`, whose
worker processes are killed and replaced when they hang in code that signals cannot interrupt.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from sage.data.prompts import SOLUTION_END, SOLUTION_START

MAX_ANSWER_CHARS = 1000
"""Default of ``grading.max_answer_chars``: the longest answer sympy is given, unless its gold is longer."""
GRADE_TIMEOUT_S = 5.0

# Both sides are wrapped in \boxed{} before parsing, so the boxed content is the only thing to extract:
# bare gold LaTeX such as `3\sqrt{13}` would otherwise be read by the "find a number" heuristics as `3`.
_BOXED_LATEX = LatexExtractionConfig(boxed_match_priority=0)
_GOLD_CONFIG = (_BOXED_LATEX,)
# A model may also write a plain expression such as `1/2` or `2**10`; Expr extraction is the fallback.
_PRED_CONFIG = (_BOXED_LATEX, ExprExtractionConfig())

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)\s*\{")


class _DropTimeoutDisabledWarning(logging.Filter):
    """Math-Verify warns once that its own timeouts are off: off on purpose (see `_call_with_deadline`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


class _GradeTimeout(BaseException):
    """A BaseException, so that the `except Exception` clauses inside sympy and Math-Verify cannot swallow
    the deadline and keep computing."""


# How soon an alarm fires again when its exception was lost (see `_call_with_deadline`).
_REFIRE_S = 0.05


def _call_with_deadline(fn: Callable[[], bool], seconds: float) -> bool:
    """``fn()``, or `_GradeTimeout` once ``seconds`` of wall time have passed.

    Math-Verify's own timeouts use `signal.alarm` per parse/compare step (whole seconds, several steps per
    call, and a ValueError outside the main thread), so we disable them and put one sub-second deadline
    around the whole call instead. Signals only reach the main thread: elsewhere ``fn`` runs unbounded,
    which is why bulk grading goes through `GradingPool` (each worker grades in its main thread).

    The alarm re-arms itself until the deadline is left: a handler that runs inside a finaliser (`__del__`,
    a weakref callback, which the garbage collector may call at any allocation in sympy) has its exception
    printed and dropped by Python, and a one-shot alarm lost that way leaves the grade unbounded. A function
    rather than a generator context manager, so that disarming runs in the frame that armed it and cannot
    be skipped by an alarm landing in between.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn()
    armed = [True]

    def _raise(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            signal.setitimer(signal.ITIMER_REAL, _REFIRE_S)
            raise _GradeTimeout

    previous = signal.signal(signal.SIGALRM, _raise)
    # A library may leave SIGALRM blocked in the main thread (masks are inherited and some code blocks
    # signals around thread starts); a blocked alarm is never delivered and the deadline would not fire.
    blocked = signal.SIGALRM in signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGALRM])
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        return fn()
    finally:
        # An alarm may still land while disarming; once `armed` is cleared the handler no longer raises.
        while True:
            try:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except _GradeTimeout:
                continue
        signal.signal(signal.SIGALRM, previous)
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])


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


def answer_limit(gold: str, max_chars: int = MAX_ANSWER_CHARS) -> int:
    """The longest answer graded against ``gold``: ``max_chars``, or twice the gold's own length where that
    is more. The cap keeps huge model output from sympy; it must never make a problem unsolvable, as a
    fixed cap did for a 1,729-character matrix gold, and twice the gold leaves room for an equivalent answer
    written more loosely (spaces, ``\\dfrac`` for ``\\frac``)."""
    return max(max_chars, 2 * len(gold))


def grade_answer(
    answer: str | None,
    gold: str,
    *,
    verifier: str = DEFAULT_VERIFIER,
    timeout_s: float = GRADE_TIMEOUT_S,
    max_chars: int = MAX_ANSWER_CHARS,
) -> float:
    """1.0 if the extracted `answer` is equivalent to `gold` under `verifier` (a key of VERIFIERS), else
    0.0 (also for a missing, unparseable or too-slow answer, or one longer than `answer_limit`). Never raises
    for a bad answer, only KeyboardInterrupt/SystemExit, and KeyError for an unknown verifier (a caller's
    bug, not model output)."""
    equivalent = VERIFIERS[verifier]
    if not answer or len(answer) > answer_limit(str(gold), max_chars) or not balanced_braces(answer):
        return 0.0
    try:
        return 1.0 if _call_with_deadline(lambda: equivalent(answer, str(gold)), timeout_s) else 0.0
    except (Exception, _GradeTimeout):
        return 0.0


def grade(
    completion: str,
    gold: str,
    *,
    verifier: str = DEFAULT_VERIFIER,
    timeout_s: float = GRADE_TIMEOUT_S,
    max_chars: int = MAX_ANSWER_CHARS,
) -> float:
    """Score one completion against its gold answer: 1.0 if equivalent, else 0.0. Never raises."""
    try:
        answer = extract_answer(completion)
    except Exception:
        return 0.0
    return grade_answer(answer, gold, verifier=verifier, timeout_s=timeout_s, max_chars=max_chars)
