"""SageGRPOTrainer: TRL's GRPOTrainer with a shaped anchor q * pi_ref and a choice of divergence.

What changes w.r.t. ``trl.GRPOTrainer`` (trl==1.16.0), and nothing else:
- ``_compute_loss``: TRL computes its own policy-gradient loss (clipping, importance sampling, masks,
  aggregation, clip/entropy metrics) with its KL term switched off; we add
  ``beta * aggregate(divergence(log pi, log pi_ref + log q))`` with TRL's aggregation rule for the loss
  type. Every aggregation rule is linear in the per-token loss, so with q == 1 and k3 the sum is TRL's GRPO
  loss (tested to 1e-6 against TRL itself).
- ``_get_per_token_logps_and_entropies``: keeps the log-probs and entropies of the loss pass, so guides
  and divergences reuse them: no extra forward pass.
- ``_generate_and_score_completions`` (only with ``filter_zero_variance_groups``, DAPO): groups whose
  rewards are all equal carry no policy gradient; their completions are masked out of the loss and of the
  token count, as DAPO's dynamic-sampling filter drops them (without resampling replacements).
Generation, rewards, advantages, the reference model and checkpointing are TRL's.

Logged per step on top of TRL's metrics: ``kl`` (k3 to the UNSHAPED pi_ref: comparable across GRPO and
all SAGE variants), ``divergence`` (the shaped term actually optimised, before beta), ``guide/q_mean``,
``guide/q_min``, ``guide/q_max``, ``guide/active_frac`` (share of completion tokens with q != 1) and the
guide's current hyperparameters.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from sage.objective.aggregation import aggregate, informative_groups
from sage.objective.divergences import k3


def describe_batch(args, num_processes: int, longest_prompt_tokens: int) -> str:
    """One line on how TRL's knobs shape a step: completions per forward pass (the memory-bound
    micro-batch), accumulation, completions and prompts per optimiser step, and the longest micro-batch
    in tokens. ``args`` is a GRPOConfig after its own __post_init__ (steps_per_generation resolved)."""
    micro, accum, g = args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_generations
    per_step = micro * accum * num_processes
    longest = longest_prompt_tokens + args.max_completion_length
    return (
        f"batch: {micro} completions per forward pass x {accum} accumulation steps x {num_processes} "
        f"processes = {per_step} completions ({per_step // g} prompts x {g} generations) per optimiser step; "
        f"{args.generation_batch_size} completions generated at a time; longest micro-batch "
        f"{micro} x ({longest_prompt_tokens} prompt + {args.max_completion_length} completion) = "
        f"{micro * longest} tokens"
    )


class SageGRPOTrainer(GRPOTrainer):
    """GRPO-family trainer whose anchor is q * pi_ref; see the module docstring for what it overrides.

    ``divergence`` has ``beta`` and ``per_token(logp, ref_logp)``; ``guide`` is called with the loss
    pass's log-probs and entropies and returns q (B, T). ``args.beta`` must equal ``divergence.beta``:
    TRL uses it to decide whether to load the reference model.
    """

    def __init__(self, *args, divergence, guide, filter_zero_variance_groups: bool = False, **kwargs):
        self.divergence = divergence
        self.guide = guide
        self.filter_zero_variance_groups = filter_zero_variance_groups
        self._loss_pass: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(*args, **kwargs)
        if self.beta != divergence.beta:
            raise ValueError(f"GRPOConfig.beta={self.beta} differs from divergence.beta={divergence.beta}")
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"algorithm.loss_type={self.loss_type!r} is not supported by SageGRPOTrainer")
        if self.args.use_bias_correction_kl != divergence.importance_weighted:
            raise ValueError(
                f"GRPOConfig.use_bias_correction_kl={self.args.use_bias_correction_kl} differs from "
                f"divergence.importance_weighted={divergence.importance_weighted}"
            )

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.filter_zero_variance_groups:
            return out
        keep = informative_groups(out["advantages"], self.num_generations)  # (B,)
        out["completion_mask"] = out["completion_mask"] * keep.unsqueeze(1).to(out["completion_mask"].dtype)
        out["num_items_in_batch"] = self.accelerator.gather(out["completion_mask"].sum()).sum()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["frac_groups_filtered"].append(1.0 - keep.float().mean().item())
        return out

    def _get_per_token_logps_and_entropies(self, *args, compute_entropy: bool = False, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, compute_entropy=compute_entropy, **kwargs)
        if compute_entropy:  # only the loss pass asks for entropies; keep it for the guide and divergence
            self._loss_pass = (out[0], out[1])
        return out

    def _compute_loss(self, model, inputs):
        beta, self.beta = self.beta, 0.0  # TRL's unshaped term off: the shaped one is added below
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta = beta
        assert self._loss_pass is not None, "TRL's loss pass did not request entropies"
        logps, entropies = self._loss_pass  # (B, T) each; logps carries the gradient
        self._loss_pass = None

        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        ref_logps = inputs.get("ref_per_token_logps")  # (B, T); absent when divergence=none
        step = self.state.global_step  # optimiser steps: the schedule must not run faster under accumulation
        mode = "train" if self.model.training else "eval"
        with torch.no_grad():
            q = self.guide(
                logps=logps.detach(), ref_logps=ref_logps, entropies=entropies, mask=mask, step=step
            )
        self._log_guide(q, mask, step, mode)
        if beta == 0.0:
            return loss

        per_token = self.divergence.per_token(logps, ref_logps + torch.log(q))  # (B, T)
        if self.divergence.importance_weighted:
            per_token = per_token * self._importance_ratio(logps, inputs, mask)
        loss = loss + beta * aggregate(
            per_token,
            mask,
            self.loss_type,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            grad_accum_steps=self.current_gradient_accumulation_steps,
            steps_per_generation=self.args.steps_per_generation,
            num_processes=self.accelerator.num_processes,
            training=mode == "train",
        )
        with torch.no_grad():
            self._metrics[mode]["divergence"].append(self._masked_mean(per_token, mask))
            self._metrics[mode]["kl"].append(self._masked_mean(k3(logps, ref_logps), mask))
        return loss

    def _importance_ratio(self, logps: torch.Tensor, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        """pi / pi_old with gradient, token- or sequence-level as TRL's coef_1: (B, T) or (B, 1)."""
        old = inputs.get("old_per_token_logps")
        log_ratio = logps - (logps.detach() if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        return torch.exp(log_ratio)

    def _masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        totals = self.accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_guide(self, q: torch.Tensor, mask: torch.Tensor, step: int, mode: str) -> None:
        valid = mask.bool()
        qv = q[valid]
        if qv.numel() == 0:
            return
        m = self._metrics[mode]
        m["guide/q_mean"].append(qv.mean().item())
        m["guide/q_min"].append(qv.min().item())
        m["guide/q_max"].append(qv.max().item())
        m["guide/active_frac"].append((qv != 1.0).float().mean().item())
        for name, value in self.guide.params(step).items():
            m[f"guide/{name}"].append(value)
