"""What the samples say, not only whether they are right: reasoning patterns among correct solutions
(Table 2) and the testbed's solution-strategy mix (mode collapse shows as one strategy taking over).

Detectors are the keyword lists of SAGE.md section 6, case-insensitive, on word boundaries. On the
arithmetic testbed they find nothing (its working out is bare arithmetic): the numbers are still computed
and shown, since the same code runs on the math benchmarks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from sage.testbed.task import STRATEGIES, classify_strategy

PATTERNS: dict[str, re.Pattern[str]] = {
    # "let", "denote", symbol introductions ("let x =", "set n to", "define f as", "where a is")
    "constraint setup": re.compile(
        r"\blet\b|\bdenot(?:e|es|ed|ing)\b|\b(?:define|set)\s+\$?\\?[a-z]\w*\$?\s+(?:=|be|as|to)\b"
        r"|\bwhere\s+\$?\\?[a-z]\w*\$?\s+(?:is|=)",
        re.IGNORECASE,
    ),
    # "of the form", "decompose into"
    "structural reasoning": re.compile(
        r"\bof the form\b|\bdecompos(?:e|es|ed|ing|ition)\b(?:\s+\w+){0,3}?\s+into\b", re.IGNORECASE
    ),
    # "assume for contradiction", "leads to a contradiction"
    "proof by contradiction": re.compile(
        r"\bassum\w*\b[^.]{0,40}\bfor (?:the sake of )?contradiction\b|\bleads? to a contradiction\b"
        r"|\bcontradict(?:s|ion|ing)?\b",
        re.IGNORECASE,
    ),
}
STRATEGY_NAMES = (*STRATEGIES, "other")


def pattern_frequency(
    completions: Sequence[Sequence[str]], correct: np.ndarray, pattern: re.Pattern[str]
) -> float:
    """(1/N) sum_i (1/c_i) sum_j 1[pattern in correct solution j of problem i], over the N problems with
    c_i > 0 correct samples; NaN when no problem has a correct sample (there is nothing to measure).
    ``completions`` and ``correct`` are problems x samples and row-aligned (the first seed's)."""
    correct = np.asarray(correct, dtype=bool)
    if correct.shape != (len(completions), len(completions[0]) if completions else 0):
        raise ValueError(
            f"{len(completions)} problems of completions and correct {correct.shape} do not align"
        )
    per_problem = []
    for texts, ok in zip(completions, correct, strict=True):
        hits = [bool(pattern.search(t)) for t, good in zip(texts, ok, strict=True) if good]
        if hits:
            per_problem.append(sum(hits) / len(hits))
    return float(np.mean(per_problem)) if per_problem else float("nan")


def strategy_mix(completions: Sequence[Sequence[str]]) -> dict[str, float]:
    """Fraction of ALL samples (right or wrong) following each testbed strategy; sums to 1."""
    flat = [classify_strategy(t) for texts in completions for t in texts]
    if not flat:
        raise ValueError("strategy_mix: no completions")
    return {s: flat.count(s) / len(flat) for s in STRATEGY_NAMES}
