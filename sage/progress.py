"""Progress lines with an estimate of the time left, for the long waits of a run (the testbed base model's
build, an evaluation's sampling): a line in the log, which a grid job's log file and a terminal both show,
unlike a progress bar redrawn in place."""

from __future__ import annotations

import logging
import time


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: a wait, to the precision that matters for it."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_line(what: str, done: int, total: int, elapsed: float, unit: str = "") -> str:
    """``what: done/total unit, <elapsed> elapsed, about <left> left``: the time left assumes the rest goes
    at the rate so far (none is claimed before anything is done)."""
    count = f"{what}: {done}/{total}{' ' + unit if unit else ''}, {duration(elapsed)} elapsed"
    if done <= 0:
        return count
    if done >= total:
        return f"{count}, done"
    return f"{count}, about {duration(elapsed * (total - done) / done)} left"


class Progress:
    """Counts work as it is reported (``update(n)``) and logs :func:`eta_line` when at least ``every``
    seconds passed since the last line, and when the work is complete."""

    def __init__(
        self,
        what: str,
        total: int,
        log: logging.Logger,
        unit: str = "",
        every: float = 30.0,
        clock=time.monotonic,
    ) -> None:
        self.what, self.total, self.log, self.unit, self.every, self.clock = (
            what,
            total,
            log,
            unit,
            every,
            clock,
        )
        self.done = 0
        self.start = self.last = clock()

    def update(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.every or self.done >= self.total:
            self.last = now
            self.log.info(eta_line(self.what, self.done, self.total, now - self.start, self.unit))
