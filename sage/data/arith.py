"""The testbed's verifiable world: ``a*b+c=`` with a teacher that writes worked solutions.

Why this task: every answer is checkable exactly, there are several valid ways to reach it (so strategy
mix and mode collapse are observable), and a ~1M-parameter model learns it in minutes on a CPU while
staying imperfect (so RL has something to improve). The teacher picks one of three strategies with
skewed frequencies and slips a digit in a few traces, which gives the base model both a dominant mode
and a realistic error rate.

Pure python on purpose (only :func:`arith_dataset`/:func:`heldout_dataset` import ``datasets``): the SFT
set (sage.data.datasets), sage-report's per-problem labels (analysis.moved), the grader and the tests use
it without torch or the testbed's model. ``sage.testbed.task`` re-exports it: the configs' ``_target_``s
and the params runs log name it there (``sage.testbed.task.heldout_rows``).
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START, make_prompt

if TYPE_CHECKING:
    import datasets

__all__ = [
    "A_RANGE",
    "B_RANGE",
    "C_RANGE",
    "CARRY",
    "DEFAULT_SLIP_RATE",
    "DEFAULT_STRATEGY_PROBS",
    "FORK_MARKERS",
    "FORK_PRIOR",
    "FORK_RULES",
    "FORK_STRATEGIES",
    "GRADED_RULES",
    "HELDOUT_PERCENT",
    "RARE_STRATEGY",
    "SPLITS",
    "STRATEGIES",
    "TIERS",
    "WORLDS",
    "arith_dataset",
    "heldout_dataset",
    "heldout_rows",
    "make_problems",
    "problem_text",
    "problem_tier",
    "rule_of",
    "split_of",
    "teacher_completion",
    "tier_of",
]

A_RANGE = range(10, 100)
B_RANGE = range(2, 10)
C_RANGE = range(10, 100)
HELDOUT_PERCENT = 5
"""Share of all (a, b, c) reserved for evaluation: 5% of 64,800 is ~3,200 problems, plenty for 200."""

STRATEGIES = ("direct", "split", "round")
DEFAULT_STRATEGY_PROBS = (0.8, 0.15, 0.05)
DEFAULT_SLIP_RATE = 0.04
"""Each slip corrupts exactly one digit and propagates, so this is also the teacher's error rate."""

WORLDS = ("arith", "graded", "fork")
"""``arith``: every strategy is as reliable on every problem (one slip rate), the world of the first
testbed results. ``graded``: how reliable a strategy is depends on the problem's tier (:func:`tier_of`),
so that collapsing onto the dominant strategy loses problems only a rare one solves. ``fork``: graded, with
the strategy chosen at one token (:data:`FORK_MARKERS`) among six, the world of the fair test of SAGE."""
TIERS = ("easy", "hard", "tail")
CARRY = "carry"
"""A systematic error instead of a slip rate: the strategy drops the carry of the units product (47*8 is
written 326: 4*8=32 tens, 7*8=56 written as 6), so its answer is wrong, always the same way, whenever
that product reaches 10. A model learns a systematic error confidently; random slips would instead teach
it to guess digits, and a guesser solves every problem at k = 256."""
GRADED_RULES: dict[str, dict[str, float | str]] = {
    # The one-shot product of ``direct`` is reliable for small multipliers and drops the carry for large
    # ones; writing the product in parts (``split``: tens and units) or from the next multiple of ten
    # (``round``) still works. On ``tail`` problems only the rarest strategy ever succeeds, and seldom:
    # pass@1 near 0, pass@256 well above 0, the long tail that RLVR is said to lose.
    "easy": {"direct": 0.04, "split": 0.04, "round": 0.04},
    "hard": {"direct": CARRY, "split": 0.04, "round": 0.04},
    "tail": {"direct": CARRY, "split": CARRY, "round": 0.9},
}
"""The teacher of the graded world, by tier and strategy: a slip probability, or :data:`CARRY`."""

