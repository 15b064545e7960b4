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
``results.json`` holds the last call's numbers; MLflow holds one run per (folder, settings).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from sage.cli import exit_on_config_error, run_command
from sage.config import (
    EvalConfig,
    GradingConfig,
    ModelConfig,
    TrackingConfig,
    check_backend,
    check_eval,
    check_grading,
    check_tracking,
    register_configs,
)
from sage.durable import folder_lock, reading
from sage.hardware import sampling_dtype
from sage.metrics import metric_name
from sage.paths import CONF_DIR, base_results_dir, check_output_dir, content_key
from sage.targets import instantiate_node
from sage.tracking import check_store, start_run

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
    grading: GradingConfig = field(default_factory=GradingConfig)


def register_evaluate_configs() -> None:
    """sage-eval's schemas (see sage.train.main.main for why not at import)."""
    register_configs()
    ConfigStore.instance().store(name="base_evaluate", node=EvaluateConfig)


def evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Per dataset, pass@k at eval.ks (mean and std over seeds); prints the table, writes results.json."""
    from transformers import AutoTokenizer

    from sage.eval.analyses import log_analyses
    from sage.eval.checkpoint import (
        Checkpoint,
        check_checkpoint_folder,
        check_model_option,
        check_prompt_format,
    )
    from sage.eval.evaluate import check_prompt_lengths, evaluate_model, format_table, load_eval_rows
    from sage.grading import GradingPool

    # Everything that can be wrong with the settings, the store, the checkpoint folder, the output folder
    # or the data files fails here, before a results folder, an MLflow run or a model exists.
    check_eval(cfg.eval)
    check_tracking(cfg.tracking)
    check_grading(cfg.grading)
    check_backend(cfg.eval, sampling_dtype(cfg.model, cfg.eval))
    check_store(cfg)
    if cfg.checkpoint is not None:
        check_checkpoint_folder(cfg.checkpoint)
        check_model_option(cfg.checkpoint, cfg.model, hydra_choices().get("model"))
        check_prompt_format(cfg.checkpoint, cfg.model.chat)
    if cfg.output_dir:
        check_output_dir(cfg.output_dir)
    rows = load_eval_rows(cfg.eval.datasets, cfg.eval.limit)

    if cfg.checkpoint is None:
        model_path = instantiate_node(cfg.model.source)
        default_dir = base_results_dir(model_path)
        label = "base"
    else:
        model_path = str(Path(cfg.checkpoint).resolve())
        default_dir = Path(model_path) / "eval"
        label = Path(model_path).name
        check_output_dir(default_dir, key="output_dir (default <checkpoint>/eval)")
    results_dir = Path(cfg.output_dir).resolve() if cfg.output_dir else default_dir
    max_new_tokens = cfg.eval.max_new_tokens or cfg.model.max_completion_length
    checkpoint = Checkpoint.resolve(model_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    check_prompt_lengths(checkpoint, tokenizer, rows, cfg.model.chat, max_new_tokens)
    key = settings_key(cfg, model_path, rows, max_new_tokens)
    # A checkpoint folder is held for reading until its results are written: an extension of its run that
    # moves it to final-step-N/ meanwhile waits (sage.durable.reading).
    held = reading(Path(model_path)) if cfg.checkpoint is not None else contextlib.nullcontext()
    # the pool's workers start only if a cell is to be sampled (pebble starts them on first use)
    with held, GradingPool(workers=2, max_answer_chars=cfg.grading.max_answer_chars) as pool:
        results_dir.mkdir(parents=True, exist_ok=True)
        # One MLflow run per (results folder, settings key): other settings are another run, so a run's
        # numbers are those of its settings; the same settings again continue their run and log only what is
        # missing.
        # Two sage-evals of one folder and settings at once take turns: each would otherwise find no run
        # recorded, create its own and log every metric, the second's id file replacing the first's. The
        # second waits (a line says on whom), continues the first's run and logs only what is missing.
        turn = folder_lock(results_dir / f"evaluation.{key}")
        with (
            turn,
            start_run(cfg, results_dir, kind="eval", key=key, what=evaluated(cfg, model_path)) as tracker,
        ):
            if tracker is not None:
                tracker.set_tag("checkpoint", model_path)
            res = evaluate_model(
                model_path,
                rows,
                cfg.eval,
                chat=cfg.model.chat,
                max_new_tokens=max_new_tokens,
                results_dir=results_dir,
                dtype=sampling_dtype(cfg.model, cfg.eval),
                pool=pool,
            )
            if tracker is not None:
                logged = tracker.client.get_run(tracker.run_id).data.metrics
                new = {ds: r for ds, r in res.items() if metric_name(label, ds, "pass@1") not in logged}
                for ds, r in new.items():
                    shown = cfg.tracking.completions_sample
                    tracker.log_eval(label, ds, r, list(cfg.eval.ks), shown, rows=rows[ds])
                # every dataset: log_analyses scores only those whose perplexities the run lacks (a rerun
                # after a failed analysis completes it)
                log_analyses(
                    tracker,
                    label,
                    rows,
                    res,
                    chat=cfg.model.chat,
                    base=perplexity_base(cfg, model_path),
                    cap=cfg.eval.perplexity_cap,
                    dtype=str(cfg.model.dtype.value),
                )
        # printed while the folder is held: an extension waiting to move it to final-step-N/ moves it after
        # this line, says where, and points results.json and the MLflow run's checkpoint tag there
        summaries = {ds: r["summary"] for ds, r in res.items()}
        print("\n" + format_table({label: summaries}, list(cfg.eval.ks), len(cfg.eval.seeds)))
        print(f"\nresults: {results_dir / 'results.json'}")
        if tracker is not None:
            print(f"MLflow run: {tracker.run_id}")
    return summaries


def hydra_choices() -> dict[str, str]:
    """The group options this command chose (model=tiny, ...); empty outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}


