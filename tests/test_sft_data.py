"""SFT rows of a chat model go through TRL's own SFT tokenisation: a chat prompt gets an assistant-message
completion (TRL joins the two; a plain-string completion beside a message list was a TypeError), and the
loss covers exactly the assistant turn, end-of-turn token included."""

import json

from trl import SFTConfig, SFTTrainer

from sage.data.datasets import arith_sft_dataset, sft_dataset
from sage.testbed.model import build_tiny_model
from sage.testbed.tokenizer import build_tokenizer


def tokenised(dataset, tokenizer, tmp_path, chat=False):
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", max_length=512, bf16=False)
    trainer = SFTTrainer(
        model=build_tiny_model(chat=chat), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    return trainer.train_dataset


def test_chat_sft_rows_pass_trls_tokenisation(tmp_path):
    src = tmp_path / "sft.jsonl"
    rows = [
        {"problem": "12+30=", "generated_solution": "<think>12+30=42</think>42", "expected_answer": "42"},
        {"problem": "7*6=", "generated_solution": "<think>7*6=42</think>", "expected_answer": "forty"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = sft_dataset(str(src), "train", max_prompt_length=100, chat=True)
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
