"""Character-level tokenizers of the testbed models, built offline from a ``tokenizers`` WordLevel model:
the plain one (``model=tiny``) and a Qwen-style chat one (``model=tiny_chat``).

Two constraints shape it. TRL decodes completions with ``skip_special_tokens=True``, so the four format
tags must be ordinary (non-special) added tokens or the reward would never see them; pad/eos/bos are the
only special tokens. And each tag is one token, so a tag is one decision of the model rather than ~18
characters it could half-write.
"""

from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


def build_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    """A fresh tokenizer; deterministic, so the vocabulary ids are the same on every build. ``chat``: the
    ChatML variant (letters, ``<|im_start|>``/``<|im_end|>`` special tokens, ``<|im_end|>`` as eos, a
    chat template); the plain vocabulary's ids are unchanged.

    No BOS is added automatically: TRL tokenizes the prompt and the completion separately, and an
    automatic BOS would be inserted wherever anyone tokenizes a piece of completion text.
    """
    specials = (*SPECIAL_TOKENS, IM_START, IM_END) if chat else SPECIAL_TOKENS
    # "." matches any character but a newline; the chat vocabulary's "\n" must be a token of its own too
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *(CHAT_CHARS if chat else CHARS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]" if chat else "."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=IM_END if chat else EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
