"""How the testbed reads a completion: the teacher strategy it followed (:func:`classify_strategy`) and its
answer (:func:`extract_answer`, :func:`is_correct`).

The world itself, ``a*b+c=`` with its splits, tiers, teacher and datasets, is :mod:`sage.data.arith`, which
data and analysis use without reaching into the testbed; it is re-exported here, where the configs'
``_target_``s (``sage.testbed.task.heldout_rows``, ``sage.testbed.task.arith_dataset``), the params runs log
and the testbed's imports name it. Pure python: the grader, the analyses and the tests use it without torch.
"""

from __future__ import annotations

import re

# re-exported (sage.data.arith.__all__): the world under the name the configs, the logged params and the
# testbed's imports use
from sage.data.arith import *  # noqa: F403
from sage.data.arith import FORK_MARKERS
from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START

_STRATEGY_PATTERNS = {
    "direct": re.compile(r"\d+\*\d=\d+ \d+\+\d+=\d+"),
    "split": re.compile(r"\d0\*\d=\d+ \d\*\d=\d+ \d+\+\d+=\d+ \d+\+\d+=\d+"),
    "round": re.compile(r"\d+0\*\d=\d+ \d+\*\d=\d+ \d+-\d+=\d+ \d+\+\d+=\d+"),
}
_FORK_PATTERNS = {
    **_STRATEGY_PATTERNS,
    "cfirst": _STRATEGY_PATTERNS["direct"],  # told from direct by its marker (the addends' order aside)
    "double": re.compile(r"\d+\*\d=\d+ \d+\+\d+=\d+ \d+\+\d+=\d+"),
    "ctens": re.compile(r"\d+\*\d=\d+ \d+\+\d0=\d+ \d+\+\d=\d+"),
}
_WORK_RE = re.compile(re.escape(WORK_START) + r"(.*?)" + re.escape(WORK_END), re.DOTALL)


def classify_strategy(completion: str) -> str:
    """Which teacher strategy a completion follows, judged by the shape of its working out only.

    Shape, not arithmetic: a model sample with a wrong digit still used the strategy, and the strategy
    mix is what mode-collapse analysis compares across methods. Anything else is ``"other"``.
    """
    match = _WORK_RE.search(completion)
    if match is None:
        return "other"
    work = match.group(1).strip()
    for (
        name,
        marker,
    ) in FORK_MARKERS.items():  # a fork-world trace: the strategy it announced, if it kept to it
        if work.startswith(marker):
            return name if _FORK_PATTERNS[name].fullmatch(work[len(marker) :]) else "other"
    for name, pattern in _STRATEGY_PATTERNS.items():
        if pattern.fullmatch(work):
            return name
    return "other"


def extract_answer(completion: str) -> str | None:
    """Text between the solution tags, or None; the local grader of the testbed's measurements."""
    start = completion.find(SOLUTION_START)
    if start < 0:
        return None
    end = completion.find(SOLUTION_END, start + len(SOLUTION_START))
    return None if end < 0 else completion[start + len(SOLUTION_START) : end].strip()


def is_correct(completion: str, answer: str) -> bool:
    return extract_answer(completion) == answer.strip()
