"""Offline stand-ins for the tokenizers of the paper's chat models (their real ones cannot be downloaded
here): each model's published chat template and special tokens, stored with their sources in
``tests/data/chat_templates/<model>.json``, over a small vocabulary.

What decides how an SFT row is rendered and which tokens the loss covers is the template and the special
tokens, not the BPE merges. The stand-in is a Qwen2Tokenizer (byte-level BPE, as the real Qwen2.5 and
R1-Distill-Qwen vocabularies are) with no merges over printable ASCII: every character is one token, so
decoded spans compare exactly, and a saved copy reloads identically (``AutoTokenizer`` loads the tokenizer
of any Qwen2 model folder as a Qwen2Tokenizer, whose byte-level pre-tokenizer would drop the spaces and
newlines of a vocabulary not written in byte-level symbols).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

DATA = Path(__file__).resolve().parent / "data" / "chat_templates"
PAPER_CHAT_MODELS = (
    "qwen2.5-math-7b",
    "r1-distill-qwen-7b",
    "qwen2.5-math-1.5b-instruct",
    "qwen2.5-3b-instruct",
)
"""The paper's chat models: the options of conf/model/ with a hub source."""


def published(model: str) -> dict:
    """The stored chat template, special tokens and their sources of ``conf/model/<model>.yaml``."""
    return json.loads((DATA / f"{model}.json").read_text(encoding="utf-8"))


def build_chat_tokenizer(model: str) -> Qwen2Tokenizer:
    """A tokenizer with ``model``'s chat template and special tokens (bos/eos/pad as published, every other
    special token an additional special token as in tokenizer_config.json, the template's other markers
    single non-special tokens) over printable ASCII."""
    spec = published(model)
    byte_symbol = bytes_to_unicode()
    vocab = {byte_symbol[ord(c)]: i for i, c in enumerate(string.printable)}
    named = {spec[k] for k in ("bos_token", "eos_token", "pad_token")}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        bos_token=spec["bos_token"],
        eos_token=spec["eos_token"],
        pad_token=spec["pad_token"],
        extra_special_tokens=[t for t in spec["special_tokens"] if t not in named],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(spec["template_tokens"])
    tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def tiny_model(tokenizer, path: Path | None = None):
    """A randomly initialised two-layer Qwen2 over ``tokenizer``'s vocabulary, stopping (as the hub model
    does) on the tokenizer's eos; saved with the tokenizer to ``path`` when given, as a hub download is."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if path is not None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model


def real_chat_tokenizer(model: str):
    """The real Qwen2.5 tokenizer (151,936-token byte-level BPE, from the real pretrained model of
    ``model=qwen2.5-coder-0.5b-instruct``, converted into the model cache on first use) with ``model``'s
    published chat template and special tokens: the paper's Qwen models share this vocabulary, and
    R1-Distill-Qwen's is it with its own special tokens added."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    conf = Path(__file__).resolve().parents[1] / "conf" / "model" / "qwen2.5-coder-0.5b-instruct.yaml"
    tokenizer = AutoTokenizer.from_pretrained(instantiate(OmegaConf.load(conf).source))
    spec = published(model)
    missing = [t for t in spec["special_tokens"] if t not in tokenizer.get_vocab()]
    tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.add_tokens([t for t in spec["template_tokens"] if t not in tokenizer.get_vocab()])
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = (
        spec["bos_token"],
        spec["eos_token"],
        spec["pad_token"],
    )
    tokenizer.chat_template = spec["chat_template"]
    return tokenizer