FORK_STRATEGIES = ("direct", "split", "cfirst", "double", "ctens", "round")
FORK_PRIOR = (0.45, 0.2, 0.15, 0.1, 0.05, 0.05)
"""The fork world's teacher picks a strategy with these probabilities on every problem, whatever its tier:
about 1.5 nats at the fork, above the branch guide's threshold, so that Branch acts where the strategy is
chosen (in the graded world that choice is a 95/5 split of at most 0.2 nats, below it by construction)."""
FORK_MARKERS = {name: f"<{name}>" for name in FORK_STRATEGIES}
"""The first token of a fork-world trace after the work tag: the strategy, decided in one token (the fork)
and written before any arithmetic, as a model states its plan."""
RARE_STRATEGY = "round"
"""The fork world's rare strategy that alone solves tail problems (and seldom): the one whose share on tail
prompts says whether a method kept or found it."""
FORK_RULES: dict[str, dict[str, float | str]] = {
    "easy": dict.fromkeys(FORK_STRATEGIES, 0.04),
    # the one-shot product (direct, cfirst, ctens) drops its carry on larger multipliers
    "hard": {"direct": CARRY, "split": 0.04, "cfirst": CARRY, "double": 0.04, "ctens": CARRY, "round": 0.04},
    "tail": {**dict.fromkeys(FORK_STRATEGIES, CARRY), RARE_STRATEGY: 0.9},
}
"""The teacher of the fork world, by tier and strategy (as :data:`GRADED_RULES`)."""


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


def tier_of(b: int) -> str:
    """A graded problem's tier, by its multiplier: one prompt token, so a model can learn the tiers."""
    return "easy" if b <= 5 else "hard" if b <= 7 else "tail"


def problem_tier(world: str, a: int, b: int) -> str:
    """The tier of problem ``a*b+c`` in ``world``. In the fork world a problem whose units product has no
    carry (``a % 10 * b < 10``) is easy whatever its multiplier: every strategy solves it, so a tail
    problem is one that only the rare strategy solves. The model sees both digits in its prompt."""
    if world == "fork" and a % 10 * b < 10:
        return "easy"
    return tier_of(b)


def rule_of(
    world: str, strategy: str, b: int, slip_rate: float = DEFAULT_SLIP_RATE, a: int = 0
) -> float | str:
    """The teacher's rule for ``strategy`` on problem ``a*b+c``: a slip probability, or :data:`CARRY`
    (``a`` counts in the fork world only)."""
    if world == "arith":
        return slip_rate
    if world == "graded":
        return GRADED_RULES[tier_of(b)][strategy]
    if world == "fork":
        return FORK_RULES[problem_tier(world, a, b)][strategy]
    raise ValueError(f"world must be one of {WORLDS}, got {world!r}")


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

    def __init__(self, slip_at: int | None, rng: random.Random, drop_carry: bool = False) -> None:
        self.slip_at = slip_at
        self.drop_carry = drop_carry
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

    def product(self, x: int, y: int, written: int) -> int:
        """``x*y`` written as ``written``: a systematic error, not a slip."""
        self.lines.append(f"{x}*{y}={written}")
        self.values.append(written)
        return written


def _slip_digit(value: int, rng: random.Random) -> int:
    """Replace one digit with a different one, never creating a leading zero (so the text stays a number)."""
    digits = list(str(value))
    pos = rng.randrange(len(digits))
    lowest = 1 if pos == 0 and len(digits) > 1 else 0
    digits[pos] = rng.choice([d for d in "0123456789"[lowest:] if d != digits[pos]])
    return int("".join(digits))


