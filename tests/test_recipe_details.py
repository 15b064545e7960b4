"""Details of the paper's recipe (issue 13, item 10): the end-of-turn token a chat SFT stage must stop
generation on, the DAPO-Math-17k language subset, and float32 master weights for full fine-tuning."""

import json
from pathlib import Path

import pytest
import torch
import trl
from chat_tokenizers import build_chat_tokenizer, tiny_model
from datasets import Dataset
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage.config import ConfigError, register_configs
from sage.data import datasets as sage_datasets
from sage.eval.sampling import HFSampler
from sage.models import policy_dtype
from sage.targets import instantiate_node
from sage.train.main import grpo_args, lora_config
from sage.train.sft import run_sft

CONF = Path(__file__).resolve().parents[1] / "conf"
DAPO = "open-r1/DAPO-Math-17k-Processed"
register_configs()


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


# ---------------------------------------------------------------- end of turn of base Qwen2.5-Math


@pytest.mark.slow
def test_sft_stage_makes_base_qwen_math_stop_at_im_end(tmp_path, monkeypatch):
    """Base Qwen2.5-Math's tokenizer ends sequences with <|endoftext|> while its ChatML template ends turns
    with <|im_end|>. After sage's chat SFT stage the labels end the turn with <|im_end|>, and the merged
    model's tokenizer and generation_config stop there, so RL rollouts, vLLM and the evaluator stop where
    the model ends its answer."""
    tok = build_chat_tokenizer("qwen2.5-math-7b")
    assert (tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|endoftext|>")
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    base = tmp_path / "base"
    tiny_model(tok, base)
    assert json.loads((base / "generation_config.json").read_text())["eos_token_id"] == endoftext

    trainers = []

    class Recording(trl.SFTTrainer):  # the trainer sage's SFT stage builds, kept for its labels
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(trl, "SFTTrainer", Recording)
    c = compose_cfg(
        "model=tiny_chat",  # chat SFT rows, LoRA, merged: the qwen2.5-math-7b path
        "model.sft.data.n=4",
        "model.sft.args.max_steps=1",
        "model.sft.args.max_length=1024",  # whole rows: the system prompt alone is ~250 characters
    )
    merged = Path(run_sft(c, str(base), tmp_path / "sft", lora_config(c)))

    (trainer,) = trainers
    for row in trainer.train_dataset:
        covered = [t for t in row["labels"] if t != -100]
        assert tok.decode(covered).endswith("</SOLUTION><|im_end|>\n")  # the turn's end, trained on
        assert endoftext not in row["input_ids"]
    stops = json.loads((merged / "generation_config.json").read_text())["eos_token_id"]
    assert im_end in (stops if isinstance(stops, list) else [stops])
    assert AutoTokenizer.from_pretrained(merged).eos_token == "<|im_end|>"

    sampler = HFSampler(AutoModelForCausalLM.from_pretrained(merged), tok, batch_size=1)
    assert im_end in sampler.eos.tolist()  # our evaluator stops on it too


# ---------------------------------------------------------------- DAPO-Math-17k language subset


def test_dapo_math_selects_the_english_subset():
    assert compose_cfg("data=dapo_math_17k").data.subset == "en"


@pytest.mark.parametrize("subset", ["fr", None])
def test_dapo_math_subset_outside_the_dataset_is_one_line(subset):
    with pytest.raises(ValueError) as e:
        sage_datasets.math_prompts(DAPO, "train", "prompt", "solution", 10, True, subset=subset)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.subset={subset!r}") and "all, en, cn" in msg
    c = compose_cfg("data=dapo_math_17k", f"data.subset={'null' if subset is None else subset}")
    with pytest.raises(ConfigError, match="data.subset"):  # as sage-train meets it, before any download
        instantiate_node(c.data, chat=True)


def test_hub_subset_reaches_load_dataset_and_a_local_file_has_none(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs.get("split")))
        return Dataset.from_dict({"prompt": ["1+1=", "2+2="], "solution": ["2", "4"]})

    monkeypatch.setattr(sage_datasets, "load_dataset", fake_load_dataset)
    ds = sage_datasets.math_prompts(DAPO, "train", "prompt", "solution", 1, True, subset="cn")
    assert calls == [(DAPO, "cn", "train")] and ds["answer"] == ["2"]
    monkeypatch.undo()

    local = tmp_path / "prompts.jsonl"
    local.write_text('{"prompt": "3+3=", "solution": "6"}\n')
    ds = sage_datasets.math_prompts(str(local), "train", "prompt", "solution", None, False, subset="en")
    assert ds["prompt"] == ["3+3="]  # a local file is read as it is, whatever the subset


# ---------------------------------------------------------------- float32 master weights


def test_bf16_weights_lose_an_update_of_5e_6_float32_keeps_it():
    w = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 0.02  # a layer's weights
    update = 5e-6 * w  # lr 5e-6 times a gradient of the weight's own size (Adam's normalised step)
    assert torch.equal(w.bfloat16() + update.bfloat16(), w.bfloat16())  # every update rounded away
    assert (w + update != w).all()  # float32 keeps every one


def test_full_fine_tuning_loads_float32_master_weights_lora_keeps_bf16(tmp_path):
    assert policy_dtype("bfloat16", lora=False) == "float32"
    assert policy_dtype("float16", lora=False) == "float32"
    assert policy_dtype("bfloat16", lora=True) == "bfloat16"
    assert policy_dtype("float32", lora=True) == "float32"
    # what sage-train hands TRL for the paper's full fine-tuning and LoRA models (model.dtype bfloat16)
    full = compose_cfg("model=qwen2.5-3b-instruct")
    lora = compose_cfg("model=qwen2.5-math-7b")
    assert (full.model.dtype, full.model.lora) == ("bfloat16", None)
    assert (lora.model.dtype, lora.model.lora is not None) == ("bfloat16", True)
    assert grpo_args(full, tmp_path / "full").model_init_kwargs["dtype"] == "float32"
    assert grpo_args(lora, tmp_path / "lora").model_init_kwargs["dtype"] == "bfloat16"


def test_dapo_answer_instruction_is_removed_from_prompts(tmp_path, caplog):
    """A DAPO-Math prompt that still carries its "Answer: $Answer" instruction would ask for a last line the
    reward never reads (it reads the <SOLUTION> tags of the system prompt): the instruction is stripped,
    the problem kept whole, the count logged; an unknown variant of it is one line naming the row."""
    import json
    import logging

    problem = "Find $x$ if $2x = 6$."
    raw = sage_datasets.DAPO_INSTRUCTION_HEAD + problem + sage_datasets.DAPO_INSTRUCTION_TAIL
    local = tmp_path / "dapo.jsonl"
    local.write_text(
        json.dumps({"prompt": raw, "solution": "3"})
        + "\n"
        + json.dumps({"prompt": "1+1=", "solution": "2"})
        + "\n"
    )
    with caplog.at_level(logging.INFO, logger="sage.data.datasets"):
        ds = sage_datasets.math_prompts(str(local), "train", "prompt", "solution", None, False)
    assert ds["prompt"] == [problem, "1+1="]
    assert "instruction removed from 1 of 2 prompts" in caplog.text

    local.write_text(
        json.dumps({"prompt": f"{problem}\nAnswer: $Answer on the last line", "solution": "3"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"dapo.jsonl: row 0 still asks for a last line 'Answer: \$Answer'"):
        sage_datasets.math_prompts(str(local), "train", "prompt", "solution", None, False)
