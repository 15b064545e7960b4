"""The grader: every real gold answer self-verifies, wrong answers fail, adversarial output never hangs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psutil
import pytest

from sage.data import verifiers
from sage.data.benchmarks import SHIPPED_MATH_DATA, load_benchmark
from sage.data.verifiers import extract_answer, grade, grade_answer, knights_knaves_equivalent, row_verifier
from sage.grading import GradingPool, PoolReward

# the shipped copy, or the folder $SAGE_MATH_DATA names (as the loader resolves it)
DATA_DIR = Path(os.environ.get("SAGE_MATH_DATA") or SHIPPED_MATH_DATA)
BENCHMARK_SOURCES: dict[str, Path | list[Path]] = {
    "math500": DATA_DIR / "math500.jsonl",
    "aime": [DATA_DIR / "aime24.jsonl", DATA_DIR / "aime25.jsonl"],
    "amc23": DATA_DIR / "amc23.jsonl",
    "minerva": DATA_DIR / "minerva_math.jsonl",
}


def _completion(answer: str) -> str:
    return f"<start_working_out>Let me think.<end_working_out><SOLUTION>{answer}</SOLUTION>"


def _different_answer(gold: str) -> str:
    """gold + 1 for a plain number, else a number that no non-numeric gold can equal."""
    if re.fullmatch(r"-?\d+(\.\d+)?", gold):
        return str(Decimal(gold) + 1)
    return "123456789"


# --- extraction ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<SOLUTION>1</SOLUTION> then <SOLUTION> 2 </SOLUTION>", "2"),
        ("<SOLUTION>\\boxed{3}</SOLUTION>", "\\boxed{3}"),
        ("so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\fbox{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{\\boxed{7}}", "7"),  # the last opener is the innermost box
        ("\\boxed{1} \\boxed{unclosed", None),
        ("<SOLUTION>5", None),  # cut off: the \boxed fallback applies only when there is no tag at all
        ("<SOLUTION>5 \\boxed{5}", None),
        ("no answer", None),
        ("", None),
    ],
)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


# --- grading ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("3\\sqrt{13}", "3\\sqrt{13}", 1.0),
        ("3", "3\\sqrt{13}", 0.0),  # bare gold LaTeX would parse as 3: the gold must be boxed
        ("\\sqrt{117}", "3\\sqrt{13}", 1.0),
        ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("3", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{27}", "27", 1.0),
        ("28", "27", 0.0),
        ("{{{\\frac{14}{3}", "\\frac{14}{3}", 0.0),  # Math-Verify would recover the fraction: malformed is 0
        ("\\frac{14}{3}}}", "\\frac{14}{3}", 0.0),
        ("}\\frac{14}{3}{", "\\frac{14}{3}", 0.0),  # as many of each, in the wrong order
        ("\\{1, 2\\}", "\\{1,2\\}", 1.0),  # escaped set braces are text, not grouping
    ],
)
def test_grade_equivalence(answer: str, gold: str, score: float) -> None:
    assert grade(_completion(answer), gold) == score


def test_grade_falls_back_to_last_boxed() -> None:
    assert grade("The answer is \\boxed{\\frac{1}{2}}.", "0.5") == 1.0


KK_GOLD = "(1) Zoey is a knave\n(2) Oliver is a knight"


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("(1) Zoey is a knave\n(2) Oliver is a knight", 1.0),
        ("Oliver is a knight, and Zoey is a knave.", 1.0),  # order and wording around them are free
        ("zoey is a KNAVE; oliver is a Knight", 1.0),  # case does not matter
        ("Zoey is a knight\nOliver is a knight", 0.0),  # one role wrong
        ("Zoey is a knave", 0.0),  # Oliver left out
        ("Zoey is a knave or Zoey is a knight; Oliver is a knight", 0.0),  # hedging on Zoey
        ("Zoey is a knave. Oliver is not a knight", 0.0),  # no statement "Oliver is a ..."
        ("Zoeyy is a knave. Oliver is a knight", 0.0),  # another name is not Zoey
        ("", 0.0),
    ],
)
def test_knights_knaves_verifier(answer: str, score: float) -> None:
    assert grade(_completion(answer), KK_GOLD, verifier="knights_knaves") == score


def test_knights_knaves_gold_needs_the_kk_verifier() -> None:
    """Math-Verify cannot read role assignments (it only matches the gold text verbatim), so a right answer
    in other words would score 0 under the math rule: K&K rows must be graded by their own."""
    reworded = _completion("Oliver is a knight and Zoey is a knave")
    assert grade(reworded, KK_GOLD, verifier="math") == 0.0
    assert grade(reworded, KK_GOLD, verifier="knights_knaves") == 1.0
    assert knights_knaves_equivalent(
        "Mia Wong is a knight. Ella is a knave", "(1) Mia Wong is a knight\n(2) Ella is a knave"
    )


def test_row_verifier_defaults_to_math_and_names_an_unknown_one() -> None:
    assert row_verifier({"id": "a", "answer": "1"}) == "math"
    assert row_verifier({"id": "a", "verifier": "knights_knaves"}) == "knights_knaves"
    with pytest.raises(
        ValueError, match=r"row 'a': verifier 'code' is not one of \['knights_knaves', 'math'\]"
    ):
        row_verifier({"id": "a", "verifier": "code"})


def test_grade_works_outside_the_main_thread() -> None:
    """Math-Verify's own signal.alarm raises ValueError in threads; ours is skipped there."""
    scores: list[float] = []
    worker = threading.Thread(target=lambda: scores.append(grade(_completion("\\frac{6}{4}"), "1.5")))
    worker.start()
    worker.join(timeout=30)
    assert scores == [1.0]


