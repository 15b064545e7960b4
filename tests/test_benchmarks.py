"""Benchmark loaders on the real files: row counts, answer normalisation, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sage.data.benchmarks import SHIPPED_MATH_DATA, BenchmarkUnavailable, load_benchmark

# the shipped copy, or the folder $SAGE_MATH_DATA names (as the loader resolves it)
DATA_DIR = Path(os.environ.get("SAGE_MATH_DATA") or SHIPPED_MATH_DATA)
SOURCES: dict[str, Path | list[Path]] = {
    "math500": DATA_DIR / "math500.jsonl",
    "math500_l5": DATA_DIR / "math500.jsonl",
    "aime": [DATA_DIR / "aime24.jsonl", DATA_DIR / "aime25.jsonl"],
    "amc23": DATA_DIR / "amc23.jsonl",
    "minerva": DATA_DIR / "minerva_math.jsonl",
}


@pytest.mark.parametrize(
    ("name", "rows"), [("aime", 60), ("amc23", 40), ("math500", 500), ("math500_l5", 134), ("minerva", 272)]
)
def test_row_counts_and_unique_ids(name: str, rows: int) -> None:
    loaded = load_benchmark(name, SOURCES[name])
    assert len(loaded) == rows
    assert len({row["id"] for row in loaded}) == rows
    assert all(set(row) == {"id", "problem", "answer", "verifier"} for row in loaded)
    assert {row["verifier"] for row in loaded} == {"math"}
    assert all(isinstance(v, str) and v for row in loaded for v in row.values())


def test_ids_are_stable_and_say_which_aime() -> None:
    first = load_benchmark("aime", SOURCES["aime"])
    assert [r["id"] for r in first] == [r["id"] for r in load_benchmark("aime", SOURCES["aime"])]
    assert first[0]["id"] == "aime24/60" and first[-1]["id"].startswith("aime25/")


def test_math500_l5_is_the_level_5_subset() -> None:
    raw = [json.loads(line) for line in SOURCES["math500"].read_text().splitlines()]
    level5 = {r["unique_id"] for r in raw if r["level"] == 5}
    assert {r["id"] for r in load_benchmark("math500_l5", SOURCES["math500_l5"])} == level5


def test_amc23_float_answers_become_integers() -> None:
    rows = load_benchmark("amc23", SOURCES["amc23"])
    assert rows[0]["answer"] == "27"
    assert all("." not in r["answer"] for r in rows)


def test_non_integral_floats_keep_decimal_form(tmp_path: Path) -> None:
    path = tmp_path / "amc.jsonl"
    answers = [27.0, 2.5, -1.0, 1e-05]
    path.write_text(
        "".join(json.dumps({"id": i, "problem": "p", "answer": a}) + "\n" for i, a in enumerate(answers))
    )
    assert [r["answer"] for r in load_benchmark("amc23", path)] == ["27", "2.5", "-1", "0.00001"]


def test_minerva_answer_is_last_boxed_of_solution() -> None:
    rows = load_benchmark("minerva", SOURCES["minerva"])
    raw = json.loads(SOURCES["minerva"].read_text().splitlines()[0])
    assert "\\boxed{1.6}" in raw["solution"]
    assert rows[0]["answer"] == "1.6"
    assert not any("\\boxed" in r["answer"] for r in rows)


def test_minerva_nested_braces_and_missing_box(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"idx": 0, "problem": "p", "solution": r"\boxed{1}, then \boxed {\frac{1}{2}} cm"})
    )
    assert load_benchmark("minerva", good)[0]["answer"] == r"\frac{1}{2}"
    bad = tmp_path / "minerva.jsonl"
    rows = [
        {"idx": 0, "problem": "p", "solution": r"\boxed{1}"},
        {"idx": 1, "problem": "p", "solution": "no box"},
    ]
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"minerva\.jsonl: row 2: .*boxed") as error:
        load_benchmark("minerva", bad)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("missing", ["problem", "answer"])
def test_missing_field_is_one_line_naming_file_row_field(tmp_path: Path, missing: str) -> None:
    path = tmp_path / "bench.jsonl"
    rows = [{"id": i, "problem": f"p{i}", "answer": str(i)} for i in range(3)]
    if missing == "answer":
        rows[1]["answer"] = None  # a null counts as missing
    else:
        del rows[1]["problem"]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError) as error:
        load_benchmark("aime24", path)
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message and "row 2" in message and repr(missing) in message


def test_missing_field_detected_before_conversion(tmp_path: Path) -> None:
    """Row 3 lacks its box (a conversion error) but row 5 lacks a field: the field check runs first."""
    path = tmp_path / "m.jsonl"
    rows = [{"idx": i, "problem": "p", "solution": r"\boxed{1}"} for i in range(5)]
    rows[2]["solution"] = "unboxed"
    del rows[4]["problem"]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"row 5: missing required field 'problem'"):
        load_benchmark("minerva", path)


def test_duplicate_ids_and_unknown_names_raise(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join(json.dumps({"id": 1, "problem": "p", "answer": "1"}) for _ in range(2)))
    with pytest.raises(ValueError, match="duplicate id '1'"):
        load_benchmark("amc23", path)
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("gsm8k", path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark("amc23", tmp_path / "nope.jsonl")


def test_limit_applies_after_filtering(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    rows = [{"unique_id": str(i), "problem": "p", "answer": "1", "level": 5 - i % 2} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [r["id"] for r in load_benchmark("math500_l5", path, limit=2)] == ["0", "2"]


def test_unreachable_hub_id_is_a_clear_one_line_error() -> None:
    """Offline mode makes the failure immediate instead of 25 s of retries; the code path is the same."""
    script = (
        "from sage.data.benchmarks import load_benchmark\n"
        "load_benchmark('knights_knaves', 'K-and-K/knights-and-knaves', subset='test', split='3ppl')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(BenchmarkUnavailable.__name__) or "BenchmarkUnavailable" in last
    assert "K-and-K/knights-and-knaves" in last and "split='3ppl'" in last


# Two rows in the format of K-and-K/knights-and-knaves (subset "test"), with the fields the loader reads.
KK_ROWS = [
    {
        "index": 0,
        "quiz": "A very special island is inhabited only by knights and knaves. Knights always tell the "
        "truth "
        'and knaves always lie. You meet 2 inhabitants: Zoey, and Oliver. Zoey remarked, "Oliver is not a '
        'knight". Oliver stated, "Oliver is a knight if and only if Zoey is a knave". So who is a knight '
        "and who is a knave?",
        "names": ["Zoey", "Oliver"],
        "solution_text_format": "(1) Zoey is a knave\n(2) Oliver is a knight",
    },
    {
        "index": 1,
        "quiz": "... You meet 3 inhabitants: Mia Wong, Ella, and Jack. ...",
        "names": ["Mia Wong", "Ella", "Jack"],
        "solution_text_format": "(1) Mia Wong is a knight\n(2) Ella is a knave\n(3) Jack is a knight",
    },
]


def test_knights_knaves_rows_carry_their_verifier(tmp_path: Path) -> None:
    path = tmp_path / "kk.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in KK_ROWS))
    rows = load_benchmark("knights_knaves", path)
    assert [r["id"] for r in rows] == ["0", "1"]
    assert rows[0]["answer"] == "(1) Zoey is a knave\n(2) Oliver is a knight"
    assert {r["verifier"] for r in rows} == {"knights_knaves"}


def test_unreadable_knights_knaves_gold_fails_at_load_naming_the_row(tmp_path: Path) -> None:
    path = tmp_path / "kk.jsonl"
    bad = {**KK_ROWS[1], "solution_text_format": "(1) Mia Wong is a knight\n(2) Ella lies"}
    path.write_text("\n".join(json.dumps(r) for r in (KK_ROWS[0], bad)))
    with pytest.raises(ValueError) as error:
        load_benchmark("knights_knaves", path)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row 2: field 'solution_text_format'") and "'(2) Ella lies'" in message


# --- every gold answer grades correct against itself -----------------------------------------------------

SHIPPED = {**SOURCES, "aime24": DATA_DIR / "aime24.jsonl", "aime25": DATA_DIR / "aime25.jsonl"}


@pytest.mark.slow
def test_every_shipped_gold_answer_grades_correct_against_itself_at_load_and_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56: loading grades each gold, boxed as a model would write it, through the grading pool; every
    shipped benchmark loads (none of its 872 golds is unsolvable). A second load reads the verdicts from the
    cache, keyed by the rows' content: no pool is started."""
    import time

    import sage.grading

    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    start = time.monotonic()
    loaded = {name: load_benchmark(name, source) for name, source in SHIPPED.items()}
    first = time.monotonic() - start
    with capsys.disabled():
        print(f"\n[golds] {sum(map(len, loaded.values()))} rows of {len(SHIPPED)} benchmarks: {first:.1f} s")
    checks = list((tmp_path / "cache" / "gold_checks").glob("*.json"))
    assert len(checks) == len(SHIPPED)
    assert {json.loads(c.read_text())["ungradable"] == [] for c in checks} == {True}

    def no_pool(*args, **kwargs):
        raise AssertionError("a cached benchmark was graded again")

    monkeypatch.setattr(sage.grading, "GradingPool", no_pool)
    assert {name: load_benchmark(name, source) for name, source in SHIPPED.items()} == loaded


