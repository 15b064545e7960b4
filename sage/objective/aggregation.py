"""Loss aggregation: TRL's per-token -> scalar rule of each loss type; DAPO's zero-variance group filter."""

from __future__ import annotations

import torch


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None,
    grad_accum_steps: int,
    steps_per_generation: int,
    num_processes: int,
    training: bool,
) -> torch.Tensor:
    """TRL 1.16's per-token -> scalar rule for each loss type (docs/method.md, "The loss"), including the
    gradient-accumulation scaling TRL applies. per_token, mask: (B, T) -> scalar."""
    accum = grad_accum_steps if training else 1.0
    if loss_type == "grpo":  # mean over tokens of each sequence, then over sequences
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
    if loss_type == "bnpo":  # mean over all tokens of the micro-batch
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accum
    if loss_type == "dr_grpo":  # sum / (batch * max_completion_length)
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length) / accum
    if loss_type == "dapo":  # sum / number of tokens in the whole generation batch
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * grad_accum_steps / steps_per_generation
        return (per_token * mask).sum() / normalizer
    raise ValueError(f"algorithm.loss_type must be grpo, bnpo, dr_grpo or dapo (got {loss_type!r})")


def total_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, F) rewards of F functions (NaN: the function did not score it), (F,) weights -> (N,) the
    weighted sum TRL logs as ``reward``; NaN where no function scored the completion (unscorable)."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    return rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) rewards -> (N,) bool: False for every completion of a group whose rewards are all equal (zero
    variance), unscorable (NaN) completions left out; a group with fewer than two scored completions
    has no variance either. Decided on the rewards themselves, exactly: advantages are no test, as an
    equal-reward group's can be nonzero after scaling (the group mean rounds) and an unequal-reward
    group's can all be 0 (a batch std that overflows)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} completions do not form whole groups of {group_size}")
    groups = rewards.view(-1, group_size)  # (N / G, G)
    scored = ~torch.isnan(groups)
    high = groups.masked_fill(~scored, float("-inf")).amax(dim=1)
    low = groups.masked_fill(~scored, float("inf")).amin(dim=1)
    return (high > low).repeat_interleave(group_size)
