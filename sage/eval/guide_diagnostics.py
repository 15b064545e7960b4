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
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from sage.config import (
    ConfigError,
    EvalConfig,
    ModelConfig,
    TrackingConfig,
    check_backend,
    check_sampling,
    exit_on_config_error,
    instantiate_node,
    register_configs,
    sampling_dtype,
)
from sage.paths import CONF_DIR

log = logging.getLogger("sage.eval.guide_diagnostics")

PAPER_THRESHOLD = 1.2
"""The paper's branch threshold in nats (Eq. 11, Table 6)."""
QUANTILES = (10, 25, 50, 75, 90, 95, 99)
HISTOGRAM_EDGES = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, math.inf)
"""Entropy bins in nats: fine near 0, where most tokens of a fluent model sit, and 1.2 an edge."""
PAIR_EDGES = (0.0, 0.1, 0.5, 1.0, 1.2, 2.0)
"""The bins in which Branch's and Archer's q are set side by side (nats; the last bin open)."""

CATEGORIES = ("approach_word", "step_opening", "number", "operator", "whitespace", "other")
"""What a solution token is, one category each, the first that applies in this order:

- ``approach_word``: the first token of a word of :data:`APPROACH_WORDS` (anywhere: "we use", "Let");
- ``step_opening``: any other first visible token of a line or of a sentence (after ". ", "! ", "? "), and
  the solution's first visible token: where the next step is chosen;
- ``number``: a token with a digit;
- ``operator``: a token of symbols only (operators, brackets, punctuation, $) or a LaTeX command (``\\frac``);
- ``whitespace``: spaces and line breaks only (whether to end a line);
- ``other``: the rest (other words and word pieces, special tokens such as the end of turn).
"""

APPROACH_WORDS = frozenset(
    {
        # announcing a move or a method
        "let", "we", "use", "using", "consider", "suppose", "assume", "substitute", "substituting",
        "factor", "factoring", "apply", "applying", "rewrite", "expand", "simplify", "solve", "solving",
        "compute", "calculate", "try", "instead", "alternatively", "recall", "note", "notice",
        # reasons and consequences: where an argument turns
        "since", "because", "therefore", "thus", "hence", "so", "then", "first", "next", "finally",
        "if", "case",
    }
)  # fmt: skip
"""The approach lexicon: words with which a solution states what it does next or why. Matched lowercase on
whole words; the category goes to the word's first token (where a sampler picks the word)."""


# ------------------------------------------------------------------------------------------ the maths
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) over the last axis: TRL's ``entropy_from_logits``, the function
    its loss pass computes the entropy a guide receives with (at temperature 1, logits are not scaled)."""
    from trl.trainer.utils import entropy_from_logits

    return entropy_from_logits(logits.float())


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] at each position: the sampled tokens' log-probs. (T, V), (T,) -> (T,)"""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _is_opening(context: str) -> bool:
    """Whether the text before a token's first visible character ends a line or a sentence (or is empty:
    the solution's start). A period needs whitespace after it, so 3.5 is not a sentence end."""
    return not context.strip() or bool(re.search(r"\n[ \t]*$|[.!?][\s]+$", context))


def categorise(texts: Sequence[str], special: Sequence[bool] | None = None) -> list[str]:
    """The category (:data:`CATEGORIES`) of each token of one solution, given each token's text in order
    and whether it is a special token. A word's category goes to its first token: later pieces of the word
    are ``other`` (unless they hold digits or symbols)."""
    special = special if special is not None else [False] * len(texts)
    full = "".join(texts)
    out: list[str] = []
    at = 0  # where this token starts in ``full``
    for text, is_special in zip(texts, special, strict=True):
        visible = text.strip()
        lead = len(text) - len(text.lstrip())
        context = full[: at + lead]  # everything before the token's first visible character
        at += len(text)
        if is_special:
            out.append("other")
            continue
        if not visible:
            out.append("whitespace")
            continue
        starts_word = visible[0].isalpha() and not (context and context[-1].isalnum())
        word = re.match(r"[^\W\d_]+", full[len(context) :]) if starts_word else None
        if word is not None and word.group(0).lower() in APPROACH_WORDS:
            out.append("approach_word")
        elif _is_opening(context):
            out.append("step_opening")
        elif any(c.isdigit() for c in visible):
            out.append("number")
        elif visible.startswith("\\") or not any(c.isalnum() for c in visible):
            out.append("operator")
        else:
            out.append("other")
    return out


