"""Time and progress (issue 40, item 7): the long waits of a run say how far they are and about how long is
left, in log lines a grid job's log file keeps; the base-model build says where it caches."""

from __future__ import annotations

import logging

from sage.progress import Progress, duration, eta_line


def test_durations_read_at_the_precision_that_matters():
    assert [duration(s) for s in (0, 42.4, 185, 3725, -3)] == ["0s", "42s", "3m05s", "1h02m", "0s"]


def test_the_time_left_is_the_rest_at_the_rate_so_far():
    assert eta_line("eval aime24", 0, 720, 5.0, "completions") == "eval aime24: 0/720 completions, 5s elapsed"
    assert eta_line("eval aime24", 240, 720, 120.0, "completions") == (
        "eval aime24: 240/720 completions, 2m00s elapsed, about 4m00s left"
    )
    assert eta_line("build", 1500, 1500, 61.0) == "build: 1500/1500, 1m01s elapsed, done"


def test_progress_logs_a_line_when_enough_time_passed_and_when_done(caplog):
    now = [0.0]
    log = logging.getLogger("test_progress")
    p = Progress("eval ds", 720, log, "completions", every=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test_progress"):
        for t, n in ((10, 80), (35, 160), (50, 80), (90, 240), (95, 160)):
            now[0] = t
            p.update(n)
    assert [r.getMessage() for r in caplog.records] == [
        "eval ds: 240/720 completions, 35s elapsed, about 1m10s left",
        "eval ds: 560/720 completions, 1m30s elapsed, about 26s left",
        "eval ds: 720/720 completions, 1m35s elapsed, done",
    ]


def test_the_base_model_build_says_where_it_caches(tmp_path, monkeypatch, caplog):
    from sage import durable
    from sage.testbed import model

    built = []
    monkeypatch.setattr(durable, "build_once", lambda final, *a, **k: built.append(final) or final)
    with caplog.at_level(logging.INFO, logger=model.log.name):
        folder = model.build_tiny_model(cache_dir=str(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records if "building the testbed base model" in r.getMessage()]
    assert str(built[0]) == folder and f"into {folder}" in line and "$SAGE_CACHE_DIR" in line
