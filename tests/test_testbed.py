"""Tests of the embedded testbed: task splits, teacher, strategy classifier, tokenizer and model cache."""

from __future__ import annotations

import json
import operator
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import prefork
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage.config import ConfigError
from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START
from sage.testbed.model import BUILD_INFO_FILE, build_tiny_model, config_hash, lr_factor
from sage.testbed.task import (
    CARRY,
    GRADED_RULES,
    STRATEGIES,
    arith_dataset,
    classify_strategy,
    extract_answer,
    heldout_dataset,
    is_correct,
    make_problems,
    split_of,
    teacher_completion,
    tier_of,
)
from sage.testbed.tokenizer import TAGS, build_tokenizer

OPS = {"*": operator.mul, "+": operator.add, "-": operator.sub}
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "train_steps": 5,
    "batch_size": 8,
    "warmup_steps": 2,
    "n_train_problems": 50,
}


def _traces(n: int, seed: int = 0, **kwargs) -> list[tuple[dict, str, str]]:
    rng = random.Random(seed)
    problems = make_problems("train", n, seed)
    return [(p, *teacher_completion(p["a"], p["b"], p["c"], rng, **kwargs)) for p in problems]


def test_splits_are_disjoint_and_cover_the_problem_space() -> None:
    train = {p["problem"] for p in make_problems("train", 20000, 0)}
    heldout = {p["problem"] for p in make_problems("heldout", 3000, 0)}
    assert len(train) == 20000 and len(heldout) == 3000
    assert not train & heldout
    assert all(split_of(p["a"], p["b"], p["c"]) == "heldout" for p in make_problems("heldout", 200, 1))


def test_problems_are_deterministic_given_seed_and_well_formed() -> None:
    first = make_problems("heldout", 200, 0)
    assert first == make_problems("heldout", 200, 0)
    assert first != make_problems("heldout", 200, 1)
    for p in first:
        assert p["problem"] == f"{p['a']}*{p['b']}+{p['c']}="
        assert int(p["answer"]) == p["a"] * p["b"] + p["c"]
        assert 10 <= p["a"] <= 99 and 2 <= p["b"] <= 9 and 10 <= p["c"] <= 99


def test_make_problems_rejects_bad_requests() -> None:
    with pytest.raises(ValueError):
        make_problems("test", 1, 0)
    with pytest.raises(ValueError):
        make_problems("heldout", 10**6, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_teacher_is_correct_without_slips(strategy: str) -> None:
    probs = tuple(1.0 if s == strategy else 0.0 for s in STRATEGIES)
    for p, completion, used in _traces(2000, strategy_probs=probs, slip_rate=0.0):
        assert used == strategy
        assert completion.startswith(WORK_START) and completion.endswith(SOLUTION_END)
        assert extract_answer(completion) == p["answer"]
        for x, op, y, result in re.findall(r"(\d+)([*+-])(\d+)=(\d+)", completion):
            assert OPS[op](int(x), int(y)) == int(result)


def test_slip_rate_is_the_error_rate() -> None:
    traces = _traces(20000, slip_rate=0.1, strategy_probs=(1 / 3, 1 / 3, 1 / 3))
    wrong = sum(not is_correct(completion, p["answer"]) for p, completion, _ in traces) / len(traces)
    assert wrong == pytest.approx(0.1, abs=0.01)
    assert all(classify_strategy(completion) == used for _, completion, used in traces)


def test_strategy_frequencies_follow_the_probabilities() -> None:
    counts = Counter(used for _, _, used in _traces(20000))
    assert counts["direct"] / 20000 == pytest.approx(0.8, abs=0.015)
    assert counts["split"] / 20000 == pytest.approx(0.15, abs=0.015)
    assert counts["round"] / 20000 == pytest.approx(0.05, abs=0.01)


def test_classify_strategy_agrees_with_the_teacher() -> None:
    traces = _traces(5000, strategy_probs=(1 / 3, 1 / 3, 1 / 3), slip_rate=0.3)
    assert Counter(used for _, _, used in traces).keys() == set(STRATEGIES)
    assert all(classify_strategy(completion) == used for _, completion, used in traces)


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "305",
        f"{SOLUTION_START}305{SOLUTION_END}",
        f"{WORK_START}47*6=282{WORK_END}{SOLUTION_START}305{SOLUTION_END}",
        f"{WORK_START}47*6=282 282+23=305 1+1=2{WORK_END}{SOLUTION_START}305{SOLUTION_END}",
        f"{WORK_START}47*6=282 282-23=259{WORK_END}{SOLUTION_START}259{SOLUTION_END}",
        f"{WORK_START}47*6=282 282+23=305",
    ],
)
def test_classify_strategy_rejects_garbage(garbage: str) -> None:
    assert classify_strategy(garbage) == "other"