def test_training_reward_grades_strings_chat_messages_and_row_verifiers_in_the_pool() -> None:
    """The reward TRL calls goes through the pool: a completion that would hang the trainer scores 0
    within the pool's time limit, and each row's verifier column is honoured."""
    chat = [[{"role": "assistant", "content": _completion("4")}], [{"role": "assistant", "content": "5"}]]
    kk = _completion("Oliver is a knight and Zoey is a knave")
    with GradingPool(workers=2, timeout_s=TIMEOUT_S) as grading_pool:
        reward = PoolReward(grading_pool)
        assert reward.__name__ == "math_verify_reward"  # TRL logs rewards/math_verify_reward/...
        assert reward([_completion("4"), _completion("5")], answer=["4", "4"]) == [1.0, 0.0]
        assert reward(chat, answer=["4", "4"], problem=["p", "q"]) == [1.0, 0.0]
        assert reward([kk, kk], answer=[KK_GOLD, KK_GOLD], verifier=["knights_knaves", "math"]) == [1.0, 0.0]
        start = time.monotonic()
        assert reward([ADVERSARIAL["huge factorial"], _completion("7")], answer=["7", "7"]) == [0.0, 1.0]
        assert time.monotonic() - start < 2 * (TIMEOUT_S + 1.0) + 10
        with pytest.raises(ValueError, match="2 completions but 1"):
            reward(["a", "b"], answer=["1"])


# --- every real benchmark problem --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[GradingPool]:
    with GradingPool(workers=2, timeout_s=5.0) as grading_pool:
        yield grading_pool


def test_every_gold_answer_self_verifies_and_a_different_answer_fails(
    pool: GradingPool, capsys: pytest.CaptureFixture[str]
) -> None:
    """No exclusions: all 872 gold answers (MATH-500, AIME 24+25, AMC23, Minerva) verify against
    themselves once boxed, and a different answer scores 0 for each."""
    rows = [(name, row) for name, source in BENCHMARK_SOURCES.items() for row in load_benchmark(name, source)]
    assert len(rows) == 872
    wrong = [_different_answer(row["answer"]) for _, row in rows]
    assert all(w != row["answer"] for w, (_, row) in zip(wrong, rows, strict=True))
    golds = [row["answer"] for _, row in rows]
    start = time.monotonic()
    right_scores = pool.grade_many([_completion(g) for g in golds], golds)
    wrong_scores = pool.grade_many([_completion(w) for w in wrong], golds)
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\n[grader] {2 * len(rows)} benchmark completions graded in {elapsed:.1f} s on 2 workers")
    not_self = [
        (name, row["id"], row["answer"]) for (name, row), s in zip(rows, right_scores, strict=True) if s != 1
    ]
    not_wrong = [
        (name, row["id"], w) for (name, row), w, s in zip(rows, wrong, wrong_scores, strict=True) if s != 0
    ]
    assert not_self == []
    assert not_wrong == []


