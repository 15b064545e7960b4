"""Schedules for the guide hyperparameters that the paper anneals (SAGE.md section 3).

A schedule maps (start, end, step) to a value; ``step`` counts OPTIMISER steps (the trainer passes
``state.global_step``), not loss calls as the authors' code does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cosine_cycles(step: int, max_steps: int, start: float, end: float, cycles: int, decay: float) -> float:
    """Cosine decay from ``start`` to ``end`` repeated over ``cycles`` cycles; after each of the first
    cycles - 1 cycles the starting value is multiplied by ``decay`` (the authors' code)::

        cycle_length = max_steps // cycles;  c = step // cycle_length
        t = (step mod cycle_length) / cycle_length
        value = end + (start * decay**min(c, cycles - 1) - end) * 0.5 * (1 + cos(pi * t))
    """
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    cycle_length = max(max_steps // cycles, 1)
    cycle = min(step // cycle_length, cycles - 1)
    t = (step % cycle_length) / cycle_length
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
