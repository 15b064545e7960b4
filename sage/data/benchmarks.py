"""Benchmark loaders: every benchmark becomes rows ``{"id", "problem", "answer", "verifier"}`` of strings.

Each benchmark stores its gold answer differently (a LaTeX string, a float, the last ``\\boxed{}`` of a
worked solution, a sentence); this module turns them all into the answer text that `sage.data.verifiers.grade`
compares against, and names the rule it compares by (``verifier``: Math-Verify for the maths benchmarks,
role assignments for Knights and Knaves), so the evaluator never needs to know where a problem came from.
Every row is checked for its required fields before anything is converted, and a bad row fails with one
line naming file, row and field rather than a KeyError deep inside an evaluation run. Every gold answer is
then graded against itself by the grader the rewards and evaluations use (`check_golds`): a problem on
which no answer could score is refused by file and row, never counted as a silent 0 for every method.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from sage.data.verifiers import DEFAULT_VERIFIER, knights_knaves_assignment, last_boxed_content

log = logging.getLogger(__name__)

Row = dict[str, str]
PathOrId = str | os.PathLike[str]
RawRow = Mapping[str, Any]


# The benchmark files shipped with the package (sage/data/math/PROVENANCE.md says where each comes from).
SHIPPED_MATH_DATA = Path(__file__).resolve().parent / "math"

# Each shipped file's hub dataset (id, split), named where the file is missing; PROVENANCE.md says how
# closely each matches the shipped file (not every hub copy has the fields the loader reads).
MATH_HUB_SOURCES: dict[str, tuple[str, str]] = {
    "math500.jsonl": ("HuggingFaceH4/MATH-500", "test"),
    "aime24.jsonl": ("HuggingFaceH4/aime_2024", "train"),
    "aime25.jsonl": ("yentinglin/aime_2025", "train"),
    "amc23.jsonl": ("FlippyDora/amc23", "train"),
    "minerva_math.jsonl": ("math-ai/minervamath", "test"),
}


def math_data(file: str) -> str:
    """Path of a benchmark file: ``$SAGE_MATH_DATA/<file>``, by default the copy shipped in
    ``sage/data/math``. A ``_target_`` rather than an interpolation so that every eval config composes and
    binds with no resolver registered first. A missing file is one line naming ``$SAGE_MATH_DATA`` and the
    file's hub dataset, before any model is built."""
    folder = Path(os.environ.get("SAGE_MATH_DATA") or SHIPPED_MATH_DATA)
    path = folder / file
    if not path.is_file():
        where = "$SAGE_MATH_DATA" if os.environ.get("SAGE_MATH_DATA") else "the shipped copy"
        hub = MATH_HUB_SOURCES.get(file)
        instead = f", or set the dataset's source to its hub id {hub[0]!r} (split {hub[1]!r})" if hub else ""
        raise FileNotFoundError(
            f"benchmark file not found: {path} ({where}); set $SAGE_MATH_DATA to a folder holding {file}"
            f"{instead}"
        )
    return str(path)


class SourcedRow(dict):
    """A row that knows where it was read (``where``: ``<file or hub id>: row <n>``), for a message about it
    later (a prompt longer than the model's context). The attribute is no part of the row's contents: the
    keys and digests made of rows do not change."""

    where: str = ""


class BenchmarkUnavailable(RuntimeError):
    """A hub dataset could not be loaded (no network, no access, unknown id). Never replaced silently by
    something else: an evaluation on the wrong data is worse than no evaluation."""


class _RowProblem(ValueError):
    """A problem with one row's content; `load_benchmark` adds the file and row number to the message."""


def _answer_text(value: Any) -> str:
    """Gold answer as text. Integral numbers lose their `.0` (AMC23 stores 27.0 for 27); other floats keep
    their positional decimal form (0.5, never 5e-01), which Math-Verify parses exactly."""
    if isinstance(value, bool):
        raise _RowProblem(f"answer {value!r} is a boolean, not an answer")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        number = float(value)
        return str(int(number)) if number.is_integer() else format(Decimal(repr(number)), "f")
    return str(value).strip()


def _plain_answer(row: RawRow) -> str:
    return _answer_text(row["answer"])


