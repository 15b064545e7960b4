"""RL prompt sets and SFT sets beyond the testbed. Every loader returns a ``datasets.Dataset`` with the
columns TRL expects (RL: ``prompt`` and ``answer``; SFT: ``prompt`` and ``completion``) and fails with one
line naming the source, row and field when a row lacks a field."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from datasets import Dataset, load_dataset

from sage.data.prompts import (
    SOLUTION_END,
    SOLUTION_START,
    WORK_END,
    WORK_START,
    make_completion,
    make_prompt,
)

log = logging.getLogger(__name__)


def load_rows(source: str, split: str, subset: str | None = None) -> Dataset:
    """A local .jsonl/.json/.parquet/.csv file or a hub dataset id; a source with no rows is an error.
    ``subset``: the hub dataset's configuration (``load_dataset``'s ``name``); a local file is one table
    and has none, so it is not used there."""
    path = Path(source)
    if path.suffix in {".jsonl", ".json", ".parquet", ".csv"}:
        if not path.exists():
            raise FileNotFoundError(f"data source {source!r} does not exist")
        if path.suffix in {".jsonl", ".json"}:
            ds = Dataset.from_list(read_json_rows(path))
        else:
            ds = load_dataset(path.suffix[1:], data_files=str(path), split="train")
    else:
        name = check_subset(source, subset)  # before any download: a bad value is the user's, not the hub's
        try:
            ds = load_dataset(source, name, split=split)
        except Exception as e:  # offline, unknown id, private: all mean "cannot load this source"
            raise RuntimeError(
                f"data source {source!r} (split {split!r}) could not be loaded: {type(e).__name__}: {e}"
            ) from e
    if len(ds) == 0:
        raise ValueError(f"data source {source!r} holds no rows")
    return ds


def read_json_rows(path: Path) -> list[dict]:
    """The rows of a JSON lines file (one object per non-blank line) or a JSON list of objects, read here
    rather than by ``datasets``' JSON builder so that a malformed row is one line naming the file and line
    number (that builder reports neither) and nothing is cached for a file that fails."""
    from sage.data.benchmarks import read_utf8

    text = read_utf8(path)  # a byte that is not UTF-8: one line naming the file and row
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
        numbered = list(enumerate(rows, start=1))
        where = "row"
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number}: invalid JSON ({e.msg})") from None
        where = "line"
    for number, row in numbered:
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {where} {number}: expected a JSON object, got {type(row).__name__}")
    return [row for _, row in numbered]


HUB_SUBSETS = {
    # the dataset repo's create_dataset.py (commit 866c0f0): "all" is BytedTsinghua-SIA/DAPO-Math-17k
    # deduplicated by prompt, "en" its prompts without a Chinese character, "cn" those with one
    "open-r1/DAPO-Math-17k-Processed": ("all", "en", "cn"),
}
"""Configurations of the hub datasets sage's data options name, checked before any download."""


def check_subset(source: str, subset: str | None) -> str | None:
    """``subset`` if ``source`` has such a configuration (hub ids not listed in HUB_SUBSETS are left to the
    hub to check); else a one-line error naming ``data.subset``."""
    known = HUB_SUBSETS.get(source)
    if known is not None and subset not in known:
        raise ValueError(
            f"data.subset={subset!r} is not a configuration of {source} (one of: {', '.join(known)})"
        )
    return subset


def require_fields(ds: Dataset, fields: list[str], source: str) -> None:
    for f in fields:
        if f not in ds.column_names:
            raise ValueError(f"{source}: field {f!r} is missing (columns: {ds.column_names})")
        for i, v in enumerate(ds[f]):
            if v is None or (isinstance(v, str) and not v.strip()):
                raise ValueError(f"{source}: row {i} has no value for field {f!r}")


# The answer-format instruction the raw DAPO-Math-17k prompts carry around each problem. It asks for a last
# line "Answer: ...", which contradicts the system prompt's <SOLUTION> tags that the reward reads: a model
# that obeys it scores 0. The Processed set is meant to have it removed; a copy that still holds it (or the
# raw set given as data.source) has it stripped here, and the count is logged.
DAPO_INSTRUCTION_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_INSTRUCTION_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def strip_answer_instruction(problem: str) -> str:
    """``problem`` without DAPO's answer-format instruction (the problem text itself is kept whole)."""
    if problem.startswith(DAPO_INSTRUCTION_HEAD):
        problem = problem[len(DAPO_INSTRUCTION_HEAD) :]
    if problem.endswith(DAPO_INSTRUCTION_TAIL):
        problem = problem[: -len(DAPO_INSTRUCTION_TAIL)]
    return problem


def math_prompts(
    source: str,
    split: str,
    problem_field: str,
    answer_field: str,
    limit: int | None,
    chat: bool,
    subset: str | None = None,
) -> Dataset:
    """RL prompts (e.g. DAPO-Math-17k-Processed: fields ``prompt`` and ``solution``), first ``limit`` rows
    of the hub configuration ``subset`` (not used for a local file)."""
    ds = load_rows(source, split, subset)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    require_fields(ds, [problem_field, answer_field], source)
    problems = [strip_answer_instruction(p) for p in ds[problem_field]]
    stripped = sum(a != b for a, b in zip(problems, ds[problem_field], strict=True))
    if stripped:
        log.info("%s: the answer-format instruction removed from %d of %d prompts", source, stripped, len(ds))
    for i, p in enumerate(problems):
        if "Answer: $Answer" in p:  # a variant of the instruction this loader does not know how to remove
            raise ValueError(
                f"{source}: row {i} still asks for a last line 'Answer: $Answer', which contradicts the "
                "<SOLUTION> format the reward reads; remove the instruction from the data"
            )
    return Dataset.from_dict(
        {
            "prompt": [make_prompt(p, chat) for p in problems],
            "answer": [str(a) for a in ds[answer_field]],
        }
    )


def sft_dataset(source: str, split: str, max_prompt_length: int, chat: bool) -> Dataset:
    """OpenMathReasoning-mini style SFT data (Table 7): numeric answers only, prompt <= max_prompt_length
    characters, the solution rewritten into the paper's tag format."""
    ds = load_rows(source, split)
    require_fields(ds, ["problem", "generated_solution", "expected_answer"], source)
    prompts, completions = [], []
    for problem, solution, answer in zip(
        ds["problem"], ds["generated_solution"], ds["expected_answer"], strict=True
    ):
        try:
            float(str(answer).replace(",", ""))
        except ValueError:
            continue
        if len(problem) > max_prompt_length:
            continue
        thoughts = solution.split("</think>")[0].replace("<think>", "").strip()
        prompts.append(make_prompt(problem, chat))
        completions.append(
            make_completion(f"{WORK_START}{thoughts}{WORK_END}{SOLUTION_START}{answer}{SOLUTION_END}", chat)
        )
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def arith_sft_dataset(n: int, seed: int, chat: bool) -> Dataset:
    """Teacher traces of the testbed as an SFT set, to exercise the SFT stage offline."""
    from sage.data.arith import make_problems, teacher_completion

    rng = random.Random(seed)
    rows = make_problems("train", n, seed)
    return Dataset.from_dict(
        {
            "prompt": [make_prompt(r["problem"], chat) for r in rows],
            "completion": [
                make_completion(teacher_completion(r["a"], r["b"], r["c"], rng)[0], chat) for r in rows
            ],
        }
    )
