"""The testbed's verifiable world: ``a*b+c=`` with a teacher that writes worked solutions.

Why this task: every answer is checkable exactly, there are several valid ways to reach it (so strategy
mix and mode collapse are observable), and a ~1M-parameter model learns it in minutes on a CPU while
staying imperfect (so RL has something to improve). The teacher picks one of three strategies with
skewed frequencies and slips a digit in a few traces, which gives the base model both a dominant mode
and a realistic error rate.

Pure python on purpose (only :func:`arith_dataset`/:func:`heldout_dataset` import ``datasets``): the
grader, the analysis code and the tests use it without torch.
"""

from __future__ import annotations

import hashlib
import operator
import random
import re
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START, make_prompt

if TYPE_CHECKING:
    import datasets

A_RANGE = range(10, 100)
B_RANGE = range(2, 10)
C_RANGE = range(10, 100)
HELDOUT_PERCENT = 5
"""Share of all (a, b, c) reserved for evaluation: 5% of 64,800 is ~3,200 problems, plenty for 200."""

STRATEGIES = ("direct", "split", "round")
DEFAULT_STRATEGY_PROBS = (0.8, 0.15, 0.05)
DEFAULT_SLIP_RATE = 0.04
"""Each slip corrupts exactly one digit and propagates, so this is also the teacher's error rate."""

SPLITS = ("train", "heldout")
_OPS: dict[str, Callable[[int, int], int]] = {"*": operator.mul, "+": operator.add, "-": operator.sub}


def problem_text(a: int, b: int, c: int) -> str:
    """The prompt the model sees; also what the split hash is computed on."""
    return f"{a}*{b}+{c}="


def split_of(a: int, b: int, c: int) -> str:
    """Split decided by a hash of the problem itself, so train and held-out are disjoint for every seed
    and every n (a seeded shuffle would not guarantee that across calls)."""
    digest = hashlib.blake2b(problem_text(a, b, c).encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT else "train"


@lru_cache(maxsize=len(SPLITS))
def _pool(split: str) -> tuple[tuple[int, int, int], ...]:
    return tuple((a, b, c) for a in A_RANGE for b in B_RANGE for c in C_RANGE if split_of(a, b, c) == split)


def make_problems(split: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct problems of ``split``, the same list for the same (split, n, seed)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pool = _pool(split)
    if n > len(pool):
        raise ValueError(f"asked for {n} {split} problems, the split has {len(pool)}")
    chosen = random.Random(seed).sample(pool, n)
    return [
        {"problem": problem_text(a, b, c), "answer": str(a * b + c), "a": a, "b": b, "c": c}
        for a, b, c in chosen
    ]


class _Scribe:
    """Writes arithmetic steps ``x op y=r`` and slips one digit of one step's result when told to.

    Later steps use the written (possibly wrong) value, like a student who copies their own mistake.
    """

    def __init__(self, slip_at: int | None, rng: random.Random) -> None:
        self.slip_at = slip_at
        self.rng = rng
        self.lines: list[str] = []
        self.values: list[int] = []

    def __call__(self, x: int, op: str, y: int) -> int:
        result = _OPS[op](x, y)
        if len(self.lines) == self.slip_at:
            result = _slip_digit(result, self.rng)
        self.lines.append(f"{x}{op}{y}={result}")
        self.values.append(result)
        return result


def _slip_digit(value: int, rng: random.Random) -> int:
    """Replace one digit with a different one, never creating a leading zero (so the text stays a number)."""
    digits = list(str(value))
    pos = rng.randrange(len(digits))
    lowest = 1 if pos == 0 and len(digits) > 1 else 0
    digits[pos] = rng.choice([d for d in "0123456789"[lowest:] if d != digits[pos]])
    return int("".join(digits))


def _direct(a: int, b: int, c: int, w: _Scribe) -> int:
    return w(w(a, "*", b), "+", c)


def _split(a: int, b: int, c: int, w: _Scribe) -> int:
    tens = w(a // 10 * 10, "*", b)
    units = w(a % 10, "*", b)
    return w(w(tens, "+", units), "+", c)


def _round(a: int, b: int, c: int, w: _Scribe) -> int:
    up = (a // 10 + 1) * 10
    high = w(up, "*", b)
    low = w(up - a, "*", b)
    return w(w(high, "-", low), "+", c)


_STRATEGY_FNS = {"direct": _direct, "split": _split, "round": _round}
_N_STEPS = {"direct": 2, "split": 4, "round": 4}


def teacher_completion(
    a: int,
    b: int,
    c: int,
    rng: random.Random,
    strategy_probs: tuple[float, float, float] = DEFAULT_STRATEGY_PROBS,
    slip_rate: float = DEFAULT_SLIP_RATE,
) -> tuple[str, str]:
    """A worked solution in the paper's tag format and the name of the strategy it used.

    With probability ``slip_rate`` one step's result has one wrong digit; the error propagates, so the
    final answer is then wrong. A slip that would make a later value negative is redrawn, keeping every
    trace in the format :func:`classify_strategy` recognises.
    """
    strategy = rng.choices(STRATEGIES, weights=strategy_probs)[0]
    slip_at = rng.randrange(_N_STEPS[strategy]) if rng.random() < slip_rate else None
    while True:
        scribe = _Scribe(slip_at, rng)
        answer = _STRATEGY_FNS[strategy](a, b, c, scribe)
        if min(scribe.values) >= 0:
            break
    work = " ".join(scribe.lines)
    return f"{WORK_START}{work}{WORK_END}{SOLUTION_START}{answer}{SOLUTION_END}", strategy


_STRATEGY_PATTERNS = {
    "direct": re.compile(r"\d+\*\d=\d+ \d+\+\d+=\d+"),
    "split": re.compile(r"\d0\*\d=\d+ \d\*\d=\d+ \d+\+\d+=\d+ \d+\+\d+=\d+"),
    "round": re.compile(r"\d+0\*\d=\d+ \d+\*\d=\d+ \d+-\d+=\d+ \d+\+\d+=\d+"),
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


def _to_dataset(problems: list[dict], chat: bool) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict(
        {
            "prompt": [make_prompt(p["problem"], chat) for p in problems],
            "answer": [p["answer"] for p in problems],
        }
    )


def arith_dataset(n: int, seed: int, chat: bool = False) -> datasets.Dataset:
    """RL prompts (columns ``prompt``, ``answer``) from the train split."""
    return _to_dataset(make_problems("train", n, seed), chat)


def heldout_dataset(n: int = 200, seed: int = 0, chat: bool = False) -> datasets.Dataset:
    """Evaluation prompts from the held-out split, never seen by the base model's teacher data."""
    return _to_dataset(make_problems("heldout", n, seed), chat)


def heldout_rows(n: int = 200, seed: int = 0) -> list[dict]:
    """The held-out split as evaluation rows ``{id, problem, answer}`` (the benchmark loaders' format)."""
    return [
        {"id": p["problem"], "problem": p["problem"], "answer": p["answer"]}
        for p in make_problems("heldout", n, seed)
    ]
