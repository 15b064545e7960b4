"""What a vLLM rollout's importance weights look like, step by step: pure functions the trainer's
``sage.train.deferred_ratio`` wires into its metrics, and the bounds at which it warns.

The correction (TRL's ``vllm_importance_sampling_*``) weighs a completion by the trainer's probability of it
over the engine's. Its mean stays near 1 however the two sides differ, so the mean says little; what matters
is how far single sequences are reweighted, and how many the mode masks or clips. Logged per step:

- ``sampling/sequence_log_ratio/std``: the standard deviation over the generation batch's sequences of the
  per-sequence log-ratio, the sum over a sequence's tokens of log pi_trainer - log pi_engine (the log of a
  ``sequence_*`` mode's weight before its bound). Sequences with no token that counts are left out.
- ``sampling/sequence_log_ratio/tail_frac``: the share of those sequences with |log-ratio| > log 2 (a weight
  below 1/2 or above 2).
- ``sampling/importance_sampling_ratio/cut_frac``: the share of the mode's units (sequences in the
  ``sequence_*`` modes, tokens in the ``token_*`` ones) whose ratio lies outside
  [``clip_min``, ``clip_max``]: set to 0 by a ``*_mask`` mode, clamped by a ``*_truncate`` one.
- ``sampling/truncated_mass/mean``: the mean over sampled tokens of the probability mass the sampler's
  truncation (``min_p``, ``top_k``, ``top_p``) removed at the token's position, under the trainer's
  distribution at the sampling temperature (:func:`truncation_mass`). The anchor term is estimated on sampled
  tokens only: it never sees that mass (docs/method.md, "Truncated sampling and the anchor").

Bounds (docs/method.md, "Importance weights at length", says why): :data:`SPREAD_BOUND` on the standard
deviation and :data:`CUT_BOUND` on the cut share; :func:`weight_warning` writes the one line.
"""

from __future__ import annotations

import math

import torch

SPREAD_KEY = "sampling/sequence_log_ratio/std"
TAIL_KEY = "sampling/sequence_log_ratio/tail_frac"
CUT_KEY = "sampling/importance_sampling_ratio/cut_frac"
MASS_KEY = "sampling/truncated_mass/mean"

TAIL = math.log(2.0)
"""|log-ratio| beyond which a sequence counts in the tail share: a weight below 1/2 or above 2."""
SPREAD_BOUND = 0.5
"""Warn above this standard deviation of the per-sequence log-ratio: for log-normal weights of that spread
the batch's effective sample size is exp(-0.25) = 78% of its sequences, and the middle 90% of the weights
span [0.44, 2.28] (log-ratios centred at 0): a fifth of the batch's information goes to reweighting."""
CUT_BOUND = 0.05
"""Warn when the mode masks or clips more than this share of its units: a masked sequence is dropped from the
policy gradient, and the ones dropped are the longest and the most mismatched, not a random sample."""

SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")
MODES = ("token_truncate", "token_mask", *SEQUENCE_MODES)


