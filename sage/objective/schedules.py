"""Schedules for the guide hyperparameters that the paper anneals (docs/method.md, "The guides").

A schedule maps (start, end, step) to a value; ``step`` counts OPTIMISER steps (the trainer passes
``state.global_step``), not loss calls as the authors' code does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cosine_cycles(step: int, max_steps: int, start: float, end: float, cycles: int, decay: float) -> float:
    """Cosine decay from ``start`` to ``end`` repeated over ``cycles`` equal cycles of the ``max_steps``
    optimiser steps; after each of the first cycles - 1 cycles the starting value is multiplied by
    ``decay``::

        p = step * cycles / max_steps        (position in cycles, 0 .. cycles)
        c = min(floor(p), cycles - 1);  t = min(p - c, 1)
        value = end + (start * decay**c - end) * 0.5 * (1 + cos(pi * t))

    When ``cycles`` divides ``max_steps`` this is the authors' code (cycle length max_steps // cycles, t =
    (step mod length) / length). Otherwise the authors' integer cycle length leaves ``max_steps mod cycles``
    steps after the last cycle, which restart at its peak; here the cycles share the steps exactly, so the
    last cycle ends at ``end``, also when ``max_steps < cycles``. Past ``max_steps`` the value stays at
    ``end``."""
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    position = step * cycles / max(max_steps, 1)
    cycle = min(int(position), cycles - 1)
    t = min(position - cycle, 1.0)
    high = start * decay**cycle
    return end + (high - end) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclass(frozen=True)
class ConstantSchedule:
    """Every annealed hyperparameter stays at its start value."""

    def __call__(self, start: float, end: float, step: int) -> float:
        return start


@dataclass(frozen=True)
class CosineSchedule:
    """Cosine decay with restarts over ``max_steps`` optimiser steps (supplied by the trainer)."""

    max_steps: int
    cycles: int = 8
    decay: float = 0.9

    def __post_init__(self) -> None:
        if self.cycles < 1:
            raise ValueError(f"schedule.cycles must be >= 1 (got {self.cycles})")
        if not 0 < self.decay <= 1:
            raise ValueError(f"schedule.decay must be in (0, 1] (got {self.decay})")
        if self.max_steps < 1:
            raise ValueError(f"trl.max_steps must be >= 1 for a cosine schedule (got {self.max_steps})")

    def __call__(self, start: float, end: float, step: int) -> float:
        return cosine_cycles(step, self.max_steps, start, end, self.cycles, self.decay)