def _direct(a: int, b: int, c: int, w: _Scribe) -> int:
    if w.drop_carry:
        return w(w.product(a, b, a * b - a % 10 * b // 10 * 10), "+", c)
    return w(w(a, "*", b), "+", c)


def _split(a: int, b: int, c: int, w: _Scribe) -> int:
    tens = w(a // 10 * 10, "*", b)
    units = w.product(a % 10, b, a % 10 * b % 10) if w.drop_carry else w(a % 10, "*", b)
    return w(w(tens, "+", units), "+", c)


def _round(a: int, b: int, c: int, w: _Scribe) -> int:
    up = (a // 10 + 1) * 10
    high = w(up, "*", b)
    low = w(up - a, "*", b)
    return w(w(high, "-", low), "+", c)


def _carried(a: int, b: int) -> int:
    """``a*b`` without the carry of its units product (see :data:`CARRY`)."""
    return a * b - a % 10 * b // 10 * 10


def _cfirst(a: int, b: int, c: int, w: _Scribe) -> int:
    product = w.product(a, b, _carried(a, b)) if w.drop_carry else w(a, "*", b)
    return w(c, "+", product)


def _double(a: int, b: int, c: int, w: _Scribe) -> int:
    """``a*(b-1) + a``: one multiple fewer, then one more."""
    fewer = w.product(a, b - 1, _carried(a, b - 1)) if w.drop_carry else w(a, "*", b - 1)
    return w(w(fewer, "+", a), "+", c)


def _ctens(a: int, b: int, c: int, w: _Scribe) -> int:
    """``a*b``, then ``c`` added in tens and units."""
    product = w.product(a, b, _carried(a, b)) if w.drop_carry else w(a, "*", b)
    return w(w(product, "+", c // 10 * 10), "+", c % 10)


_STRATEGY_FNS = {
    "direct": _direct,
    "split": _split,
    "round": _round,
    "cfirst": _cfirst,
    "double": _double,
    "ctens": _ctens,
}
_N_STEPS = {"direct": 2, "split": 4, "round": 4, "cfirst": 2, "double": 3, "ctens": 3}


def teacher_completion(
    a: int,
    b: int,
    c: int,
    rng: random.Random,
    strategy_probs: tuple[float, ...] = DEFAULT_STRATEGY_PROBS,
    slip_rate: float = DEFAULT_SLIP_RATE,
    world: str = "arith",
) -> tuple[str, str]:
    """A worked solution in the paper's tag format and the name of the strategy it used.

    With probability ``slip_rate`` (in the graded world: the rule of :data:`GRADED_RULES` for the
    problem's tier and the strategy, which may be the systematic :data:`CARRY` error) one step's result has
    one wrong digit; the error propagates, so the final answer is then wrong. A slip that would make a
    later value negative is redrawn, keeping every trace in the format
    :func:`sage.testbed.task.classify_strategy` recognises.
    """
    names = FORK_STRATEGIES if world == "fork" else STRATEGIES
    if len(strategy_probs) != len(names):
        raise ValueError(
            f"world {world!r} has {len(names)} strategies {names}; got probabilities {strategy_probs}"
        )
    strategy = rng.choices(names, weights=strategy_probs)[0]
    rule = rule_of(world, strategy, b, slip_rate, a)
    drop_carry = rule == CARRY
    slip_at = None if drop_carry else rng.randrange(_N_STEPS[strategy]) if rng.random() < rule else None
    while True:
        scribe = _Scribe(slip_at, rng, drop_carry)
        answer = _STRATEGY_FNS[strategy](a, b, c, scribe)
        if min(scribe.values) >= 0:
            break
    work = " ".join(scribe.lines)
    if world == "fork":
        work = FORK_MARKERS[strategy] + work
    return f"{WORK_START}{work}{WORK_END}{SOLUTION_START}{answer}{SOLUTION_END}", strategy


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


def heldout_rows(n: int = 200, seed: int = 0, tier: str | None = None, world: str = "fork") -> list[dict]:
    """The held-out split as evaluation rows ``{id, problem, answer}`` (the benchmark loaders' format).
    ``tier``: only problems of that tier of ``world`` (:func:`problem_tier`), ``n`` of them: the tail of the
    fork world as a dataset of its own, so that its pass@k differences get intervals like any dataset's."""
    if tier is None:
        problems = make_problems("heldout", n, seed)
    else:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        pool = make_problems("heldout", len(_pool("heldout")), seed)  # every held-out problem, shuffled
        problems = [p for p in pool if problem_tier(world, p["a"], p["b"]) == tier][:n]
        if len(problems) < n:
            raise ValueError(
                f"asked for {n} held-out {tier} problems of the {world} world, there are {len(problems)}"
            )
    return [{"id": p["problem"], "problem": p["problem"], "answer": p["answer"]} for p in problems]