def _malformed(gold: str) -> dict[str, str]:
    """Malformed completions built around a problem's own gold answer: none states it properly."""
    return {
        "empty": "",
        "cut off before </SOLUTION>": f"<start_working_out>so<end_working_out><SOLUTION>{gold}",
        "unbalanced braces": f"<SOLUTION>{{{{{{{gold}</SOLUTION>",
        "unclosed boxed": "<start_working_out>" + "\\boxed{" * 50 + gold,
        "gold inside 10k digits": f"<SOLUTION>{'9' * 5000}{gold}{'9' * 5000}</SOLUTION>",
        "answer is the word gold": "<SOLUTION>gold</SOLUTION>",
    }


def test_malformed_completions_score_zero_on_every_benchmark_problem(
    pool: GradingPool, capsys: pytest.CaptureFixture[str]
) -> None:
    """For each of the 872 problems, completions that mention its gold answer without stating it in the
    expected format (cut off, unbalanced, unclosed, buried in 10k digits) score 0 and never raise; the
    pool's per-call time limit is tested below with completions that would otherwise hang."""
    rows = [row for name, source in BENCHMARK_SOURCES.items() for row in load_benchmark(name, source)]
    cases = [
        (row["id"], kind, text, row["answer"])
        for row in rows
        for kind, text in _malformed(row["answer"]).items()
    ]
    start = time.monotonic()
    scores = pool.grade_many([c for _, _, c, _ in cases], [g for *_, g in cases])
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\n[grader] {len(cases)} malformed completions of the benchmark problems: {elapsed:.1f} s")
    assert [(i, kind) for (i, kind, _, _), s in zip(cases, scores, strict=True) if s != 0] == []


# --- adversarial output ---------------------------------------------------------------------------------

GOLD = "7"
ADVERSARIAL = {
    "empty": "",
    "1MB of text": "x" * 1_000_000,
    "1MB answer": "<SOLUTION>" + "7" * 1_000_000 + "</SOLUTION>",
    "unclosed solution tag": "<SOLUTION>7",
    "unbalanced braces in answer": "<SOLUTION>{{{\\frac{7}{</SOLUTION>",
    "unbalanced boxed": "\\boxed{" * 1000,
    "stray closing braces": "}}}}\\boxed{7}}}}{{{{\\boxed{",
    "nested boxed": "\\boxed{" * 100 + "8" + "}" * 100,
    "10k digits": "<SOLUTION>" + "9" * 10_000 + "</SOLUTION>",
    "999 digits": "<SOLUTION>" + "9" * 999 + "</SOLUTION>",
    "frac nested 500 deep": "<SOLUTION>" + "\\frac{1}{" * 500 + "2" + "}" * 500 + "</SOLUTION>",
    "frac nested 90 deep": "<SOLUTION>" + "\\frac{1}{" * 90 + "2" + "}" * 90 + "</SOLUTION>",
    "python power tower": "<SOLUTION>10**10**10</SOLUTION>",
    "latex power tower": "<SOLUTION>10^{10^{10}}</SOLUTION>",
    "2^2^2^2^2^2": "<SOLUTION>2^{2^{2^{2^{2^{2}}}}}</SOLUTION>",
    "huge exponent": "<SOLUTION>9^{999999999}</SOLUTION>",
    "huge factorial": "<SOLUTION>(10^{10})!</SOLUTION>",
    "millionth root": "<SOLUTION>\\sqrt[1000000]{2}</SOLUTION>",
    "control characters": "<SOLUTION>\x00\uffff\\\\</SOLUTION>",
}
TIMEOUT_S = 1.0