def quantiles(values: np.ndarray, qs: Sequence[float] = QUANTILES) -> dict[str, float]:
    return {f"q{q:g}": float(np.percentile(values, q)) for q in qs}


def histogram(values: np.ndarray, edges: Sequence[float] = HISTOGRAM_EDGES) -> list[dict[str, float]]:
    """Share of ``values`` in each [low, high) bin of ``edges`` (the last bin is closed above)."""
    counts, _ = np.histogram(values, bins=np.asarray(edges, dtype=float))
    return [
        {"low": float(lo), "high": float(hi), "share": float(c / len(values))}
        for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)
    ]


def entropy_summary(
    entropies: np.ndarray, lengths: Sequence[int], thresholds: dict[str, float]
) -> dict[str, Any]:
    """The distribution of the pooled per-token entropies and, per named threshold, the share of tokens
    above it and how many such tokens a solution has on average (``lengths``: tokens per solution)."""
    out: dict[str, Any] = {
        "tokens": int(len(entropies)),
        "solutions": len(lengths),
        "mean_tokens_per_solution": float(np.mean(lengths)),
        "mean": float(entropies.mean()),
        "quantiles": quantiles(entropies),
        "histogram": histogram(entropies),
        "above": {},
    }
    for name, t in thresholds.items():
        above = entropies > t
        out["above"][name] = {
            "threshold": float(t),
            "share": float(above.mean()),
            "per_solution": float(above.sum() / len(lengths)),
        }
    return out


def category_shares(categories: np.ndarray, selected: np.ndarray) -> dict[str, float]:
    """Share of each category among the ``selected`` tokens (sums to 1; NaN each when none is selected)."""
    n = int(selected.sum())
    return {c: (float((categories[selected] == c).sum() / n) if n else math.nan) for c in CATEGORIES}


