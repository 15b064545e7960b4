"""Guide diagnostics: where a model's own solutions are uncertain, and what each guide makes of it.

    python -m sage.eval.guide_diagnostics model=qwen2.5-coder-0.5b-instruct eval.limit=40 eval.n_samples=2 \
        eval.max_new_tokens=384 eval.backend=vllm eval.vllm_cpu_memory_utilization=0.25
    python -m sage.eval.guide_diagnostics                      # the testbed model on its held-out problems

It composes the ``model``, ``eval``, ``guide`` and ``schedule`` groups of ``sage-train`` (conf/), samples
``eval.n_samples`` solutions of each of the first ``eval.limit`` problems with the evaluator's sampler
(``eval.backend``: hf or vllm), then runs the model once more over each prompt + solution (teacher forcing)
to get, at every solution token, the entropy of the model's FULL next-token distribution at temperature 1
and the sampled token's log-prob: what TRL's loss pass hands a guide at training step 0, where the policy is
the reference. From these it reports:

- the token-entropy distribution (quantiles, histogram) and the share of tokens above the paper's fixed
  1.2 nats and above the percentile threshold the testbed uses (``percentile``, default the 90th: the
  testbed models' ``model.branch_threshold`` is that percentile of their own samples' entropy);
- the q of each guide config (``guides``: none, random, token, branch at the model's threshold), plus branch
  at 1.2 nats and at the percentile threshold, computed by the guides themselves (sage.objective.guides);
- where the high-entropy tokens fall: the category of each token (:data:`CATEGORIES`, :func:`categorise`)
  among the tokens above each threshold, against its base rate among all tokens;
- a picture: ``completions.html``, a few solutions with each token shaded by its entropy and by each
  guide's q (hover a token for its numbers).

Written to ``output_dir`` (default ``outputs/guide_diagnostics/<model>``): ``summary.md`` (also printed),
``diagnostics.json`` (every number), ``completions.html``; logged to MLflow (metrics and the three files
as artifacts) unless ``tracking.enabled=false``.

This module is the command: its Hydra schema, its checks, and the run that gets the solutions
(``sage.eval.guide_sampling``), measures them (``sage.eval.guide_maths``) and writes the pictures
(``sage.eval.guide_rendering``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from sage.cli import exit_on_config_error, run_command
from sage.config import (
    ConfigError,
    EvalConfig,
    ModelConfig,
    TrackingConfig,
    check_backend,
    check_eval,
    register_configs,
)
from sage.eval.guide_maths import (
    CATEGORIES,
    PAIR_EDGES,
    PAPER_THRESHOLD,
    anchor_strength,
    categorise,
    entropy_summary,
    guide_q,
    pair_by_entropy,
    q_summary,
    strength_by_bucket,
    top_texts,
    where_high,
)
from sage.eval.guide_rendering import markdown, render_html
from sage.eval.guide_sampling import (
    sample_solution_ids,
    solution_statistics,
    stored_solutions,
    token_texts,
)
from sage.hardware import sampling_dtype
from sage.paths import CONF_DIR
from sage.targets import instantiate_node

log = logging.getLogger("sage.eval.guide_diagnostics")


def build_guides(cfg: DictConfig, percentile_threshold: float) -> dict[str, Any]:
    """The guide objects: each of ``cfg.guides`` as sage-train builds it (a ``_partial_`` guide completed
    with ``cfg.schedule``), then branch at the paper's 1.2 nats (when the model's default differs) and at
    the percentile threshold, both with the branch config's ratio and clamp."""
    from sage.objective.guides import BranchGuide

    schedule = None
    guides: dict[str, Any] = {}
    for name, node in cfg.guides.items():
        guide = instantiate_node(node)
        if node.get("_partial_"):
            if schedule is None:
                schedule = instantiate_node(cfg.schedule)
                if cfg.schedule.get("_partial_"):  # a cosine schedule over one step: its start value at 0
                    schedule = schedule(max_steps=1)
            try:
                guide = guide(schedule=schedule)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"guides.{name}: {e}") from e
        guides[str(name)] = guide
    branch = next((g for g in guides.values() if isinstance(g, BranchGuide)), BranchGuide())
    kept = {"ratio": branch.ratio, "q_min": branch.q_min, "q_max": branch.q_max}
    if not any(isinstance(g, BranchGuide) and g.threshold == PAPER_THRESHOLD for g in guides.values()):
        guides["branch_paper"] = BranchGuide(threshold=PAPER_THRESHOLD, **kept)
    guides[f"branch_p{cfg.percentile:g}"] = BranchGuide(threshold=percentile_threshold, **kept)
    return guides


