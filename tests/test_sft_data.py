"""SFT rows of a chat model go through TRL's own SFT tokenisation: a chat prompt gets an assistant-message
completion (TRL joins the two; a plain-string completion beside a message list was a TypeError), and the
loss covers exactly the assistant turn, end-of-turn token included: for the testbed's tiny_chat and for
each of the paper's chat models, whose published chat templates and special tokens are stored in
tests/data/chat_templates/ (their tokenizers cannot be downloaded here; see chat_tokenizers.py)."""

import json

import pytest
from chat_tokenizers import (
    PAPER_CHAT_MODELS,
    build_chat_tokenizer,
    published,
    real_chat_tokenizer,
    tiny_model,
)
from trl import SFTConfig, SFTTrainer

from sage.data.datasets import arith_sft_dataset, sft_dataset
from sage.models import end_of_turn_token
from sage.testbed.model import build_tiny_model
from sage.testbed.tokenizer import build_tokenizer

ROWS = [
    {"problem": "12+30=", "generated_solution": "<think>12+30=42</think>42", "expected_answer": "42"},
    {"problem": "7*6=", "generated_solution": "<think>7*6=42</think>", "expected_answer": "forty"},
]
END_OF_TURN = {  # what each published template closes an assistant turn with
    "qwen2.5-math-7b": "<|im_end|>",  # not its eos (<|endoftext|>): see test_sft_stop.py
    "qwen2.5-math-1.5b-instruct": "<|im_end|>",
    "qwen2.5-3b-instruct": "<|im_end|>",
    "r1-distill-qwen-7b": "<｜end▁of▁sentence｜>",
}


