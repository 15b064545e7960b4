"""Model sources: each `model=` option's ``source`` target returns what ``from_pretrained`` takes."""

from __future__ import annotations

import os
from pathlib import Path


def from_hub(repo_id: str) -> str:
    """A hub model id, or a local model folder (``model.source.repo_id=/path``: a copy on the cluster's
    disk, an earlier run's checkpoint). Fails now, with the id named, if the hub is unreachable and the
    model is not cached, rather than deep inside TRL after datasets and configs have been built."""
    if Path(repo_id).is_dir():
        return str(Path(repo_id).resolve())
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        return snapshot_download(
            repo_id, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except LocalEntryNotFoundError as e:
        raise RuntimeError(
            f"model {repo_id!r} is not in the local hub cache and the hub is not reachable: {e}"
        ) from e
    except Exception as e:  # network errors come in many types; all mean the same thing to the user
        raise RuntimeError(
            f"model {repo_id!r} could not be fetched from the hub ({type(e).__name__}: {e})"
        ) from e


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the tokenizer's chat template closes an assistant turn with, read off the template
    itself: a chat model learns (in SFT) and emits this token at the end of its answer, so generation must
    stop on it. It is not always the tokenizer's eos: base Qwen2.5(-Math) ships eos ``<|endoftext|>`` (its
    pretraining document separator) with a ChatML template whose turns end in ``<|im_end|>``.

    None when the tokenizer has no chat template or the template closes a turn without a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "sage end-of-turn probe"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    tail = text[text.rindex(marker) + len(marker) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if not ids or ids[0] not in tokenizer.all_special_ids:
        return None
    return tokenizer.convert_ids_to_tokens(ids[0])


def policy_dtype(dtype: str, lora: bool) -> str:
    """The dtype the policy's weights are loaded in, given ``model.dtype`` and whether LoRA is on.

    Full fine-tuning (no LoRA) in a half-precision ``dtype`` loads float32 master weights instead and
    trains under TRL's autocast (``trl.bf16=true`` / ``trl.fp16=true``): an update of lr x grad ~ 5e-6 of
    a weight is below bfloat16's resolution (8 bits of mantissa, ~4e-3 relative), so half-precision
    weights would round most updates away. LoRA keeps the frozen base in ``dtype`` (it is never updated;
    peft keeps the trained adapter in float32 either way), which halves the base model's memory."""
    return "float32" if dtype in ("bfloat16", "float16") and not lora else dtype