def evaluated(cfg: DictConfig, model_path: str) -> tuple[str, dict[str, str]]:
    """(run name, tags) saying what a sage-eval run evaluated: a sage-train checkpoint by its run's method
    and seed (``grpo_branch-s1/final``, tags method and seed, as sage-train names and tags its run: the
    run folder's config.yaml and Hydra's choices in its .hydra/ give them to ``run_names.method_of``); the
    model group's base model as ``base/<model>`` (method ``base``, as sage-report names the start model);
    any other folder by its name. Never ``run``: every evaluation in the store says what it measured."""
    if cfg.checkpoint is None:
        model = hydra_choices().get("model") or str(cfg.model.get("name") or Path(model_path).name)
        return f"base/{model}", {"method": "base", "model": model}
    folder = Path(model_path)
    run = trained_by(folder)
    if run is None:
        return folder.name, {"model": folder.name}
    method, seed = run
    return f"{method}-s{seed}/{folder.name}", {"method": method, "seed": str(seed)}


def trained_by(checkpoint: Path) -> tuple[str, int] | None:
    """(method, seed) of the sage-train run that saved ``checkpoint`` (its ``final/``, ``final-step-N/`` or
    ``rl/checkpoint-N/``), read from the run folder; None for a folder no sage-train run saved."""
    from omegaconf import OmegaConf

    from sage.eval.checkpoint import training_run
    from sage.run_names import method_of

    run = training_run(checkpoint)
    if run is None:
        return None
    try:
        trained = OmegaConf.load(run / "config.yaml")
        choices = dict(OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra.runtime.choices)
    except Exception:  # noqa: BLE001 (a damaged record of the run only loses the name it would give)
        log.warning("%s: its run's config cannot be read; the MLflow run is named by the folder", checkpoint)
        return None
    method = method_of(trained, choices)
    seed = trained.get("seed")
    return (method, int(seed)) if method and seed is not None else None


def settings_key(cfg: DictConfig, model_path: str, rows: dict[str, list[dict]], max_new_tokens: int) -> str:
    """A hash of everything the numbers of a sage-eval run depend on: the checkpoint's files, every
    dataset's rows (so ``eval.limit`` and the data files), the sampling settings, seeds, backend, dtype,
    prompt format, the reported ks, the perplexity analysis settings and the grading's answer cap. Not in
    it: what changes only the speed (``eval.batch_size``) or the size of the artifacts
    (``tracking.completions_sample``)."""
    from sage.data.verifiers import MAX_ANSWER_CHARS
    from sage.eval.checkpoint import Checkpoint

    e = cfg.eval
    return content_key(
        {
            "model": Checkpoint.resolve(model_path).fingerprint(),
            "datasets": {name: content_key(r) for name, r in rows.items()},
            "n_samples": e.n_samples,
            "seeds": list(e.seeds),
            "temperature": float(e.temperature),
            "top_p": float(e.top_p),
            "max_new_tokens": max_new_tokens,
            "backend": str(e.backend),
            "dtype": sampling_dtype(cfg.model, cfg.eval),
            "chat": bool(cfg.model.chat),
            "ks": list(e.ks),
            "perplexity_base": e.perplexity_base,
            "perplexity_cap": e.perplexity_cap,
            # the default left out, so that the runs made before the setting existed keep their keys
            **(
                {"max_answer_chars": cap} if (cap := cfg.grading.max_answer_chars) != MAX_ANSWER_CHARS else {}
            ),
        }
    )


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
    register_evaluate_configs()  # a multirun job runs this function without main(); instantiation needs them
    # finished cells are kept and never sampled again; sage-eval has no resume key (it always continues)
    exit_on_config_error(evaluate, cfg, rerun="the same command samples only the missing cells")


def main() -> None:
    run_command(_hydra_main, register_evaluate_configs, ("checkpoint", "output_dir", "eval.perplexity_base"))


if __name__ == "__main__":
    main()
