"""sage-eval: unbiased pass@k curves (k = 1..n) of any checkpoint on the eval datasets, resumable.

    sage-eval checkpoint=outputs/<run>/final eval=math_suite eval.n_samples=256 eval.seeds=[0,1,2]
    sage-eval checkpoint=<LoRA adapter folder> model=qwen2.5-math-7b eval.backend=vllm      # GPU cluster
    sage-eval eval=math_suite                                # the model group's base model

It composes the same ``model`` and ``eval`` groups as ``sage-train`` and calls the same
``sage.eval.evaluate.evaluate_model``, so for the same checkpoint, settings and seeds it gives the numbers
of the trainer's end-of-run evaluation. The model group supplies the prompt format (chat), dtype and the
training max length (the default eval length); a LoRA adapter folder is merged onto the base it names.

Where results go (``output_dir``, each cell a subfolder keyed by its settings, plus ``results.json``):
``<checkpoint>/eval`` for a checkpoint folder; for the base model (checkpoint=null) the shared cache
folder that ``sage-train`` uses for its "base" row, so neither re-samples what the other finished.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from sage.config import (
    ConfigError,
    EvalConfig,
    ModelConfig,
    TrackingConfig,
    check_eval,
    exit_on_config_error,
    instantiate_node,
    register_configs,
)
from sage.paths import CONF_DIR, base_results_dir
from sage.tracking import check_store, metric_key, start_run

log = logging.getLogger("sage.eval")


@dataclass
class EvaluateConfig:
    model: ModelConfig = MISSING
    eval: EvalConfig = MISSING
    checkpoint: str | None = field(
        default=None, metadata={"help": "model or LoRA adapter folder; None: the model group's base model"}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "None: <checkpoint>/eval, or sage-train's base-model cache folder"}
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


register_configs()
ConfigStore.instance().store(name="base_evaluate", node=EvaluateConfig)


def evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Per dataset, pass@k at eval.ks (mean and std over seeds); prints the table, writes results.json."""
    from sage.eval.analyses import log_analyses
    from sage.eval.evaluate import evaluate_model, format_table, load_eval_rows
    from sage.eval.sampling import check_backend

    check_eval(cfg.eval)
    check_backend(cfg.eval)
    check_store(cfg)
    if cfg.checkpoint is not None and not Path(cfg.checkpoint).is_dir():
        raise ConfigError(
            f"checkpoint={cfg.checkpoint} is not a folder; for a hub model leave checkpoint unset"
        )
    rows = load_eval_rows(cfg.eval.datasets, cfg.eval.limit)  # a bad data file fails before any model loads

    if cfg.checkpoint is None:
        model_path = instantiate_node(cfg.model.source)
        default_dir = base_results_dir(model_path)
        label = "base"
    else:
        model_path = str(Path(cfg.checkpoint).resolve())
        default_dir = Path(model_path) / "eval"
        label = Path(model_path).name
    results_dir = Path(cfg.output_dir).resolve() if cfg.output_dir else default_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    # One MLflow run per results folder: re-running sage-eval there continues it and logs only what is new.
    with start_run(cfg, results_dir, kind="eval") as tracker:
        if tracker is not None:
            tracker.set_tag("checkpoint", model_path)
        res = evaluate_model(
            model_path,
            rows,
            cfg.eval,
            chat=cfg.model.chat,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.model.max_completion_length,
            results_dir=results_dir,
            dtype=str(cfg.model.dtype.value),
        )
        if tracker is not None:
            logged = tracker.client.get_run(tracker.run_id).data.metrics
            for ds, r in res.items():
                if metric_key(f"eval/{label}/{ds}/pass@1") not in logged:
                    tracker.log_eval(label, ds, r, list(cfg.eval.ks), cfg.tracking.completions_sample)
            log_analyses(
                tracker,
                label,
                rows,
                res,
                chat=cfg.model.chat,
                base=perplexity_base(cfg, model_path),
                cap=cfg.eval.perplexity_cap,
            )
    summaries = {ds: r["summary"] for ds, r in res.items()}
    print("\n" + format_table({label: summaries}, list(cfg.eval.ks)))
    print(f"\nresults: {results_dir / 'results.json'}")
    return summaries


def perplexity_base(cfg: DictConfig, model_path: str) -> str | None:
    """The model whose perplexity of the samples is reported: ``eval.perplexity_base``, else a LoRA
    adapter's base, else the model itself when it is the model group's base (checkpoint unset)."""
    from sage.eval.checkpoint import Checkpoint

    if cfg.eval.perplexity_base is not None:
        return cfg.eval.perplexity_base
    checkpoint = Checkpoint.resolve(model_path)
    if checkpoint.adapter is not None:
        return checkpoint.base
    return model_path if cfg.checkpoint is None else None


@hydra.main(config_path=CONF_DIR, config_name="evaluate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    exit_on_config_error(evaluate, cfg)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _hydra_main()


if __name__ == "__main__":
    main()
