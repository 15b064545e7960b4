"""The guide diagnostics' maths (``python -m sage.eval.guide_diagnostics``), pure: each solution token's
entropy and log-prob from logits, its category (:data:`CATEGORIES`), and the summaries of a diagnostics
report: the entropy distribution, where the high-entropy tokens fall (with problem-clustered bootstrap
intervals of each category's lift), each guide's q at training step 0 and the anchor strength it gives."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

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