def where_high(
    categories: np.ndarray,
    entropies: np.ndarray,
    thresholds: dict[str, float],
    cluster: np.ndarray | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Per threshold, each category's share among the tokens above it, its base rate among all tokens and
    their ratio (lift: above 1, high-entropy tokens fall there more often than tokens do), with an interval
    clustered by ``cluster`` (each token's problem in :func:`diagnose`; :func:`lift_intervals`), and the
    mean entropy of each category."""
    everything = np.ones(len(categories), dtype=bool)
    base = category_shares(categories, everything)
    out: dict[str, dict[str, Any]] = {
        "base_rate": base,
        "mean_entropy": {
            c: (float(entropies[categories == c].mean()) if (categories == c).any() else math.nan)
            for c in CATEGORIES
        },
    }
    for name, t in thresholds.items():
        selected = entropies > t
        shares = category_shares(categories, selected)
        out[name] = {
            "threshold": float(t),
            "tokens": int(selected.sum()),
            "share": shares,
            "lift": {c: (shares[c] / base[c] if base[c] > 0 else math.nan) for c in CATEGORIES},
            "lift_interval": (
                lift_intervals(categories, selected, cluster, seed=seed) if cluster is not None else {}
            ),
            # P(H > t | category): how often a token of the category is above the threshold
            "above_rate": {
                c: (float(selected[categories == c].mean()) if (categories == c).any() else math.nan)
                for c in CATEGORIES
            },
        }
    return out


LEVEL = 0.95  # of the lifts' intervals
DRAWS = 2000  # bootstrap resamples of the clusters (problems)


def lift_intervals(
    categories: np.ndarray,
    selected: np.ndarray,
    cluster: np.ndarray,
    draws: int = DRAWS,
    seed: int = 0,
    level: float = LEVEL,
) -> dict[str, tuple[float, float]]:
    """Per category, a percentile bootstrap interval of its lift among the ``selected`` tokens (share among
    them over share among all tokens), clustered (``cluster``: each token's cluster, its problem in
    :func:`diagnose`): whole clusters are resampled, not tokens or solutions, since a solution's tokens share
    its approach and style, and a problem's solutions share the problem, so neither are independent draws.
    A category absent from every resample gets (NaN, NaN)."""
    _, sol = np.unique(cluster, return_inverse=True)
    n_sol = int(sol.max()) + 1
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n_sol, np.full(n_sol, 1 / n_sol), size=draws).astype(float)  # (draws, n_sol)
    tokens = weights @ np.bincount(sol, minlength=n_sol)
    chosen = weights @ np.bincount(sol, weights=selected.astype(float), minlength=n_sol)
    tail = (1 - level) / 2
    out = {}
    for c in CATEGORIES:
        is_c = categories == c
        all_c = weights @ np.bincount(sol, weights=is_c.astype(float), minlength=n_sol)
        chosen_c = weights @ np.bincount(sol, weights=(is_c & selected).astype(float), minlength=n_sol)
        with np.errstate(divide="ignore", invalid="ignore"):
            lift = (chosen_c / chosen) / (all_c / tokens)
        lift = lift[np.isfinite(lift)]
        out[c] = (
            (float(np.quantile(lift, tail)), float(np.quantile(lift, 1 - tail)))
            if len(lift)
            else (math.nan, math.nan)
        )
    return out


def pair_by_entropy(
    q_a: np.ndarray, q_b: np.ndarray, entropies: np.ndarray, edges: Sequence[float]
) -> list[dict[str, float]]:
    """Two guides' anchor strengths (:func:`anchor_strength`) on the same tokens, by entropy bin (``edges``
    in nats, last bin open): each bin's share of the tokens, both guides' mean strength and the ratio of
    those means (NaN where the second is 0): how much harder the first guide pulls there."""
    out = []
    bounds = [*edges, math.inf]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        where = (entropies >= lo) & (entropies < hi)
        if not where.any():
            continue
        a, b = float(q_a[where].mean()), float(q_b[where].mean())
        ratio = a / b if b > 0 else math.nan  # no pull at all on the second side: no ratio
        out.append({"low": lo, "high": hi, "share": float(where.mean()), "a": a, "b": b, "ratio": ratio})
    return out


def strength_by_bucket(strengths: dict[str, np.ndarray], entropies: np.ndarray) -> list[dict[str, Any]]:
    """Every guide's mean anchor strength in the buckets the training log uses (``anchor_buckets/``:
    the entropy quintiles of the tokens, here of all the solutions' tokens pooled, and the tokens above
    1.2 nats; sage.objective.buckets), with each bucket's share of the tokens and entropy range: the
    offline view of what a run logs per step."""
    from sage.objective.buckets import bucket_masks

    h = torch.as_tensor(entropies).unsqueeze(0)
    out = []
    for name, where in bucket_masks(h, torch.ones_like(h)).items():
        where = where[0].numpy()
        if not where.any():
            continue
        out.append(
            {
                "bucket": name,
                "share": float(where.mean()),
                "entropy_low": float(entropies[where].min()),
                "entropy_high": float(entropies[where].max()),
                **{g: float(v[where].mean()) for g, v in strengths.items()},
            }
        )
    return out


def top_texts(texts: np.ndarray, selected: np.ndarray, k: int = 15) -> list[dict[str, Any]]:
    """The ``k`` most frequent token texts among the ``selected`` tokens: each with its count, its share of
    the selected tokens and how often that text is selected wherever it occurs (P(selected | text))."""
    chosen, counts = np.unique(texts[selected].astype(str), return_counts=True)
    everywhere = dict(zip(*np.unique(texts.astype(str), return_counts=True), strict=True))
    order = np.argsort(-counts, kind="stable")[:k]
    n = int(selected.sum())
    return [
        {
            "text": str(chosen[i]),
            "count": int(counts[i]),
            "share": float(counts[i] / n),
            "selected_rate": float(counts[i] / everywhere[chosen[i]]),
        }
        for i in order
    ]


def q_summary(
    q: np.ndarray,
    categories: np.ndarray,
    entropies: np.ndarray,
    thresholds: dict[str, float],
    q_max: float | None = None,
) -> dict[str, Any]:
    """A guide's q over the pooled solution tokens: its distribution, the shares of tokens it raises (q > 1)
    and lowers (q < 1), at the clamp's top, its mean per category and above each entropy threshold."""
    out: dict[str, Any] = {
        "mean": float(q.mean()),
        "std": float(q.std()),
        "min": float(q.min()),
        "max": float(q.max()),
        "quantiles": quantiles(q, (5, 50, 95, 99)),
        "share_gt_1": float((q > 1).mean()),
        "share_lt_1": float((q < 1).mean()),
        "mean_by_category": {
            c: (float(q[categories == c].mean()) if (categories == c).any() else math.nan) for c in CATEGORIES
        },
        "mean_above": {
            name: (float(q[entropies > t].mean()) if (entropies > t).any() else math.nan)
            for name, t in thresholds.items()
        },
    }
    if q_max is not None:
        out["share_at_q_max"] = float((q >= q_max - 1e-6).mean())
    return out


