"""The SFT stage: LoRA (or full) supervised fine-tuning of a base model, merged and saved as the RL start.

The merged SFT model is both the RL start and the reference policy (TRL then uses a disabled adapter or a
copy of these weights), never the pre-SFT base. ``model.sft.args`` is TRL's ``SFTConfig`` with its own
keys; this module supplies only the output folder, the checkpoint policy and the model's dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from sage.config import build, changed_only

log = logging.getLogger(__name__)


def run_sft(cfg: DictConfig, base_path: str, out: Path, peft_config) -> str:
    """Train, merge the adapter into the weights, save to ``out/merged``; a finished stage is reused."""
    merged = out / "merged"
    if (merged / "config.json").exists():
        log.info("SFT already done: %s", merged)
        return str(merged)
    from trl import SFTTrainer

    s = cfg.model.sft
    dataset = build(s.data, chat=cfg.model.chat)
    args = build(
        changed_only(s.args),
        output_dir=str(out),
        save_strategy="no",  # only the merged result is kept
        model_init_kwargs={"dtype": str(cfg.model.dtype), **(s.args.model_init_kwargs or {})},
    )
    trainer = SFTTrainer(model=base_path, args=args, train_dataset=dataset, peft_config=peft_config)
    trainer.train()
    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(merged)
    trainer.processing_class.save_pretrained(merged)
    return str(merged)
