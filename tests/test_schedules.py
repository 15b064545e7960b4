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
    (16, 0.0),  # at max_steps the last cycle has ended: end, and it stays there
    (20, 0.0),
]


@pytest.mark.parametrize("step,value", TABLE)
def test_cosine_table(step, value):
    assert cosine_cycles(step, 16, 1.0, 0.0, cycles=4, decay=0.5) == pytest.approx(value, abs=1e-12)


def test_cosine_with_nonzero_end_and_paper_defaults():
    s = CosineSchedule(max_steps=1000, cycles=8, decay=0.9)
    assert s(0.1, 0.0, 0) == pytest.approx(0.1)
    assert s(0.15, 0.05, 125) == pytest.approx(0.05 + (0.15 * 0.9 - 0.05))  # start of cycle 2
    assert s(0.15, 0.05, 62) == pytest.approx(0.05 + 0.1 * 0.5 * (1 + math.cos(math.pi * 62 / 125)))


def authors(step: int, max_steps: int, start: float, end: float, cycles: int, decay: float) -> float:
    """The authors' formula: integer cycle length, the steps after the last full cycle restart it."""
    length = max(max_steps // cycles, 1)
    c = min(step // length, cycles - 1)
    return end + (start * decay**c - end) * 0.5 * (1 + math.cos(math.pi * (step % length) / length))


@pytest.mark.parametrize("max_steps,cycles", [(16, 4), (100, 5), (1000, 8)])
def test_cosine_is_the_authors_when_cycles_divide_the_steps(max_steps, cycles):
    for step in range(max_steps):
        ours = cosine_cycles(step, max_steps, 0.3, 0.1, cycles, 0.9)
        assert ours == pytest.approx(authors(step, max_steps, 0.3, 0.1, cycles, 0.9), abs=1e-12), step


@pytest.mark.parametrize("max_steps,cycles", [(100, 8), (10, 3), (3, 8), (1, 8)])
def test_cosine_never_jumps_back_to_the_peak_at_the_end(max_steps, cycles):
    """100 steps in 8 cycles: the authors' code restarts the last cycle for the last 4 steps; and with fewer
    steps than cycles it never leaves the start. Here the last cycle only decays, towards end."""
    values = [cosine_cycles(s, max_steps, 1.0, 0.0, cycles, 0.9) for s in range(max_steps + 1)]
    last_start = math.ceil((cycles - 1) * max_steps / cycles)  # first step of the last cycle
    tail = values[last_start:]
    assert all(a >= b for a, b in zip(tail, tail[1:], strict=False)), tail  # decays, no restart
    assert values[max_steps] == pytest.approx(0.0)  # the last cycle ends at end
    if max_steps > 1:
        assert min(values[:max_steps]) < 1.0  # the schedule moves within the run
    if max_steps % cycles:
        assert (
            any(
                authors(s, max_steps, 1.0, 0.0, cycles, 0.9) > values[s] + 1e-9
                for s in range(last_start, max_steps)
            )
            or max_steps < cycles
        )


def test_constant_and_validation():
    assert ConstantSchedule()(0.3, 0.1, 999) == 0.3
    with pytest.raises(ValueError, match="cycles"):
        CosineSchedule(max_steps=10, cycles=0)
    with pytest.raises(ValueError, match="max_steps"):
        CosineSchedule(max_steps=0)