def test_adversarial_completions_score_zero_in_the_main_thread(capsys: pytest.CaptureFixture[str]) -> None:
    handler_before = signal.getsignal(signal.SIGALRM)
    slowest = 0.0
    start = time.monotonic()
    for name, completion in ADVERSARIAL.items():
        t0 = time.monotonic()
        assert grade(completion, GOLD, timeout_s=TIMEOUT_S) == 0.0, name
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        assert took < TIMEOUT_S + 0.5, f"{name} took {took:.2f} s"
    with capsys.disabled():
        print(
            f"\n[grader] {len(ADVERSARIAL)} adversarial completions in the main thread: "
            f"{time.monotonic() - start:.1f} s, slowest {slowest:.2f} s"
        )
    assert grade(None, GOLD) == 0.0  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert grade(_completion("7"), GOLD) == 1.0  # still grading after all that


def test_adversarial_completions_score_zero_in_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    completions = [*ADVERSARIAL.values(), _completion("7")]
    with GradingPool(workers=2, timeout_s=TIMEOUT_S) as grading_pool:
        grading_pool.grade_many([_completion("1")], ["1"])  # workers started and warm
        start = time.monotonic()
        scores = grading_pool.grade_many(completions, [GOLD] * len(completions))
        elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\n[grader] {len(completions)} adversarial completions in the pool: {elapsed:.1f} s")
    assert scores == [0.0] * len(ADVERSARIAL) + [1.0]
    # at most every completion hitting its deadline, shared by 2 workers, plus slack for IPC
    assert elapsed < len(completions) * (TIMEOUT_S + 0.5) / 2 + 2