def _aime_answer(row: RawRow) -> str:
    """AIME answers are integers 0-999, written with leading zeros in some copies ("025")."""
    text = _answer_text(row["answer"])
    return str(int(text)) if text.isdigit() else text


def _minerva_answer(row: RawRow) -> str:
    """Minerva has no answer column: the gold answer is the last `\\boxed{}` of the worked solution."""
    boxed = last_boxed_content(str(row["solution"]))
    if boxed is None or not boxed.strip():
        raise _RowProblem("field 'solution' has no \\boxed{} answer")
    return boxed.strip()


def _knights_knaves_answer(row: RawRow) -> str:
    """The one-sentence-per-person solution ("(1) Zoey is a knave\\n(2) ..."), what K&K graders parse;
    checked here so that an unreadable gold answer fails at load time, not as a silent 0 when grading."""
    text = str(row["solution_text_format"]).strip()
    try:
        knights_knaves_assignment(text)
    except ValueError as error:
        raise _RowProblem(f"field 'solution_text_format': {error}") from None
    return text


def _level(value: Any) -> int | None:
    """MATH levels are ints in some copies and "Level 5" in others."""
    match = re.search(r"\d+", str(value))
    return int(match.group()) if match else None


@dataclass(frozen=True)
class _Spec:
    """How one benchmark's raw rows map to `Row`s."""

    id_field: str
    problem_field: str
    answer: Callable[[RawRow], str]
    # Checked on every row before conversion; includes the fields `answer` and `keep` read.
    required: tuple[str, ...]
    keep: Callable[[RawRow], bool] = lambda row: True
    # How answers are checked (a key of sage.data.verifiers.VERIFIERS), carried by every row as "verifier".
    verifier: str = DEFAULT_VERIFIER


_AIME = _Spec("id", "problem", _aime_answer, ("id", "problem", "answer"))

BENCHMARKS: dict[str, _Spec] = {
    "math500": _Spec("unique_id", "problem", _plain_answer, ("unique_id", "problem", "answer")),
    "math500_l5": _Spec(
        "unique_id",
        "problem",
        _plain_answer,
        ("unique_id", "problem", "answer", "level"),
        keep=lambda row: _level(row["level"]) == 5,
    ),
    # "aime" is AIME 2024 + 2025: pass both files (or hub ids) as a list of sources.
    "aime": _AIME,
    "aime24": _AIME,
    "aime25": _AIME,
    "amc23": _Spec("id", "problem", _plain_answer, ("id", "problem", "answer")),
    "minerva": _Spec("idx", "problem", _minerva_answer, ("idx", "problem", "solution")),
    # K-and-K/knights-and-knaves: subset "test" or "train", split "2ppl" ... "8ppl".
    "knights_knaves": _Spec(
        "index",
        "quiz",
        _knights_knaves_answer,
        ("index", "quiz", "solution_text_format"),
        verifier="knights_knaves",
    ),
}


