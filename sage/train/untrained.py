"""A run whose final/ is its start model: nothing was trained, yet its "trained" row would be reported as
RL's. ``trl.max_steps=1`` does it: warm-up (``trl.warmup_steps`` 0.1, a ratio) puts the learning rate at 0
for that one step. :func:`flag_untrained` says so in one line at the end of training and tags the MLflow
run ``untrained=true``, which sage-report marks in its notes."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger(__name__)

UNTRAINED_TAG = "untrained"
WARNING = "final/ equals the start model: nothing was trained (learning rate 0 throughout?)"


def flag_untrained(cfg: DictConfig, start: str, final: Path, out: Path) -> bool:
    """Warn and tag the run when ``final``'s weights are ``start``'s; whether they are. Reading the
    weights stops at the first tensor that differs, so a trained model costs one tensor's read."""
    if unchanged(start, final) is not True:
        return False
    log.warning("%s (%s)", WARNING, final)
    tag_run(cfg, out, UNTRAINED_TAG, "true")
    return True


def unchanged(start: str, final: Path) -> bool | None:
    """Whether the model in ``final`` is the one in ``start``: a LoRA adapter whose every ``lora_B`` is
    zero (its update B @ A is zero), or full weights equal tensor by tensor to the start's (cast to the
    saved dtype, as training casts them). None where it cannot be told from safetensors files: no such
    files, a tensor the start folder lacks, an adapter with more than its A and B matrices."""
    import torch
    from safetensors import safe_open

    final = Path(final)
    files = sorted(final.glob("*.safetensors"))
    if not files:
        return None
    if (final / "adapter_config.json").is_file():
        for file in files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    if "lora_A" in name:
                        continue
                    if "lora_B" not in name:
                        return None
                    if f.get_tensor(name).count_nonzero():
                        return False
        return True
    where = {}
    for file in sorted(Path(start).glob("*.safetensors")) if Path(start).is_dir() else []:
        with safe_open(str(file), "pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    if not where:
        return None
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name not in where:
                    return None
                mine = f.get_tensor(name)
                with safe_open(str(where[name]), "pt") as g:
                    theirs = g.get_tensor(name)
                if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
                    return False
    return True


def tag_run(cfg: DictConfig, out: Path, key: str, value: str) -> None:
    """Set a tag on the MLflow run of ``out`` (the run sage-train records in it), where there is one."""
    from sage.tracking import RUN_ID_FILE, resolve_uri

    id_file = out / RUN_ID_FILE
    if not cfg.tracking.enabled or not id_file.is_file():
        return
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=resolve_uri(cfg.tracking.uri)).set_tag(
            id_file.read_text().strip(), key, value
        )
    except Exception as e:  # noqa: BLE001 (a tag is not worth failing a finished run for)
        log.warning("the MLflow run of %s could not be tagged %s=%s: %s", out, key, value, e)