def anchor_strength(guide, q: list[np.ndarray], entropies: list[np.ndarray]) -> list[np.ndarray]:
    """Each solution's anchor strength under k3 (the factor on beta at each token): the guide's q for a
    guide that scales the pull by q (Branch and the others), its own ``strength`` for one whose q is not its
    strength (Archer's release: q = pi/pi_ref, 1 at step 0, strength 0). Computed per solution, as the
    guide's quantiles are each completion's."""
    if not hasattr(guide, "strength"):
        return q
    out = []
    for h in entropies:
        t = torch.as_tensor(h).unsqueeze(0)
        out.append(guide.strength(t, torch.ones_like(t))[0].double().numpy())
    return out


def guide_q(
    guide, logps: list[np.ndarray], entropies: list[np.ndarray], micro_batch: int = 8
) -> list[np.ndarray]:
    """Each solution's q under ``guide`` (a sage.objective.guides object), called as the trainer calls it
    at step 0: in micro-batches of ``micro_batch`` right-padded solutions (its index ``micro``, rank 0),
    with the policy as its own reference (``ref_logps = logps``: at step 0 they are one model)."""
    out: list[np.ndarray] = []
    for micro, start in enumerate(range(0, len(logps), micro_batch)):
        chunk = range(start, min(start + micro_batch, len(logps)))
        width = max(len(logps[i]) for i in chunk)
        lp = torch.zeros(len(chunk), width)
        h = torch.zeros(len(chunk), width)
        mask = torch.zeros(len(chunk), width)
        for row, i in enumerate(chunk):
            n = len(logps[i])
            lp[row, :n] = torch.as_tensor(logps[i])
            h[row, :n] = torch.as_tensor(entropies[i])
            mask[row, :n] = 1
        q = guide(logps=lp, ref_logps=lp, entropies=h, mask=mask, step=0, rank=0, micro=micro)
        out += [q[row, : len(logps[i])].double().numpy() for row, i in enumerate(chunk)]
    return out


# --------------------------------------------------------------------------------- the report's parts
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


def token_texts(tokenizer, ids: Sequence[int]) -> tuple[list[str], list[bool]]:
    """Each token's own text (special tokens as their names) and whether it is special. A character that
    spans two byte-level tokens decodes as U+FFFD in each: symbols, for :func:`categorise`."""
    special = set(tokenizer.all_special_ids)
    return [tokenizer.decode([i]) for i in ids], [i in special for i in ids]


# -------------------------------------------------------------------------- sampling and the forward pass
def sample_solution_ids(
    sampler, prompt_ids: list[list[int]], n: int, *, temperature: float, top_p: float, max_new: int, seed: int
) -> list[list[list[int]]]:
    """n sampled solutions (token ids, the end token included when one was sampled) of each prompt, from the
    evaluator's sampler: the HF backend's decode loop, or the vLLM engine."""
    from sage.eval.sampling import EngineSampler, HFSampler

    out: list[list[list[int]]] = [[] for _ in prompt_ids]
    if isinstance(sampler, HFSampler):
        for rows, completions in sampler.completion_ids(
            prompt_ids,
            [n] * len(prompt_ids),
            max_new_tokens=max_new,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        ):
            for r, ids in zip(rows, completions, strict=True):
                out[r].append(list(ids))
        return out
    if isinstance(sampler, EngineSampler):
        from vllm import SamplingParams

        from sage.vllm_engine import generate_block

        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new)
        for r, result in enumerate(generate_block(sampler.llm, prompt_ids, params, sampler.lora, seed)):
            out[r] = [list(o.token_ids) for o in result.outputs]
        return out
    raise TypeError(f"no token ids from a {type(sampler).__name__}")