def describe(guide) -> str:
    """A guide's name and hyperparameters at step 0, for the tables."""
    params = ", ".join(f"{k} {v:g}" for k, v in guide.params(0).items())
    return f"{type(guide).__name__}({params})" if params else type(guide).__name__


# ------------------------------------------------------------------------------------------ the command
@dataclass
class GuideDiagnosticsConfig:
    model: ModelConfig = MISSING
    eval: EvalConfig = MISSING
    guides: dict[str, Any] = field(default_factory=dict, metadata={"help": "name -> a guide config"})
    schedule: Any = MISSING
    seed: int = 0
    percentile: float = field(
        default=90.0, metadata={"help": "the percentile threshold: this percentile of the tokens' entropy"}
    )
    shown: int = field(default=4, metadata={"help": "solutions pictured in completions.html"})
    checkpoint: str | None = field(
        default=None, metadata={"help": "model or LoRA adapter folder; None: the model group's base model"}
    )
    output_dir: str | None = field(default=None, metadata={"help": "None: outputs/guide_diagnostics/<model>"})
    samples: str | None = field(
        default=None,
        metadata={
            "help": "an evaluation cell folder (<run>/eval/<label>/<dataset>/<cell>: its completions.json "
            "and meta.json): measure those stored solutions instead of sampling new ones; None: sample"
        },
    )
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register_diagnostics_configs() -> None:
    register_configs()
    ConfigStore.instance().store(name="base_guide_diagnostics", node=GuideDiagnosticsConfig)


def check(cfg: DictConfig) -> None:
    """The settings' rules, before any model is loaded; each failure one line naming its key."""
    # the eval group's rules are sage-train's and sage-eval's; on a copy, since check_eval fills eval.ks,
    # which the diagnostics do not use and their record keeps as given
    check_eval(OmegaConf.create(OmegaConf.to_container(cfg.eval)))
    check_backend(cfg.eval, sampling_dtype(cfg.model, cfg.eval))
    if not 0 < cfg.percentile < 100:
        raise ConfigError(f"percentile must be in (0, 100) (got {cfg.percentile})")
    if cfg.shown < 0:
        raise ConfigError(f"shown must be >= 0 (got {cfg.shown})")
    for name, guide in build_guides(cfg, PAPER_THRESHOLD).items():
        try:  # on one token: a guide that needs what this analysis has not (the fork guides' markers)
            guide_q(guide, [np.zeros(1)], [np.zeros(1)])
        except ValueError as e:
            raise ConfigError(f"guides.{name}: {e}") from e