def test_a_gold_that_cannot_grade_correct_is_refused_naming_file_row_and_id(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    rows = [{"unique_id": "fine", "problem": "p", "answer": "\\frac{1}{2}"}]
    rows += [{"unique_id": f"bad{i}", "problem": "p", "answer": "x^{2"} for i in range(2)]  # unbalanced
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as error:
        load_benchmark("math500", path)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row 2 (id 'bad0', gold 'x^{{2'); {path}: row 3 (id 'bad1', ")
    assert "each of these 2 gold answers does not grade correct against itself" in message
    assert message.endswith("correct the gold answer or remove the row")
    with pytest.raises(ValueError, match="row 2 "):  # the verdict comes from the cache the same
        load_benchmark("math500", path)
    path.write_text(json.dumps(rows[0]) + "\n")  # the file corrected: its content is checked anew
    assert [r["id"] for r in load_benchmark("math500", path)] == ["fine"]


def test_a_gold_longer_than_the_answer_cap_is_solvable() -> None:
    """Issue 56: answers were capped at 1,000 characters, so a 1,729-character matrix gold scored 0 for
    its own text. The cap is now grading.max_answer_chars, or twice the gold where that is longer."""
    from sage.data.verifiers import MAX_ANSWER_CHARS, answer_limit, grade

    gold = (
        "\\begin{pmatrix} "
        + " \\\\ ".join(" & ".join(f"\\frac{{{7 * i + j}}}{{{j + 2}}}" for j in range(12)) for i in range(12))
        + " \\end{pmatrix}"
    )
    assert len(gold) > MAX_ANSWER_CHARS
    assert grade(f"\\boxed{{{gold}}}", gold, timeout_s=30) == 1.0
    assert grade(f"\\boxed{{{gold.replace('frac', 'dfrac')}}}", gold, timeout_s=30) == 1.0
    assert grade(f"\\boxed{{{gold}}}", gold, max_chars=10) == 1.0  # the cap never makes a gold unsolvable
    short = "7"
    assert answer_limit(short) == MAX_ANSWER_CHARS == 1000
    padded = "7" + " " * 1000  # equivalent, but longer than the cap: not given to sympy
    assert grade(f"\\boxed{{{padded}}}", short) == 0.0
    assert grade(f"\\boxed{{{padded}}}", short, max_chars=2000) == 1.0
