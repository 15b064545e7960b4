"""Where the anchor acts, by token entropy: per bucket of the policy's token entropy, what share of the
tokens it holds, the guide's mean q, the anchor's mean value, the anchor's share of the per-token gradient
signal against the policy-gradient term's, the share of tokens the PPO clip silenced and the mean advantage.

SAGE's premise is about where the anchor acts (high-entropy forks against low-entropy continuations), so one
overall KL and one overall entropy per step cannot show whether a guide does what it claims. The buckets are
the micro-batch's entropy quintiles (``q1`` lowest .. ``q5`` highest; their edges move with the policy) and
the fixed threshold of the Branch guide's default, 1.2 nats (``above_1.2``: tokens above it).

Gradient signal per token: the derivative of each term's per-token loss with respect to the sampled token's
log-probability. For the policy-gradient term that is ``-A * r`` (r the importance ratio, 0 where the clip
holds the gradient); for the anchor, ``beta * d divergence / d log pi``. Both multiply the same
``d log pi / d logits`` in the backward pass, so their magnitudes compare the two pulls at that token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the maths runs: sage-report reads the names without it
    import torch

QUINTILES = ("q1", "q2", "q3", "q4", "q5")
FIXED = 1.2  # nats: the Branch guide's default threshold (conf/guide/branch.yaml)
STATS = ("share", "q", "anchor", "anchor_grad_share", "clipped", "advantage")


def bucket_masks(
    entropies: torch.Tensor, mask: torch.Tensor, fixed: float = FIXED
) -> dict[str, torch.Tensor]:
    """Boolean (B, T) masks of each bucket over the valid tokens (``mask``): the quintiles of the valid
    tokens' entropies (a token at an edge goes to the lower bucket; the edges are ``torch.quantile``'s,
    linear interpolation) and ``above_<fixed>``."""
    import torch

    valid = mask.bool()
    values = entropies[valid].float()
    out = {}
    if values.numel() == 0:
        empty = torch.zeros_like(valid)
        return {**{name: empty for name in QUINTILES}, f"above_{fixed:g}": empty}
    edges = torch.quantile(values, torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=values.dtype))
    index = torch.bucketize(entropies.float(), edges)  # 0..4; right=False: an edge value goes below
    for i, name in enumerate(QUINTILES):
        out[name] = valid & (index == i)
    out[f"above_{fixed:g}"] = valid & (entropies > fixed)
    return out


def bucket_stats(
    entropies: torch.Tensor,
    mask: torch.Tensor,
    *,
    q: torch.Tensor,
    anchor: torch.Tensor | None,
    anchor_grad: torch.Tensor | None,
    pg_grad: torch.Tensor,
    clipped: torch.Tensor,
    advantages: torch.Tensor,
    fixed: float = FIXED,
) -> dict[str, float]:
    """``{"<bucket>/<stat>": value}`` for every bucket of :func:`bucket_masks` and stat of STATS, from (B, T)
    tensors: the guide's ``q``, the anchor's per-token value (None: no anchor), the per-token gradient
    signals (``anchor_grad`` None: no anchor), the clip's silenced tokens (bool) and the advantages ((B,) or
    (B, T)). An empty bucket's stats other than its share are NaN (nothing to average)."""
    import torch

    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(q)
    total = mask.bool().sum().clamp(min=1)
    out: dict[str, float] = {}
    nan = float("nan")
    for name, where in bucket_masks(entropies, mask, fixed).items():
        n = int(where.sum())
        out[f"{name}/share"] = n / int(total)
        if n == 0:
            out.update({f"{name}/{s}": nan for s in STATS if s != "share"})
            continue
        out[f"{name}/q"] = q[where].float().mean().item()
        out[f"{name}/anchor"] = 0.0 if anchor is None else anchor[where].float().mean().item()
        pull = torch.zeros(n) if anchor_grad is None else anchor_grad[where].abs().float()
        push = pg_grad[where].abs().float()
        both = (pull + push).sum()
        out[f"{name}/anchor_grad_share"] = (pull.sum() / both).item() if both > 0 else 0.0
        out[f"{name}/clipped"] = clipped[where].float().mean().item()
        out[f"{name}/advantage"] = advantages[where].float().mean().item()
    return out
