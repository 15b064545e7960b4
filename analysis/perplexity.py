"""Perplexity of a model's samples under the base model (Figure 7):

    PPL(y | x) = exp( -(1/|y|) sum_t log pi_base(y_t | x, y_<t) )

The prompt x is rebuilt exactly as evaluation built it (``sage.eval.evaluate.prompt_texts`` on the rows of the
run's own ``eval.datasets`` config, first ``eval.limit``), tokenised without special tokens as the sampler
did. The completion is re-tokenised from its text (the artifact stores text; the sampler dropped the end
token), so y has no end-of-sequence token. Empty completions have no perplexity and are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


@torch.no_grad()
def completion_perplexities(
    model, tokenizer, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 32
) -> np.ndarray:
    """PPL of each completion given its prompt text; NaN for an empty completion."""
    out = np.full(len(prompts), np.nan)
    encoded = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        if c_ids:
            encoded.append((i, p_ids, c_ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(p) + len(c) for _, p, c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # (B, T), right-padded
        attn = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)  # (B, T): positions holding a completion token
        for b, (_, p, c) in enumerate(chunk):
            ids[b, : len(p) + len(c)] = torch.tensor(p + c)
            attn[b, : len(p) + len(c)] = 1
            target[b, len(p) : len(p) + len(c)] = True
        logits = model(input_ids=ids.to(model.device), attention_mask=attn.to(model.device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): predicts tokens 1..T-1
        tok_logp = logp.gather(-1, ids[:, 1:, None].to(model.device)).squeeze(-1).cpu()  # (B, T-1)
        mask = target[:, 1:]  # (B, T-1)
        nll = -(tok_logp * mask).sum(-1) / mask.sum(-1)  # (B,)
        for b, (i, _, _) in enumerate(chunk):
            out[i] = float(torch.exp(nll[b]))
    return out


def load_base(path: str, dtype: str = "float32"):
    """(model, tokenizer) of the base model in eval mode on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, tokenizer