def stored_solutions(
    folder: Path, rows_by_dataset: dict[str, list[dict]], tokenizer, limit: int | None, n: int
) -> tuple[list[dict], list[list[list[int]]], dict[str, Any]]:
    """(rows, solutions' token ids, the cell's sampling settings) of a stored evaluation cell: its first
    ``limit`` problems (all: None) and first ``n`` solutions of each, found by id among the evaluation
    datasets' rows, each solution's text tokenised again (the stored text has no end token). Offline: the
    same tokens can be measured under every guide, and a run's own final samples need no new sampling."""
    for name in ("completions.json", "meta.json"):
        if not (folder / name).is_file():
            raise ConfigError(f"samples={folder}: no {name} there (an evaluation cell folder holds both)")
    meta = json.loads((folder / "meta.json").read_text())
    completions = json.loads((folder / "completions.json").read_text())
    ids = list(meta["ids"])
    by_id = {str(r.get("id", r["problem"])): r for rows in rows_by_dataset.values() for r in rows}
    missing = [i for i in ids if str(i) not in by_id]
    if missing:
        raise ConfigError(
            f"samples={folder}: problem {missing[0]!r} is in none of eval.datasets "
            f"({', '.join(rows_by_dataset)}): choose the eval group the cell was evaluated on"
        )
    keep = len(ids) if limit is None else min(limit, len(ids))
    rows = [by_id[str(i)] for i in ids[:keep]]
    solutions = [
        [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:n]]
        for texts in completions[:keep]
    ]
    key = meta.get("key")
    settings = key.get("settings", {}) if isinstance(key, dict) else {}
    return rows, solutions, settings