def _workers(besides: set[int] = frozenset()) -> list[psutil.Process]:
    """This process's grading workers, bar ``besides`` (other pools'): its spawned children, not
    multiprocessing's resource tracker."""
    found = []
    for c in psutil.Process().children(recursive=True):
        try:
            command = " ".join(c.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # another test's child, exited, not reaped yet
            continue
        if c.pid not in besides and "spawn_main" in command and "resource_tracker" not in command:
            found.append(c)
    return found


def test_pool_kills_and_replaces_a_hung_worker() -> None:
    """A stopped process ignores every signal, like a worker stuck in C: the pool must not wait for it.
    Each worker is first given a call that runs to its time limit; one is stopped in the middle of it."""
    slow = ["<SOLUTION>3^{99999999}</SOLUTION>", "<SOLUTION>7^{123456789}</SOLUTION>"]  # run to the deadline
    answers = [str(i) for i in range(20)]
    limit = 2.0
    others = {w.pid for w in _workers()}
    with GradingPool(workers=2, timeout_s=limit) as grading_pool:
        grading_pool.grade_many([_completion(a) for a in answers], answers)  # both workers started
        workers = _workers(others)
        assert len(workers) == 2
        result: list[list[float]] = []
        grading = threading.Thread(
            target=lambda: result.append(
                grading_pool.grade_many([*slow, *map(_completion, answers)], ["7", "7", *answers])
            )
        )
        start = time.monotonic()
        grading.start()
        time.sleep(limit / 4)  # both workers are inside their slow call
        workers[0].suspend()  # SIGSTOP: its SIGALRM deadline can no longer fire
        grading.join(timeout=60)
        elapsed = time.monotonic() - start
        assert result == [[0.0, 0.0] + [1.0] * 20]  # only the two slow calls score 0
        assert elapsed < 2 * (limit + 1.0) + 10
        assert not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE  # killed
        assert grading_pool.grade_many([_completion(a) for a in answers], answers) == [1.0] * 20


def test_pool_replaces_a_worker_that_died_while_idle() -> None:
    answers = [str(i) for i in range(10)]
    others = {w.pid for w in _workers()}
    with GradingPool(workers=2, timeout_s=TIMEOUT_S) as grading_pool:
        grading_pool.grade_many([_completion(a) for a in answers], answers)
        dead = _workers(others)[1]
        dead.kill()
        dead.wait(timeout=10)
        assert grading_pool.grade_many([_completion(a) for a in answers], answers) == [1.0] * 10


def test_pool_matches_grade_and_deduplicates() -> None:
    completions = [_completion("2"), _completion("3"), "garbage", _completion("2"), "\\boxed{2}"]
    golds = ["2", "2", "2", "2", "2"]
    with GradingPool(workers=2, timeout_s=5.0) as grading_pool:
        assert grading_pool.grade_many(completions, golds) == [
            grade(c, g) for c, g in zip(completions, golds, strict=True)
        ]
        assert grading_pool.grade_many([], []) == []
        with pytest.raises(ValueError, match="2 completions but 1"):
            grading_pool.grade_many(["a", "b"], ["1"])


def test_pool_grades_each_item_by_its_verifier() -> None:
    kk_answer = _completion("Oliver is a knight and Zoey is a knave")
    with GradingPool(workers=2, timeout_s=5.0) as grading_pool:
        scores = grading_pool.grade_many(
            [kk_answer, kk_answer, _completion("7"), _completion("7")],
            [KK_GOLD, KK_GOLD, "7", "7"],
            ["knights_knaves", "math", "math", "knights_knaves"],
        )
        assert scores == [1.0, 0.0, 1.0, 0.0]
        with pytest.raises(ValueError, match=r"unknown verifier\(s\) \['code'\]"):
            grading_pool.grade_many(["a"], ["1"], ["code"])
        with pytest.raises(ValueError, match="1 verifiers but 2 gold answers"):
            grading_pool.grade_many(["a", "b"], ["1", "2"], ["math"])


def test_the_deadline_fires_when_sigalrm_is_blocked():
    """A library can leave SIGALRM blocked in the main thread of a long-lived process; the alarm would then
    never arrive and a LaTeX bomb would run unbounded (seen in the full test session). The deadline unblocks
    it for the call and restores the mask. In a subprocess, so that a regression fails instead of hanging."""
    code = (
        "import signal, time\n"
        "from sage.data.verifiers import grade\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
        "t = time.monotonic()\n"
        "score = grade('<SOLUTION>10^{10^{10}}</SOLUTION>', '7', timeout_s=1.0)\n"
        "print(score, time.monotonic() - t, signal.SIGALRM in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    score, seconds, still_blocked = r.stdout.split()
    assert float(score) == 0.0 and float(seconds) < 10 and still_blocked == "True"


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # the dropped alarm, on purpose
def test_the_deadline_fires_when_its_alarm_lands_in_a_finaliser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python prints and drops an exception raised inside a finaliser (`__del__`, a weakref callback), so a
    one-shot alarm that lands while the garbage collector runs one is lost and the grade runs unbounded (the
    full test session hung in sympy this way). Here a finaliser runs across the deadline, so the first alarm
    lands in it for certain: the deadline must still end the call, by firing again until it is obeyed."""

    class SlowFinaliser:
        def __del__(self) -> None:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                pass

    give_up = time.monotonic() + 6.0  # bounded, so a regression fails instead of hanging

    def spins_past_a_finaliser(answer: str, gold: str) -> bool:
        SlowFinaliser()  # dropped at once: its __del__ runs here, past the 0.5 s deadline
        while time.monotonic() < give_up:
            pass
        return True  # reached only if the deadline never fired: scores 1.0

    monkeypatch.setitem(verifiers.VERIFIERS, "slow", spins_past_a_finaliser)
    handler_before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    assert grade_answer("7", "7", verifier="slow", timeout_s=0.5) == 0.0
    assert time.monotonic() - t0 < 2.0
    time.sleep(0.3)  # no alarm keeps firing after the call: it would raise here
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