def test_extract_answer() -> None:
    assert extract_answer(f"x{SOLUTION_START} 305 {SOLUTION_END}") == "305"
    assert extract_answer(f"{SOLUTION_START}305") is None
    assert not is_correct("305", "305")


def test_datasets_have_prompt_and_answer_columns() -> None:
    train, heldout = arith_dataset(50, 0), heldout_dataset()
    assert train.column_names == ["prompt", "answer"] and heldout.column_names == ["prompt", "answer"]
    assert len(heldout) == 200
    assert not set(train["prompt"]) & set(heldout["prompt"])
    assert heldout[0]["prompt"] == make_problems("heldout", 1, 0)[0]["problem"]


def test_tokenizer_round_trip_keeps_tags_as_single_ordinary_tokens(tmp_path: Path) -> None:
    build_tokenizer().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    for tag in TAGS:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1
        assert ids[0] not in tokenizer.all_special_ids
    _, completion, _ = _traces(1, strategy_probs=(0.0, 0.0, 1.0))[0]
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert len(ids) == len(re.sub("|".join(map(re.escape, TAGS)), "T", completion))
    padded = [tokenizer.pad_token_id] * 3 + ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(padded, skip_special_tokens=True) == completion


def test_lr_schedule_warms_up_then_ends_at_the_floor() -> None:
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(99, 10, 100) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.slow
def test_model_cache_reuses_builds_and_separates_configs(tmp_path: Path) -> None:
    path = build_tiny_model(**TINY, cache_dir=str(tmp_path))
    info = Path(path, BUILD_INFO_FILE)
    first_mtime = info.stat().st_mtime_ns
    assert build_tiny_model(**TINY, cache_dir=str(tmp_path)) == path
    assert info.stat().st_mtime_ns == first_mtime
    other = build_tiny_model(**{**TINY, "seed": 1}, cache_dir=str(tmp_path))
    assert other != path
    builds = [p.name for p in Path(path).parent.iterdir() if not p.name.startswith(".")]  # not locks, tmp
    assert sorted(builds) == sorted([Path(path).name, Path(other).name])
    assert json.loads(info.read_text())["config"]["train_steps"] == TINY["train_steps"]


_COUNTED_BUILD = """
import os, sys
import sage.testbed.model as m
train = m._train
def counted(config):  # one line per training run, from whichever process runs it
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return train(config)
m._train = counted
print(m.build_tiny_model(**eval(sys.argv[3]), cache_dir=sys.argv[1]))
"""


@pytest.mark.slow
def test_concurrent_builds_train_once_and_share_the_result(tmp_path: Path) -> None:
    """Two jobs of a sweep on a cold cache: one trains, the other waits for it and loads its folder."""
    trained = tmp_path / "trained.txt"
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", _COUNTED_BUILD, str(tmp_path / "cache"), str(trained), repr(TINY)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    paths = [job.communicate(timeout=600)[0].strip().splitlines()[-1] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0]
    assert paths[0] == paths[1] and Path(paths[0], BUILD_INFO_FILE).is_file()
    assert len(trained.read_text().splitlines()) == 1


