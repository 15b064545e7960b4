"""Character-level tokenizer of the testbed model, built offline from a ``tokenizers`` WordLevel model.

Two constraints shape it. TRL decodes completions with ``skip_special_tokens=True``, so the four format
tags must be ordinary (non-special) added tokens or the reward would never see them; pad/eos/bos are the
only special tokens. And each tag is one token, so a tag is one decision of the model rather than ~18
characters it could half-write.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sage.data.prompts import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
TAGS = (WORK_START, WORK_END, SOLUTION_START, SOLUTION_END)
CHARS = "0123456789+-*= "
"""Every character the task and the teacher write; anything else maps to ``<unk>``."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer; deterministic, so the vocabulary ids are the same on every build.

    No BOS is added automatically: TRL tokenizes the prompt and the completion separately, and an
    automatic BOS would be inserted wherever anyone tokenizes a piece of completion text.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