def read_utf8(path: Path) -> str:
    """A data file's text; a byte that is not UTF-8 is one line naming the file, the row (a JSON lines
    file's line, a JSON list's element) and the byte, where Python's own error names neither file nor row."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        row = _row_of_bad_byte(raw) if path.suffix == ".json" else line
        byte = raw[error.start : error.start + 1].hex()
        raise ValueError(
            f"{path}: {f'row {row}' if row else f'line {line}'}: byte 0x{byte} (at byte {error.start} of the "
            f"file) is not UTF-8 ({error.reason}); save the file as UTF-8"
        ) from None


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    lines = read_utf8(path).replace("\r\n", "\n").replace("\r", "\n").split("\n")  # as text mode reads
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: row {number}: invalid JSON ({error.msg})") from None


def _read_json(path: Path) -> Iterator[tuple[int, Any]]:
    data = json.loads(read_utf8(path))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    yield from enumerate(data, start=1)


def _row_of_bad_byte(raw: bytes) -> int:
    """Which row of a JSON list holds the first byte that is not UTF-8: the file parsed with each such byte
    kept as a lone surrogate (surrogateescape), the first row whose text holds one; 0 where the list does not
    parse (the line is named instead)."""
    try:
        data = json.loads(raw.decode("utf-8", errors="surrogateescape"))
    except ValueError:
        return 0
    for number, row in enumerate(data if isinstance(data, list) else [], start=1):
        if re.search("[\udc80-\udcff]", json.dumps(row, ensure_ascii=False)):
            return number
    return 0


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pandas  # deferred: only parquet sources need it

    yield from enumerate(pandas.read_parquet(path).to_dict("records"), start=1)


_READERS: dict[str, Callable[[Path], Iterator[tuple[int, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def _read_hub(source: str, subset: str | None, split: str) -> list[tuple[int, Any]]:
    import datasets  # deferred: importing it costs seconds and local files do not need it

    try:
        dataset = datasets.load_dataset(source, subset, split=split)
    except Exception as error:
        reason = next(iter(str(error).strip().splitlines()), "") or type(error).__name__
        raise BenchmarkUnavailable(
            f"cannot load hub dataset {source!r} (subset={subset!r}, split={split!r}): {reason}"
        ) from error
    return list(enumerate(dataset, start=1))


def _read_source(source: PathOrId, subset: str | None, split: str) -> tuple[str, list[tuple[int, Any]]]:
    """(label, numbered raw rows): a local .jsonl/.json/.parquet file, else a hub dataset id."""
    path = Path(source)
    if path.suffix in _READERS:
        if not path.is_file():
            raise FileNotFoundError(f"benchmark file not found: {path}")
        return str(path), list(_READERS[path.suffix](path))
    if path.exists():
        raise ValueError(f"{path}: unsupported benchmark source; expected one of {', '.join(_READERS)}")
    return str(source), _read_hub(str(source), subset, split)


def _missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return isinstance(value, str) and not value.strip()


def _check_rows(label: str, rows: list[tuple[int, Any]], required: tuple[str, ...]) -> None:
    for number, raw in rows:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{label}: row {number}: expected an object, got {type(raw).__name__}")
        for field in required:
            if _missing(raw.get(field)):
                raise ValueError(f"{label}: row {number}: missing required field {field!r}")


def _to_row(spec: _Spec, raw: RawRow, id_prefix: str) -> Row:
    return {
        "id": f"{id_prefix}{raw[spec.id_field]}",
        "problem": str(raw[spec.problem_field]),
        "answer": spec.answer(raw),
        "verifier": spec.verifier,
    }


def load_benchmark(
    name: str,
    source: PathOrId | Sequence[PathOrId],
    *,
    split: str = "test",
    subset: str | None = None,
    limit: int | None = None,
) -> list[Row]:
    """Rows `{"id", "problem", "answer", "verifier"}` of benchmark `name` (a key of `BENCHMARKS`).

    `source` is a local .jsonl/.json/.parquet file or a hub id (`datasets.load_dataset(source, subset,
    split=split)`), or a list of them whose rows are concatenated in order: "aime" is
    `[aime24.jsonl, aime25.jsonl]`. Ids are the source's own id field, prefixed with the source (file
    path stem or hub id) when there are several sources, so they are stable and unique; duplicates raise.
    `limit` keeps the first rows after filtering (math500_l5 keeps level 5 only).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHMARKS))}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    spec = BENCHMARKS[name]
    sources = [source] if isinstance(source, str | os.PathLike) else list(source)
    if not sources:
        raise ValueError(f"no source given for benchmark {name!r}")
    loaded = [_read_source(s, subset, split) for s in sources]
    for label, rows in loaded:
        if not rows:
            raise ValueError(f"{label}: holds no rows")
        _check_rows(label, rows, spec.required)

    out: list[Row] = []
    for source_item, (label, rows) in zip(sources, loaded, strict=True):
        prefix = f"{_source_tag(source_item)}/" if len(sources) > 1 else ""
        for number, raw in rows:
            if not spec.keep(raw):
                continue
            try:
                row = SourcedRow(_to_row(spec, raw, prefix))
            except _RowProblem as problem:
                raise ValueError(f"{label}: row {number}: {problem}") from None
            row.where = f"{label}: row {number}"
            out.append(row)
    _check_unique_ids(name, out)
    out = out if limit is None else out[:limit]
    check_golds(out)
    return out


def _source_tag(source: PathOrId) -> str:
    """File stem ("aime24") for a file, the id itself for a hub dataset."""
    path = Path(source)
    return path.stem if path.suffix in _READERS else str(source)