@torch.no_grad()
def solution_statistics(
    model, prompt_ids: Sequence[int], solution: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(entropy, log-prob) at each solution token, from one teacher-forced pass over prompt + solution:
    the model's full next-token distribution at temperature 1. Only the positions that predict a solution
    token get logits (``logits_to_keep``), so a 150k vocabulary costs |solution| x V floats, not more."""
    ids = torch.tensor([list(prompt_ids) + list(solution)], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=len(solution) + 1, use_cache=False).logits[0, :-1]
    tokens = torch.tensor(list(solution), device=logits.device)
    entropy = token_entropy(logits).double().cpu().numpy()
    logp = token_log_probs(logits, tokens).double().cpu().numpy()
    return entropy, logp


# ------------------------------------------------------------------------------------------- rendering
def _shade(value: float, scale: float, rgb: tuple[int, int, int]) -> str:
    alpha = 0.0 if not math.isfinite(value) else min(max(value / scale, 0.0), 1.0)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{alpha:.2f})"


def render_html(
    shown: list[dict[str, Any]], guide_names: list[str], thresholds: dict[str, float], title: str
) -> str:
    """The pictured solutions: per solution one line shaded by entropy (red, full at 3 nats; tokens above
    1.2 nats underlined) and one per guide shaded by q (orange above 1, blue below, full at the clamp's
    ends). Hovering a token shows its entropy, category and every q."""
    paper = thresholds.get("paper", PAPER_THRESHOLD)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>",
        "body{font-family:sans-serif;max-width:70em;margin:1em auto}",
        ".t{font-family:monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ddd;padding:.4em}",
        ".t span{border-radius:2px} .hi{text-decoration:underline 2px} h3{margin-bottom:.2em}",
        "</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p>Entropy: red, full at 3 nats; underlined above "
        f"{paper:g} nats. q: orange above 1, blue below 1, full at the clamp's end (0.6 / 1.4). "
        "Hover a token for its numbers. ↵ marks a line break.</p>",
    ]
    for k, s in enumerate(shown):
        parts.append(f"<h3>solution {k + 1}: problem {html.escape(str(s['problem_id']))}</h3>")
        parts.append(f"<p><i>{html.escape(s['problem'][:400])}</i></p>")
        lines = [("entropy", None)] + [(f"q {g}", g) for g in guide_names]
        for label, guide in lines:
            spans = []
            for i, text in enumerate(s["texts"]):
                h = s["entropy"][i]
                tip = f"H={h:.3f} nats, {s['categories'][i]}; " + ", ".join(
                    f"q_{g}={s['q'][g][i]:.3f}" for g in guide_names
                )
                shown_text = html.escape(text.replace("\n", "↵\n"))
                if guide is None:
                    color = _shade(h, 3.0, (220, 40, 40))
                else:
                    q = s["q"][guide][i]
                    color = _shade(q - 1, 0.4, (240, 140, 0)) if q >= 1 else _shade(1 - q, 0.4, (40, 90, 220))
                cls = " class='hi'" if guide is None and h > paper else ""
                spans.append(
                    f"<span{cls} style='background:{color}' title='{html.escape(tip)}'>{shown_text}</span>"
                )
            parts.append(f"<div><b>{html.escape(label)}</b><div class='t'>{''.join(spans)}</div></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _fmt(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.3f}"


def markdown(report: dict[str, Any]) -> str:
    """The summary tables of ``report`` (what :func:`diagnose` returns)."""
    s, e, w = report["settings"], report["entropy"], report["where"]
    names = list(e["above"])
    # a diagnostics.json written before issue 58 has no interval_clusters: its intervals resampled solutions
    clusters = s.get("interval_clusters", "solution")
    if clusters == "problem":
        interval = (
            f"bootstrap over problems, {DRAWS} resamples: a problem's solutions and a solution's tokens are "
            "not independent"
        )
    else:
        interval = f"bootstrap over solutions, {DRAWS} resamples: a solution's tokens are not independent"
        if s["n_samples"] > 1:
            interval += (
                f"; these resample solutions although each problem has {s['n_samples']}, so they leave out "
                "the correlation of a problem's solutions and may be too narrow; a rerun resamples problems"
            )
    lines = [
        f"# Guide diagnostics: {s['model']} on {', '.join(s['datasets'])}",
        "",
        f"{e['solutions']} solutions ({s['problems']} problems x {s['n_samples']}, sampled at temperature "
        f"{s['temperature']:g}, top-p {s['top_p']:g}, up to {s['max_new_tokens']} tokens, backend "
        f"{s['backend']}, seed {s['seed']}), {e['tokens']} solution tokens "
        f"({e['mean_tokens_per_solution']:.1f} per solution). Entropy: the model's full next-token "
        "distribution at temperature 1, from a teacher-forced pass over each prompt + solution (nats).",
        "",
        "## Token entropy",
        "",
        "| mean | " + " | ".join(e["quantiles"]) + " |",
        "|---|" + "---|" * len(e["quantiles"]),
        f"| {e['mean']:.3f} | " + " | ".join(f"{v:.3f}" for v in e["quantiles"].values()) + " |",
        "",
        "| threshold | nats | share of tokens above | per solution |",
        "|---|---|---|---|",
    ]
    for name, a in e["above"].items():
        lines.append(f"| {name} | {a['threshold']:.3f} | {a['share']:.4f} | {a['per_solution']:.2f} |")
    lines += ["", "Histogram (share of tokens per entropy bin, nats):", "", "| bin | share |", "|---|---|"]
    for b in e["histogram"]:
        lines.append(f"| [{b['low']:g}, {b['high']:g}) | {b['share']:.4f} |")
    lines += [
        "",
        "## Where the high-entropy tokens fall",
        "",
        "Share of each category among all tokens (base rate) and among the tokens above each threshold, "
        f"with the lift (share / base rate) and its {LEVEL:.0%} interval ({interval}); mean entropy and "
        "P(H > threshold) per category.",
        "",
        "| category | base rate | mean H | "
        + " | ".join(f"share > {n} | lift > {n} | P(H > {n})" for n in names)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(names),
    ]
    for c in CATEGORIES:
        cells = [_fmt(w["base_rate"][c]), _fmt(w["mean_entropy"][c])]
        for n in names:
            lift = _fmt(w[n]["lift"][c])
            if c in w[n].get("lift_interval", {}):
                lo, hi = w[n]["lift_interval"][c]
                lift += f" [{_fmt(lo)}, {_fmt(hi)}]"
            cells += [_fmt(w[n]["share"][c]), lift, _fmt(w[n]["above_rate"][c])]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    approach = ("approach_word", "step_opening")
    cells = [_fmt(sum(w["base_rate"][c] for c in approach)), ""]
    for n in names:
        share = sum(w[n]["share"][c] for c in approach)
        base = sum(w["base_rate"][c] for c in approach)
        cells += [_fmt(share), _fmt(share / base if base else math.nan), ""]
    lines.append("| **approach word or step opening** | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Tokens above each threshold: " + ", ".join(f"{n} {w[n]['tokens']}" for n in names) + ".",
    ]
    for n in names:
        lines += ["", f"The most frequent tokens above {n} ({e['above'][n]['threshold']:.3f} nats):", ""]
        lines += ["| token | count | share of those above | P(above \\| token) |", "|---|---|---|---|"]
        for t in report["top_tokens"][n]:
            shown = json.dumps(t["text"], ensure_ascii=False).replace("|", "\\|")
            lines.append(f"| `{shown}` | {t['count']} | {t['share']:.3f} | {t['selected_rate']:.3f} |")
    lines += [
        "",
        "## Each guide's q (training step 0: the policy is the reference)",
        "",
        "| guide | q mean | q std | q p5 | q p50 | q p95 | q max | share q > 1 | share q < 1 | "
        + " | ".join(f"mean q where H > {n}" for n in names)
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for name, g in report["guides"].items():
        qs = g["quantiles"]
        cells = [
            g["mean"],
            g["std"],
            qs["q5"],
            qs["q50"],
            qs["q95"],
            g["max"],
            g["share_gt_1"],
            g["share_lt_1"],
        ]
        cells += [g["mean_above"][n] for n in names]
        lines.append(f"| {name}: {g['described']} | " + " | ".join(_fmt(v) for v in cells) + " |")
    lines += ["", "Mean q per category:", "", "| guide | " + " | ".join(CATEGORIES) + " |"]
    lines.append("|---|" + "---|" * len(CATEGORIES))
    for name, g in report["guides"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(g["mean_by_category"][c]) for c in CATEGORIES) + " |")
    if "strength_by_bucket" in report:
        buckets = report["strength_by_bucket"]
        guides = [k for k in buckets[0] if k not in ("bucket", "share", "entropy_low", "entropy_high")]
        lines += [
            "",
            "## Each guide's anchor strength by entropy bucket",
            "",
            "The buckets of the training log (`anchor_buckets/`: the entropy quintiles of these tokens, q1 "
            "lowest, and the tokens above 1.2 nats); the anchor's mean strength under k3 (the factor on "
            "beta: a guide's q, Archer's 0 where it releases the anchor).",
            "",
            "| bucket | share of tokens | entropy (nats) | " + " | ".join(guides) + " |",
            "|---|---|---|" + "---|" * len(guides),
        ]
        for b in buckets:
            span = f"{b['entropy_low']:.3f}-{b['entropy_high']:.3f}"
            cells = " | ".join(_fmt(b[g]) for g in guides)
            lines.append(f"| {b['bucket']} | {_fmt(b['share'])} | {span} | {cells} |")
    if "branch_vs_archer" in report:
        lines += [
            "",
            "## Branch against Archer on the same tokens",
            "",
            "The anchor's mean strength (the factor on beta at a token under k3) of each by entropy bin "
            "(nats). Branch's strength is its q: it pulls harder toward pi_ref at high-entropy tokens. "
            "Archer's is q_low at each solution's low-entropy tokens and q_high above its quantile, 0 for "
            "its release (q_high = 0: there its q is pi/pi_ref, 1 at step 0 as in the table above, and the "
            "anchor is the policy itself); the ratio is Branch's pull over Archer's (n/a where Archer's is "
            "0).",
            "",
            "| entropy bin | share of tokens | branch strength | archer strength | branch / archer |",
            "|---|---|---|---|---|",
        ]
        for b in report["branch_vs_archer"]:
            cells = [b["share"], b["a"], b["b"], b["ratio"]]
            lines.append(f"| [{b['low']:g}, {b['high']:g}) | " + " | ".join(_fmt(v) for v in cells) + " |")
    lines += ["", "Categories: " + CATEGORY_NOTE, ""]
    return "\n".join(lines)


CATEGORY_NOTE = (
    "approach_word: the first token of a word of the approach lexicon (sage.eval.guide_diagnostics."
    "APPROACH_WORDS); step_opening: any other first visible token of a line or sentence; number: has a "
    "digit; operator: symbols only or a LaTeX command; whitespace: spaces and line breaks; other: the rest "
    "(word pieces, other words, special tokens). One category per token, the first that applies."
)


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
    check_sampling(cfg.eval)
    check_backend(cfg.eval, sampling_dtype(cfg.model, cfg.eval))
    if cfg.eval.n_samples < 1:
        raise ConfigError(f"eval.n_samples must be >= 1 (got {cfg.eval.n_samples})")
    if cfg.eval.limit is not None and cfg.eval.limit < 1:
        raise ConfigError(f"eval.limit must be >= 1 (got {cfg.eval.limit})")
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from sage.reaper import reap_on_exit

    reap_on_exit()  # a killed run's vLLM engine processes die with it
    register_diagnostics_configs()
    from sage.hydra_errors import run_app

    run_app(_hydra_main, CONF_DIR)


if __name__ == "__main__":
    main()