def diagnose(cfg: DictConfig, model_label: str) -> tuple[dict[str, Any], str]:
    """Sample, measure and summarise: (the report's numbers, the HTML picture)."""
    from transformers import AutoTokenizer

    from sage.eval.checkpoint import Checkpoint
    from sage.eval.evaluate import load_eval_rows
    from sage.eval.sampling import HFSampler, open_sampler, tokenize_prompts

    stored = cfg.get("samples")
    rows_by_dataset = load_eval_rows(cfg.eval.datasets, None if stored else cfg.eval.limit)
    rows = [r for dataset_rows in rows_by_dataset.values() for r in dataset_rows]
    model_path = cfg.checkpoint or instantiate_node(cfg.model.source)
    checkpoint = Checkpoint.resolve(str(model_path))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.tokenizer)
    dtype = str(cfg.model.dtype.value)
    max_new = cfg.eval.max_new_tokens or cfg.model.max_completion_length
    n = cfg.eval.n_samples
    drawn = {"temperature": float(cfg.eval.temperature), "top_p": float(cfg.eval.top_p)}

    model = None
    if stored:
        rows, solutions, cell = stored_solutions(Path(stored), rows_by_dataset, tokenizer, cfg.eval.limit, n)
        drawn = {k: float(cell.get(k, v)) for k, v in drawn.items()}  # how the stored ones were drawn
        max_new = int(cell.get("max_new_tokens", max_new))
        log.info("stored solutions of %d problems from %s", len(rows), stored)
        prompt_ids = tokenize_prompts(tokenizer, rows, bool(cell.get("chat", cfg.model.chat)))
    else:
        prompt_ids = tokenize_prompts(tokenizer, rows, cfg.model.chat)
        sampler = open_sampler(
            checkpoint, tokenizer, dtype=sampling_dtype(cfg.model, cfg.eval), eval_cfg=cfg.eval
        )
        try:
            log.info("sampling %d problems x %d solutions (%s backend)", len(rows), n, cfg.eval.backend)
            solutions = sample_solution_ids(
                sampler, prompt_ids, n, max_new=max_new, seed=int(cfg.seed), **drawn
            )
            model = sampler.model if isinstance(sampler, HFSampler) else None
        finally:
            sampler.close()  # a vLLM engine goes before the model for the forward pass is loaded
    if model is None:
        model = HFSampler.load(checkpoint, tokenizer, dtype, batch_size=1).model

    log.info("entropies: one forward pass per solution")
    records = []  # one per non-empty solution
    for r, (row, p_ids) in enumerate(zip(rows, prompt_ids, strict=True)):
        for ids in solutions[r]:
            if not ids:
                continue  # an empty solution has no token to measure
            entropy, logp = solution_statistics(model, p_ids, ids)
            if (len(records) + 1) % 20 == 0:
                log.info("entropies of %d solutions measured", len(records) + 1)
            texts, special = token_texts(tokenizer, ids)
            records.append(
                {
                    "row": r,  # the problem's index: the unit the lifts' intervals resample
                    "problem_id": row.get("id", r),
                    "problem": row["problem"],
                    "ids": ids,
                    "texts": texts,
                    "entropy": entropy,
                    "logp": logp,
                    "categories": categorise(texts, special),
                }
            )
    if not records:
        raise ConfigError("every sampled solution is empty: nothing to measure (raise eval.max_new_tokens)")
    del model

    entropies = np.concatenate([x["entropy"] for x in records])
    categories = np.concatenate([np.array(x["categories"], dtype=object) for x in records])
    problem = np.concatenate([np.full(len(x["entropy"]), x["row"]) for x in records])
    p_name = f"p{cfg.percentile:g}"
    p_threshold = float(np.percentile(entropies, cfg.percentile))
    thresholds = {"paper": PAPER_THRESHOLD, p_name: p_threshold}
    guides = build_guides(cfg, p_threshold)
    q_by_guide = {}
    for name, guide in guides.items():
        per_solution = guide_q(guide, [x["logp"] for x in records], [x["entropy"] for x in records])
        for x, q in zip(records, per_solution, strict=True):
            x.setdefault("q", {})[name] = q
        q_by_guide[name] = np.concatenate(per_solution)

    report: dict[str, Any] = {
        "settings": {
            "model": model_label,
            "model_path": portable_path(str(model_path)),
            "datasets": list(rows_by_dataset),
            "problems": len(rows),
            "n_samples": max((len(x) for x in solutions), default=0),
            **drawn,
            "max_new_tokens": max_new,
            "backend": "stored" if stored else str(cfg.eval.backend),
            "samples": str(stored) if stored else None,
            "seed": int(cfg.seed),
            "percentile": float(cfg.percentile),
            "empty_solutions": sum(len(s) for s in solutions) - len(records),
            "truncated_solutions": sum(len(x["ids"]) >= max_new for x in records),
            "entropy": "full-vocabulary next-token distribution at temperature 1, teacher-forced pass",
            "interval_clusters": "problem",
        },
        "entropy": entropy_summary(entropies, [len(x["ids"]) for x in records], thresholds),
        "where": where_high(categories, entropies, thresholds, problem, seed=int(cfg.seed)),
        "guides": {},
    }
    strengths = {
        name: np.concatenate(
            anchor_strength(guides[name], [x["q"][name] for x in records], [x["entropy"] for x in records])
        )
        for name in guides
    }
    report["strength_by_bucket"] = strength_by_bucket(strengths, entropies)
    if {"branch", "archer"} <= set(q_by_guide):  # opposite hypotheses about the same tokens (docs/method.md)
        report["branch_vs_archer"] = pair_by_entropy(
            strengths["branch"], strengths["archer"], entropies, PAIR_EDGES
        )
    texts = np.concatenate([np.array(x["texts"], dtype=object) for x in records])
    report["top_tokens"] = {name: top_texts(texts, entropies > t) for name, t in thresholds.items()}
    for name, guide in guides.items():
        summary = q_summary(
            q_by_guide[name], categories, entropies, thresholds, getattr(guide, "q_max", None)
        )
        report["guides"][name] = {"described": describe(guide), **summary}
    shown = [
        {**x, "entropy": x["entropy"].tolist(), "q": {g: v.tolist() for g, v in x["q"].items()}}
        for x in records[: cfg.shown]
    ]
    title = f"Guide diagnostics: {model_label}, {len(shown)} solutions"
    picture = render_html(shown, [g for g in guides if g != "none"], thresholds, title)
    return report, picture