@pytest.mark.slow
def test_build_is_deterministic_given_seed(tmp_path: Path) -> None:
    first = build_tiny_model(**TINY, cache_dir=str(tmp_path / "a"))
    second = build_tiny_model(**TINY, cache_dir=str(tmp_path / "b"))
    other_seed = build_tiny_model(**{**TINY, "seed": 1}, cache_dir=str(tmp_path / "a"))
    weights = [Path(p, "model.safetensors").read_bytes() for p in (first, second, other_seed)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


@pytest.mark.slow
def test_built_model_loads_offline_with_consistent_special_tokens(tmp_path: Path) -> None:
    path = build_tiny_model(**TINY, cache_dir=str(tmp_path))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    inputs = tokenizer(["47*6+23=", "5*6+10="], return_tensors="pt", padding=True)
    out = model.generate(**inputs, do_sample=True, max_new_tokens=8)
    assert out.shape[0] == 2


@pytest.mark.parametrize("chat", [False, True])
def test_tokenizer_reloads_from_a_model_folder_as_built(tmp_path, chat):
    """TRL, vLLM and the evaluator load the testbed tokenizer with AutoTokenizer from the model folder,
    which for a Qwen2 model is a Qwen2Tokenizer: it must tokenize every prompt and teacher trace (spaces
    and newlines included) exactly as the tokenizer the base model was trained with."""
    import random

    from transformers import AutoTokenizer, Qwen2Config

    from sage.data.prompts import make_completion, make_prompt
    from sage.testbed.task import make_problems, teacher_completion
    from sage.testbed.tokenizer import build_tokenizer

    built = build_tokenizer(chat=chat)
    built.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(built)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    rng = random.Random(0)
    texts = []
    for p in make_problems("train", 50, seed=0):
        completion = teacher_completion(p["a"], p["b"], p["c"], rng)[0]
        if chat:
            messages = make_prompt(p["problem"], True) + make_completion(completion, True)
            texts.append(built.apply_chat_template(messages, tokenize=False))
        else:
            texts.append(p["problem"] + completion)
    assert any(" " in t for t in texts) and (not chat or any("\n" in t for t in texts))
    for text in texts:
        ids = built(text, add_special_tokens=False)["input_ids"]
        assert loaded(text, add_special_tokens=False)["input_ids"] == ids
        assert loaded.decode(ids) == built.decode(ids) == text
    assert (loaded.eos_token, loaded.pad_token, loaded.padding_side) == (
        built.eos_token,
        built.pad_token,
        "left",
    )


def test_graded_teacher_follows_its_tier_and_strategy_rule() -> None:
    """In the graded world a trace is wrong with the slip probability of its (tier, strategy) cell, or,
    for a CARRY cell, always and always the same way exactly when the units product carries: direct
    fails hard problems, and on tail problems only the rare ``round`` ever succeeds."""
    rng = random.Random(0)
    problems = make_problems("train", 20000, 0)
    wrong: Counter = Counter()
    seen: Counter = Counter()
    for p in problems:
        for _ in range(3):
            completion, strategy = teacher_completion(p["a"], p["b"], p["c"], rng, world="graded")
            assert classify_strategy(completion) == strategy
            rule = GRADED_RULES[tier_of(p["b"])][strategy]
            if rule == CARRY:
                carries = p["a"] % 10 * p["b"] >= 10
                dropped = p["a"] * p["b"] - p["a"] % 10 * p["b"] // 10 * 10 + p["c"]
                assert extract_answer(completion) == str(dropped if carries else int(p["answer"]))
                continue
            cell = (tier_of(p["b"]), strategy)
            seen[cell] += 1
            wrong[cell] += not is_correct(completion, p["answer"])
    for (tier, strategy), n in seen.items():
        rate = GRADED_RULES[tier][strategy]
        sd = (rate * (1 - rate) / n) ** 0.5
        assert abs(wrong[(tier, strategy)] / n - rate) <= 4 * sd + 1e-9, (tier, strategy, n)
    assert len(seen) == 6  # every slip cell was drawn
    assert [tier_of(b) for b in range(2, 10)] == ["easy"] * 4 + ["hard"] * 2 + ["tail"] * 2
    # the arith world ignores tiers: one slip rate everywhere
    rng = random.Random(1)
    tail = [p for p in problems if tier_of(p["b"]) == "tail"][:2000]
    ok = sum(is_correct(teacher_completion(p["a"], p["b"], p["c"], rng)[0], p["answer"]) for p in tail)
    assert ok / len(tail) > 0.9


def test_the_world_is_part_of_the_build_key_and_arith_keeps_the_old_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.source.world must be one of arith, graded, fork, got 'fl"):
        build_tiny_model(**TINY, world="flat", cache_dir=str(tmp_path))
    arith = Path(build_tiny_model(**TINY, world="arith", cache_dir=str(tmp_path)))
    graded = Path(build_tiny_model(**TINY, cache_dir=str(tmp_path)))
    assert arith != graded
    info = json.loads((arith / BUILD_INFO_FILE).read_text())["config"]
    assert "world" not in info  # builds made before the graded world existed are still found by their key
    assert arith.name == config_hash(info)
    assert json.loads((graded / BUILD_INFO_FILE).read_text())["config"]["world"] == "graded"


@pytest.mark.slow
def test_measure_reports_pass_at_k_per_tier_and_the_targets(tmp_path: Path) -> None:
    """The command prints each figure and, at k = 256, whether each base-model target is met."""
    from sage.eval.testbed_measure import targets

    ok = {"pass@1": 0.3, "pass@64": 0.7, "pass@256": 0.8}
    assert all(targets(ok).values())
    assert targets({**ok, "pass@1": 0.5}) == {
        "pass@1 in [0.2, 0.45]": False,
        "pass@256 in [0.75, 0.95]": True,
        "pass@256 > pass@64": True,
    }
    assert not targets({**ok, "pass@256": 0.7})["pass@256 > pass@64"]

    path = build_tiny_model(**TINY, cache_dir=str(tmp_path))
    args = ["--model-path", path, "--n-problems", "20", "--k", "256", "--entropy-k", "2"]
    r = prefork.run([sys.executable, "-m", "sage.eval.testbed_measure", *args], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    for name in ("pass@1", "pass@256", "easy_pass@1", "tail_pass@256", "strategy_direct"):
        assert 0 <= float(lines[name]) <= 1, name
    assert float(lines["token_entropy_q90"]) >= 0
    assert float(lines["pass@1"]) <= float(lines["pass@64"]) <= float(lines["pass@256"])
    assert lines["target pass@256 > pass@64"] in ("met", "NOT met")
