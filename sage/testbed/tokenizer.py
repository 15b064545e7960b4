"""Character-level tokenizers of the testbed models, built offline (one token per character):
the plain one (``model=tiny``) and a Qwen-style chat one (``model=tiny_chat``).

Two constraints shape it. TRL decodes completions with ``skip_special_tokens=True``, so the four format
tags must be ordinary (non-special) added tokens or the reward would never see them; pad/eos/bos are the
only special tokens. And each tag is one token, so a tag is one decision of the model rather than ~18
characters it could half-write.
"""

from __future__ import annotations

import string

from tokenizers import AddedToken
from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
TAGS = (WORK_START, WORK_END, SOLUTION_START, SOLUTION_END)
CHARS = "0123456789+-*= "
"""Every character the task and the teacher write; anything else maps to ``<unk>``."""
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_CHARS = CHARS + string.ascii_letters + ".,:;!?'\"()/\n"
"""The chat tokenizer also spells the system prompt and the role names, as a real chat model reads them."""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2.5's ChatML turns: a turn ends with ``<|im_end|>``, which is also the end-of-sequence token, so
generation stops at the end of the assistant's turn as it does for Qwen2.5-Math-7B."""


def build_tokenizer(chat: bool = False, markers: tuple[str, ...] = ()) -> Qwen2Tokenizer:
    """A fresh tokenizer; deterministic, so the vocabulary ids are the same on every build. ``chat``: the
    ChatML variant (letters, ``<|im_start|>``/``<|im_end|>`` special tokens, ``<|im_end|>`` as eos, a
    chat template); the plain vocabulary's ids are unchanged.

    It is a Qwen2Tokenizer (byte-level BPE without merges: one token per character) whose vocabulary is
    written in byte-level symbols, because that is what ``AutoTokenizer`` makes of the tokenizer of any
    Qwen2 model folder: TRL, vLLM and the evaluator all reload it from there, and a vocabulary in plain
    characters would lose every space and newline on the way (the byte-level pre-tokenizer turns a space
    into a symbol it would not find). Built as that class, the tokenizer the base model is trained with is
    the one everything else reads. A character outside the vocabulary has no token: the task writes none.

    ``markers``: more one-token tags after the format tags (the fork world's strategy markers), added the
    same way, so that the vocabulary of a world without them is unchanged.

    No BOS is added automatically: TRL tokenizes the prompt and the completion separately, and an
    automatic BOS would be inserted wherever anyone tokenizes a piece of completion text.
    """
    symbol = bytes_to_unicode()
    chars = CHAT_CHARS if chat else CHARS
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *(symbol[ord(c)] for c in chars)))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END if chat else EOS,
        bos_token=BOS,
        extra_special_tokens=[IM_START, IM_END] if chat else [],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*TAGS, *markers)])
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
