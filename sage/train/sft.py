"""The SFT stage: LoRA (or full) supervised fine-tuning of a base model, merged and saved as the RL start.

The merged SFT model is both the RL start and the reference policy (TRL then uses a disabled adapter or a
copy of these weights), never the pre-SFT base. ``model.sft.args`` is TRL's ``SFTConfig`` with its own
keys; this module supplies only the output folder, the checkpoint policy and the model's dtype.

The stage is a function of (base model, SFT data, SFT args, LoRA, dtype, template), so its result is
stored once under that key and shared by every job of a grid that asks for it: the first job trains,
the others wait on a lock and start from its folder (and share its base-model evaluation cells).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sage import distributed
from sage.config import changed_only, instantiate_node
from sage.paths import build_once, content_key

log = logging.getLogger(__name__)

DONE_FILE = "sft_info.json"
# Raised when what the stage does changes for the same settings (2: chat models stop at the template's
# end-of-turn token), so that a merged model an earlier version stored is not reused.
SFT_FORMAT = 2


def sft_key(cfg: DictConfig, base_path: str) -> dict:
    """Everything the merged model depends on."""
    s, lora = cfg.model.sft, cfg.model.lora
    return {
        "format": SFT_FORMAT,
        "base": str(Path(base_path).resolve()) if Path(base_path).exists() else base_path,
        "data": OmegaConf.to_container(s.data, resolve=True),
        "args": OmegaConf.to_container(changed_only(s.args)),
        "lora": None if lora is None else OmegaConf.to_container(changed_only(lora)),
        "dtype": str(cfg.model.dtype),
        "chat": bool(cfg.model.chat),
    }


def run_sft(cfg: DictConfig, base_path: str, root: Path, peft_config) -> str:
    """The merged SFT model's folder under ``root``, trained only if no job has built it yet."""
    key = sft_key(cfg, base_path)
    final = root / content_key(key)
    if (final / DONE_FILE).exists():
        log.info("SFT stage already done: %s", final)
    return str(
        build_once(
            final, DONE_FILE, lambda folder: _train(cfg, base_path, folder, peft_config, key), collective=True
        )
    )


def _train(cfg: DictConfig, base_path: str, folder: Path, peft_config, key: dict) -> None:
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from sage.models import end_of_turn_token, policy_dtype

    s = cfg.model.sft
    dataset = instantiate_node(s.data, chat=cfg.model.chat)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    # A chat model learns to end its turn with the template's end-of-turn token, which is not always the
    # tokenizer's eos (base Qwen2.5-Math: <|im_end|> vs <|endoftext|>). TRL's eos_token makes it the eos of
    # the saved tokenizer and a stop id of the saved generation_config, so RL rollouts, vLLM and our
    # evaluator stop where the model ends its answer. model.sft.args.eos_token, when set, wins.
    stop = s.args.get("eos_token") or (end_of_turn_token(tokenizer) if cfg.model.chat else None)
    args = instantiate_node(
        changed_only(s.args),
        output_dir=str(folder / "trainer"),
        save_strategy="no",  # only the merged result is kept
        model_init_kwargs={
            "dtype": policy_dtype(str(cfg.model.dtype), lora=peft_config is not None),
            **(s.args.model_init_kwargs or {}),
        },
        **({"eos_token": stop} if stop else {}),
    )
    trainer = SFTTrainer(
        model=base_path, args=args, train_dataset=dataset, peft_config=peft_config, processing_class=tokenizer
    )
    trainer.train()  # every process of a multi-process run trains; the main one merges and writes
    if not distributed.is_main():
        return
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    (folder / DONE_FILE).write_text(json.dumps({"key": key, "log": trainer.state.log_history}, indent=2))
    log.info("SFT stage trained on %d process(es), merged and written once", distributed.world_size())