def portable_path(path: str) -> str:
    """``path`` as the record keeps it: a model built into this machine's cache as ``$SAGE_CACHE_DIR/...``
    (the folder is named by the model's content, so it reads the same on every machine), else as given."""
    from sage.paths import cache_dir

    try:
        return f"$SAGE_CACHE_DIR/{Path(path).resolve().relative_to(cache_dir().resolve())}"
    except ValueError:
        return path


def metrics_of(report: dict[str, Any]) -> dict[str, float]:
    """The headline numbers as flat MLflow metric names."""
    e, w = report["entropy"], report["where"]
    out = {"entropy/mean": e["mean"], **{f"entropy/{k}": v for k, v in e["quantiles"].items()}}
    for name, a in e["above"].items():
        out[f"entropy/share_above_{name}"] = a["share"]
        out[f"entropy/threshold_{name}"] = a["threshold"]
        for c in CATEGORIES:
            out[f"where/{name}/{c}/share"] = w[name]["share"][c]
            out[f"where/{name}/{c}/lift"] = w[name]["lift"][c]
    for c in CATEGORIES:
        out[f"where/base_rate/{c}"] = w["base_rate"][c]
    for name, g in report["guides"].items():
        out[f"guide/{name}/q_mean"] = g["mean"]
        out[f"guide/{name}/share_gt_1"] = g["share_gt_1"]
        out[f"guide/{name}/share_lt_1"] = g["share_lt_1"]
        out[f"guide/{name}/q_max"] = g["max"]
    return {k: v for k, v in out.items() if math.isfinite(v)}


def run(cfg: DictConfig) -> Path:
    """The command: check, diagnose, write the three files, log them; returns the output folder."""
    from sage.paths import check_output_dir
    from sage.run_names import hydra_context
    from sage.tracking import check_store, start_run

    check(cfg)
    check_store(cfg)
    choices, _ = hydra_context()
    label = str(cfg.checkpoint) if cfg.checkpoint else f"model={choices.get('model', 'model')}"
    out = Path(cfg.output_dir or Path("outputs") / "guide_diagnostics" / choices.get("model", "model"))
    check_output_dir(out)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report, picture = diagnose(cfg, label)
    report["settings"]["config"] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    summary = markdown(report)
    files = {
        "summary.md": summary,
        "diagnostics.json": json.dumps(report, indent=1, default=float, allow_nan=True),
        "completions.html": picture,
    }
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    with start_run(cfg, out, kind="guide_diagnostics", resume=False) as tracker:
        if tracker is not None:
            tracker.log_metrics(metrics_of(report), step=0)
            for name in files:
                tracker.log_artifact(out / name, "guide_diagnostics")
    print(summary)
    print(f"written: {', '.join(str(out / n) for n in files)}")
    if tracker is not None:
        print(f"MLflow run: {tracker.run_id}")
    return out


@hydra.main(config_path=CONF_DIR, config_name="guide_diagnostics", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    register_diagnostics_configs()
    exit_on_config_error(run, cfg, rerun="run the same command again")


def main() -> None:
    run_command(_hydra_main, register_diagnostics_configs)


if __name__ == "__main__":
    main()