def tokenised(dataset, tokenizer, tmp_path, chat=False, model=None, max_length=512):
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", max_length=max_length, bf16=False)
    trainer = SFTTrainer(
        model=model or build_tiny_model(chat=chat, world="arith"),  # model=tiny_sft and tiny_chat's base
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    return trainer.train_dataset


def sft_rows(tmp_path):
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return sft_dataset(str(src), "train", max_prompt_length=100, chat=True)


def split_by_loss(tokenizer, row) -> tuple[str, str]:
    """(the text the loss ignores, the text it covers), decoded with the special tokens."""
    ids, mask = row["input_ids"], [label != -100 for label in row["labels"]]
    covered = [i for i, m in zip(ids, mask, strict=True) if m]
    assert covered == ids[len(ids) - len(covered) :]  # one span, at the end
    return tokenizer.decode(ids[: len(ids) - len(covered)]), tokenizer.decode(covered)


def test_chat_sft_rows_pass_trls_tokenisation(tmp_path):
    ds = sft_rows(tmp_path)
    assert len(ds) == 1  # the non-numeric answer is dropped
    assert ds[0]["completion"][0]["role"] == "assistant" and ds[0]["prompt"][-1]["role"] == "user"
    tok = build_tokenizer(chat=True)  # model=tiny_chat's: Qwen2.5's ChatML turns
    row = tokenised(ds, tok, tmp_path, chat=True)[0]
    ids, mask = row["input_ids"], [label != -100 for label in row["labels"]]  # what the loss covers
    completion = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    prompt = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert completion.startswith("<start_working_out>12+30=42<end_working_out><SOLUTION>42</SOLUTION>")
    assert "<|im_end|>" in completion  # the model learns to end its turn
    # system, user, and the assistant header the model answers after
    assert prompt.count("<|im_start|>") == 3 and prompt.endswith("12+30=<|im_end|>\n<|im_start|>assistant\n")
    assert "<unk>" not in prompt + completion


def test_bare_text_sft_rows_stay_strings(tmp_path):
    ds = arith_sft_dataset(n=4, seed=0, chat=False)
    assert all(isinstance(c, str) for c in ds["completion"])
    row = tokenised(ds, build_tokenizer(), tmp_path)[0]
    assert 0 < sum(label != -100 for label in row["labels"]) < len(row["input_ids"])


@pytest.mark.parametrize("model", PAPER_CHAT_MODELS)
def test_paper_chat_models_sft_rows(tmp_path, model):
    """Each paper chat model's SFT rows, rendered by its published template through TRL's SFT tokenisation:
    the loss covers exactly the assistant's answer and the template's end of the turn, which is the
    model's end-of-turn token, the one sage's SFT stage makes generation stop on."""
    tok = build_chat_tokenizer(model)
    ds = sft_rows(tmp_path)
    assert len(ds) == 1
    row = tokenised(ds, tok, tmp_path, model=tiny_model(tok))[0]
    ignored, covered = split_by_loss(tok, row)

    answer = ds[0]["completion"][0]["content"]
    rendered = tok.apply_chat_template(ds[0]["prompt"] + ds[0]["completion"], tokenize=False)
    start = rendered.rindex(answer)
    # the turn and nothing else; decoding back to the rendered text also shows no character was lost
    assert (ignored, covered) == (rendered[:start], rendered[start:])

    eot = END_OF_TURN[model]
    assert end_of_turn_token(tok) == eot
    closing = covered[len(answer) :]  # what the template writes after the answer
    assert closing.startswith(eot) and not closing[len(eot) :].strip()  # (Qwen: a newline follows)
    assert tok.convert_tokens_to_ids(eot) in row["input_ids"][-2:]  # one token, not characters

    # the context trained on is the inference prompt (generation prompt included), except for the
    # published R1-Distill template, which prefills "<think>\n" at inference but writes no such text
    # before a stored assistant answer: TRL then trains on the context without it
    at_inference = tok.apply_chat_template(ds[0]["prompt"], tokenize=False, add_generation_prompt=True)
    prefill = "<think>\n" if model == "r1-distill-qwen-7b" else ""
    assert at_inference == ignored + prefill
    assert published(model)["sources"]  # stored values carry where they were read


def long_and_short_rows(tmp_path) -> str:
    """OpenMathReasoning-style rows whose worked solutions range from a line to far beyond max_length."""
    rows = [
        {
            "problem": f"What is {i} + {i}?",
            "generated_solution": "<think>"
            + " ".join(f"step {j}: {i} + {i} = {2 * i}." for j in range(i * 12))
            + "</think>",
            "expected_answer": str(2 * i),
        }
        for i in range(1, 9)
    ]
    src = tmp_path / "long.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(src)


@pytest.mark.parametrize("model", PAPER_CHAT_MODELS)
def test_sft_keeps_only_whole_conversations(tmp_path, model, caplog):
    """Rows longer than max_length are dropped before TRL sees them (TRL would cut their end): every kept
    row, as TRL's own SFT tokenisation makes it, fits max_length and ends with the answer's closing tag and
    the template's end-of-turn token; our length count is TRL's exactly; the drop is logged."""
    check_whole_conversations(build_chat_tokenizer(model), model, tmp_path, caplog)


@pytest.mark.slow  # converts the real model into the model cache on first use (cached after)
@pytest.mark.parametrize("model", PAPER_CHAT_MODELS)
def test_sft_keeps_only_whole_conversations_under_the_real_qwen_tokenizer(tmp_path, model, caplog):
    """The same, tokenised by the real 151,936-token Qwen2.5 BPE with each paper model's template: real
    merges give other lengths than the one-character-per-token stand-in, and lengths are what decide."""
    check_whole_conversations(real_chat_tokenizer(model), model, tmp_path, caplog)


def check_whole_conversations(tok, model, tmp_path, caplog):
    import logging

    from sage.train.sft import conversation_length, keep_whole_rows

    rows = sft_dataset(long_and_short_rows(tmp_path), "train", max_prompt_length=100, chat=True)
    untruncated = tokenised(rows, tok, tmp_path, model=tiny_model(tok), max_length=None)
    lengths = [len(r["input_ids"]) for r in untruncated]
    assert [conversation_length(tok, r) for r in rows] == lengths  # TRL's tokenisation, counted the same
    max_length = sorted(lengths)[len(lengths) // 2]  # half the rows are too long
    assert max(lengths) > max_length

    with caplog.at_level(logging.INFO, logger="sage.train.sft"):
        kept = keep_whole_rows(rows, tok, max_length)
    dropped = sum(n > max_length for n in lengths)
    assert 0 < len(kept) == len(rows) - dropped
    assert f"{len(kept)} of {len(rows)} rows kept; {dropped} dropped" in caplog.text

    eot = END_OF_TURN[model]
    for row in tokenised(kept, tok, tmp_path, model=tiny_model(tok), max_length=max_length):
        assert len(row["input_ids"]) <= max_length
        _, covered = split_by_loss(tok, row)
        assert covered.rstrip("\n").endswith("</SOLUTION>" + eot)


def test_sft_max_length_that_no_row_fits_is_one_line(tmp_path):
    from sage.train.sft import keep_whole_rows

    rows = sft_dataset(long_and_short_rows(tmp_path), "train", max_prompt_length=100, chat=True)
    with pytest.raises(ValueError, match=r"^model\.sft\.args\.max_length=8: no SFT row fits \(shortest: \d+"):
        keep_whole_rows(rows, build_tokenizer(chat=True), 8)


@pytest.mark.parametrize(
    ("per_device", "accumulation", "processes", "expected"),
    [
        (1, 1, 1, (1, 1)),
        (1, 1, 8, None),  # Table 7's batch of 1 cannot be shared by 8 GPUs: the main process trains it
        (1, 8, 8, (1, 1)),
        (1, 16, 8, (1, 2)),
        (8, 1, 2, (4, 1)),  # the micro-batch shrinks rather than the step growing
        (4, 3, 2, (2, 3)),
        (3, 2, 4, None),
        (6, 2, 4, (3, 1)),
    ],
)
def test_sft_batch_split_keeps_the_effective_batch(per_device, accumulation, processes, expected):
    from sage.train.sft import split_batch

    split = split_batch(per_device, accumulation, processes)
    assert split == expected
    if split is not None:
        micro, acc = split
        assert micro * acc * processes == per_device * accumulation and micro <= per_device