def sequence_log_ratios(
    logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence log-ratio (B,): the masked sum over tokens of ``logps - sampling_logps`` (B, T each). A
    token the engine gave no log-prob for (NaN) adds 0, as in TRL's ratio."""
    return torch.nan_to_num((logps - sampling_logps) * mask, nan=0.0).sum(dim=-1)


def weight_sums(
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """Additive sums over a batch (B, T inputs), from which :func:`weight_figures` gives the logged figures,
    so that micro-batches and processes add up: (sequences, sum of log-ratios, sum of their squares, sequences
    in the tail, units of the mode, units outside [clip_min, clip_max]), float64."""
    if mode not in MODES:
        raise ValueError(f"trl.vllm_importance_sampling_mode={mode!r}: one of {', '.join(MODES)}")
    valid = mask.bool()
    counted = valid.any(dim=-1)  # (B,) sequences with at least one token that counts
    x = sequence_log_ratios(logps, sampling_logps, mask).double()[counted]
    if mode in SEQUENCE_MODES:
        units = x
    else:
        units = torch.nan_to_num(logps - sampling_logps, nan=0.0).double()[valid]
    low = -math.inf if clip_min is None or clip_min <= 0 else math.log(clip_min)
    high = math.inf if clip_max is None else math.log(clip_max)
    outside = (units < low) | (units > high)
    return torch.stack(
        [
            x.new_tensor(float(x.numel())),
            x.sum(),
            (x * x).sum(),
            (x.abs() > TAIL).sum().double(),
            x.new_tensor(float(units.numel())),
            outside.sum().double(),
        ]
    )


def weight_figures(sums: torch.Tensor) -> dict[str, float]:
    """The logged figures from :func:`weight_sums` (added over micro-batches and processes): the log-ratio's
    standard deviation over sequences (population; 0 with fewer than 2), the tail share and the cut share."""
    n, s, s2, tail, units, outside = sums.tolist()
    variance = (s2 - s * s / n) / n if n >= 2 else 0.0
    return {
        SPREAD_KEY: math.sqrt(max(variance, 0.0)),
        TAIL_KEY: tail / n if n else 0.0,
        CUT_KEY: outside / units if units else 0.0,
    }


def weight_warning(figures: dict[str, float], mode: str, step: int) -> str | None:
    """The one warning line when the log-ratio's spread passes :data:`SPREAD_BOUND` or the cut share
    :data:`CUT_BOUND` (None when neither does)."""
    spread, cut = figures[SPREAD_KEY], figures[CUT_KEY]
    over = []
    if spread > SPREAD_BOUND:
        over.append(
            f"the per-sequence log-ratio's standard deviation is {spread:.3f} (bound {SPREAD_BOUND:g})"
        )
    if cut > CUT_BOUND:
        unit = "sequences" if mode in SEQUENCE_MODES else "tokens"
        verb = "masked" if mode.endswith("_mask") else "clipped"
        over.append(f"{mode} {verb} {100 * cut:.1f}% of the {unit} (bound {100 * CUT_BOUND:g}%)")
    if not over:
        return None
    return (
        f"step {step}: the importance weights of the vLLM rollouts spread: {' and '.join(over)}; the "
        "engine samples from another distribution than the trainer computes (dtype, kernels, lag); see "
        "docs/method.md, 'Importance weights at length'"
    )


def truncation_active(min_p: float | None, top_p: float | None, top_k: int | None) -> bool:
    """Whether the sampling keys remove any mass: ``min_p`` > 0, ``top_p`` < 1 or ``top_k`` > 0."""
    return (min_p or 0.0) > 0.0 or (top_p if top_p is not None else 1.0) < 1.0 or (top_k or 0) > 0


def truncation_mass(
    logits: torch.Tensor, min_p: float | None, top_p: float | None, top_k: int | None
) -> torch.Tensor:
    """The probability mass the sampler's truncation removes at each position (N,), from ``logits`` (N, V)
    already divided by the temperature: 1 - the mass of the tokens it keeps under the untruncated softmax.
    In vLLM's order: ``min_p`` keeps the tokens of probability at least min_p x the largest, then ``top_k``
    the k most likely of those, then ``top_p`` the most likely of those whose renormalised mass first reaches
    top_p (at least one token). transformers' ``generate`` applies top-k and top-p before min-p, which keeps
    the same set unless top_p < 1 and min_p > 0 are set together."""
    probs = logits.float().softmax(dim=-1)  # (N, V)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if (min_p or 0.0) > 0.0:
        keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
    if (top_k or 0) > 0 and top_k < probs.size(-1):
        kth = probs.topk(top_k, dim=-1).values[:, -1:]  # (N, 1)
        keep = keep & (probs >= kth)
    if top_p is not None and top_p < 1.0:
        kept = probs * keep
        ordered, order = kept.sort(dim=-1, descending=True)
        before = ordered.cumsum(dim=-1) - ordered  # renormalised mass of the more likely kept tokens
        inside = before < top_p * kept.sum(dim=-1, keepdim=True)
        keep = keep & torch.zeros_like(keep).scatter(-1, order, inside)
    return (1.0 - (probs * keep).sum(dim=-1)).clamp(min=0.0)


def watch_truncation(
    causal_lm, logits_to_keep: int, temperature: float, min_p, top_p, top_k, masses: list
) -> torch.utils.hooks.RemovableHandle:
    """A forward hook on ``causal_lm``'s backbone (transformers' ``base_model``, whose last hidden state is
    what the output layer reads) that appends to ``masses``, per forward call, the mass the truncation removes
    at each of the last ``logits_to_keep`` positions that predict a token (b, T) (:func:`truncation_mass`),
    through the output layer at ``temperature``, without gradient, a chunk of rows at a time. TRL's fused
    head never holds the full logits: this projects them again (one output-layer product per token)."""
    head = causal_lm.get_output_embeddings()
    chunk = max(1, 2**24 // head.weight.size(0))  # rows x vocabulary logits at a time

    def measure(module, args, output):
        with torch.no_grad():
            hidden = output[0].detach()[:, -logits_to_keep - 1 : -1]  # (b, T, H)
            rows = hidden.reshape(-1, hidden.size(-1))
            mass = [
                truncation_mass(head(rows[i : i + chunk]).float() / temperature, min_p, top_p, top_k)
                for i in range(0, rows.size(0), chunk)
            ]
            masses.append(torch.cat(mass).view(hidden.shape[:2]))

    return causal_lm.base_model.register_forward_hook(measure)
