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
    """TRL 1.16's per-token -> scalar rule for each loss type (SAGE.md section 2), including the
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


def informative_groups(advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: False for every completion of a group whose advantages are all 0, which happens exactly
    when all its rewards are equal (zero variance), whatever the reward scaling."""
    if advantages.numel() % group_size:
        raise ValueError(f"{advantages.numel()} completions do not form whole groups of {group_size}")
    groups = advantages.view(-1, group_size)  # (B / G, G)
    return (groups != 0).any(dim=1).repeat_interleave(group_size)