def _check_unique_ids(name: str, rows: list[Row]) -> None:
    seen: set[str] = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(f"benchmark {name!r}: duplicate id {row['id']!r}")
        seen.add(row["id"])


GOLD_CHECKS = "gold_checks"
"""Folder of the cache (under sage.paths.cache_dir) of which gold answers grade correct against themselves."""
NAMED_ROWS = 10
"""The ungradable rows a refusal names one by one; the rest are counted."""


def check_golds(rows: list[Row]) -> None:
    """Every row's gold answer, boxed as a model would write it, must grade correct against itself through
    the grader (`sage.grading.self_graded`): where it does not, no method could ever score on the problem
    and its pass@k would be a silent 0 for all. Such rows are refused, in one line naming each one's file,
    row and id: a benchmark is graded as shipped or not at all, rather than quietly evaluated on fewer
    problems than its name says.

    The verdicts are cached under ``<cache>/gold_checks/`` by the content of the rows (id, gold, verifier)
    and the grader's fingerprint (its code and Math-Verify's and sympy's versions), so a benchmark is graded
    once per machine and grader, and any edit to a gold answer or to the grader grades it again."""
    from sage.grading import GradingPool, grader_fingerprint, self_graded
    from sage.paths import cache_dir, content_key

    if not rows:
        return
    graded = [[row["id"], row["answer"], row.get("verifier", DEFAULT_VERIFIER)] for row in rows]
    cache = (
        cache_dir() / GOLD_CHECKS / f"{content_key({'rows': graded, 'grader': grader_fingerprint()})}.json"
    )
    try:
        failed = json.loads(cache.read_text())["ungradable"]
    except (OSError, ValueError, KeyError, TypeError):
        # said before, not after: the first load of a large benchmark takes seconds
        log.info(
            "%s: grading each of its %d gold answers against itself (once: the verdicts are kept in %s)",
            _where_from(rows),
            len(rows),
            cache.parent,
        )
        with GradingPool(workers=2) as pool:
            ok = self_graded([g for _, g, _ in graded], [v for _, _, v in graded], pool)
        failed = [row_id for (row_id, _, _), good in zip(graded, ok, strict=True) if not good]
        _write_atomically(cache, json.dumps({"rows": len(rows), "ungradable": failed}))
    if failed:
        raise ValueError(_ungradable_line(rows, set(failed)))


def _where_from(rows: list[Row]) -> str:
    """The source(s) the rows were read from, for a log line: each `SourcedRow.where` without its row."""
    labels = dict.fromkeys(getattr(row, "where", "").rsplit(": row ", 1)[0] for row in rows)
    return ", ".join(label for label in labels if label) or "rows"


def _ungradable_line(rows: list[Row], failed: set[str]) -> str:
    """``<file>: row <n> (id, gold)[; ...]: gold answer(s) that do not grade ...``: every row named (the
    first `NAMED_ROWS`, then a count), its file first."""
    bad = [row for row in rows if row["id"] in failed]
    named = [
        f"{getattr(row, 'where', '') or 'row'} (id {row['id']!r}, gold {_short(row['answer'])!r})"
        for row in bad
    ]
    more = f" and {len(named) - NAMED_ROWS} more" if len(named) > NAMED_ROWS else ""
    verifiers = "/".join(sorted({row.get("verifier", DEFAULT_VERIFIER) for row in bad}))
    what = "its gold answer does" if len(bad) == 1 else f"each of these {len(bad)} gold answers does"
    return (
        f"{'; '.join(named[:NAMED_ROWS])}{more}: {what} not grade correct against itself (\\boxed{{<gold>}} "
        f"scores 0 under the {verifiers} verifier), so no answer could score on it; correct the gold answer "
        "or remove the row"
    )


def _short(text: str, keep: int = 60) -> str:
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"


def _write_atomically(path: Path, text: str) -> None:
    """``sage.durable.write_atomically`` (another process loading the same benchmark may read it at any time);
    a cache that cannot be written (a read-only home) only costs the check again next time."""
    from sage.durable import write_atomically

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except OSError as error:
        log.warning("could not cache the gold-answer check in %s: %s", path.parent, error)
