"""Cosine-with-restarts schedule against a hand-made table (max_steps=16, 4 cycles, decay 0.5)."""

import math

import pytest

from sage.objective.schedules import ConstantSchedule, CosineSchedule, cosine_cycles

# cycle_length = 4; value = end + (start * 0.5**cycle - end) * 0.5 * (1 + cos(pi * t)), start=1, end=0
TABLE = [
    (0, 1.0),  # cycle 0, t=0
    (1, 0.5 * (1 + math.cos(math.pi / 4))),  # 0.853553
    (2, 0.5),
    (3, 0.5 * (1 + math.cos(3 * math.pi / 4))),  # 0.146447
    (4, 0.5),  # cycle 1 restarts at 0.5
    (6, 0.25),
    (8, 0.25),  # cycle 2 at 0.25
    (12, 0.125),  # cycle 3 (last) at 0.125
    (15, 0.125 * 0.5 * (1 + math.cos(3 * math.pi / 4))),
    (16, 0.125),  # beyond max_steps: no further decay after the first N-1 cycles
]


@pytest.mark.parametrize("step,value", TABLE)
def test_cosine_table(step, value):
    assert cosine_cycles(step, 16, 1.0, 0.0, cycles=4, decay=0.5) == pytest.approx(value, abs=1e-12)


def test_cosine_with_nonzero_end_and_paper_defaults():
    s = CosineSchedule(max_steps=1000, cycles=8, decay=0.9)
    assert s(0.1, 0.0, 0) == pytest.approx(0.1)
    assert s(0.15, 0.05, 125) == pytest.approx(0.05 + (0.15 * 0.9 - 0.05))  # start of cycle 2
    assert s(0.15, 0.05, 62) == pytest.approx(0.05 + 0.1 * 0.5 * (1 + math.cos(math.pi * 62 / 125)))


def test_constant_and_validation():
    assert ConstantSchedule()(0.3, 0.1, 999) == 0.3
    with pytest.raises(ValueError, match="cycles"):
        CosineSchedule(max_steps=10, cycles=0)
    with pytest.raises(ValueError, match="max_steps"):
        CosineSchedule(max_steps=0)
