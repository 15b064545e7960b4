"""SageGRPOTrainer: TRL's GRPOTrainer with a shaped anchor q * pi_ref and a choice of divergence.

What changes w.r.t. ``trl.GRPOTrainer`` (trl==1.16.0) here is below. Three mixins do the rest, each listing
the TRL internals it relies on: ``sage.train.checkpointing`` (whole-or-absent checkpoints, their rotation,
the learning rate on resume), ``sage.train.deferred_ratio`` (a vLLM rollout's importance-sampling ratio from
the loss pass, the importance weights' figures, the truncated mass) and ``sage.train.vllm_hookup`` (which
vLLM engine serves the rollouts, and the log-probs and weights it gets).
- ``_compute_loss``: TRL computes its own policy-gradient loss (clipping, importance sampling, masks,
  aggregation, clip/entropy metrics) with its KL term switched off; we add
  ``beta * aggregate(divergence(log pi, log pi_ref + log q))`` with TRL's aggregation rule for the loss
  type. Every aggregation rule is linear in the per-token loss, so with q == 1 and k3 the sum is TRL's GRPO
  loss (tested to 1e-6 against TRL itself). ``divergence=sequence_kl`` adds the anchor of whole completions
  instead, each completion's term spread over its tokens (``sequence_kl_shares``) and aggregated by the
  same rule, so its beta is per token too.
- ``_get_per_token_logps_and_entropies``: keeps the log-probs and entropies of the loss pass, so guides
  and divergences reuse them: no extra forward pass.
- ``_calculate_rewards``: unchanged, but its (gathered) rewards are kept for the DAPO filter, as TRL's
  ``_generate_and_score_completions`` returns advantages only.
- ``_generate_and_score_completions``: records the optimiser step at which a training generation batch is
  generated. With ``filter_zero_variance_groups`` (DAPO), groups whose rewards are all equal carry no
  policy gradient; their completions are masked out of the loss and out of the token count
  ``num_items_in_batch`` (recounted over ``completion_mask * tool_mask``, the mask the loss uses), as
  DAPO's dynamic-sampling filter drops them (without resampling replacements). The groups are found from
  the rewards, not the advantages: an equal-reward group's advantages need not be exactly 0 after scaling.
- ``_prepare_inputs``: unchanged, but notes which micro-batch it hands out: (the step its generation
  batch was generated at, its index in that batch). The guide gets this identity and the process rank,
  so its noise is the same in a resumed and an uninterrupted run, differs across processes, and is the
  same on each pass over a micro-batch (``num_iterations > 1``); the schedule's position is that step too,
  so a micro-batch's q does not change between passes (except through the policy's own log-probs).
Generation (through TRL's ``rollout_func`` hook under ``rollout=fast`` and ``rollout=vllm``), rewards,
advantages, the reference model and what a checkpoint holds are TRL's.

TRL internals it relies on, safe only because trl==1.16.0 is pinned and tests/test_trainer_equivalence.py
guards the loss against TRL's: the five private methods above; ``beta`` set to 0 around
``super()._compute_loss`` (TRL's own KL term off); ``_metrics[mode]`` appended to; ``_step`` (TRL's
micro-batch counter) read to name a micro-batch; TRL's attributes ``reward_weights``,
``num_generations(_eval)``, ``loss_type``, ``epsilon_low``, ``epsilon_high``, ``importance_sampling_level``,
``current_gradient_accumulation_steps`` and the input keys ``completion_mask``, ``tool_mask``,
``ref_per_token_logps``, ``old_per_token_logps``, ``importance_sampling_ratio``, ``advantages`` read; TRL's
aggregation rules copied (``sage.objective.aggregation``), and its clip rule in ``_log_buckets``.

Logged per step on top of TRL's metrics: ``kl`` (k3 to the UNSHAPED pi_ref: comparable across GRPO and
all SAGE variants), ``divergence`` (the shaped term actually optimised, before beta), ``guide/q_mean``,
``guide/q_min``, ``guide/q_max``, ``guide/active_frac`` (share of completion tokens with q != 1) and the
guide's current hyperparameters; at the tokens that choose a strategy (``fork_markers``: the testbed fork
world's, those in the model's vocabulary), ``guide/q_fork`` and ``guide/active_frac_fork``, the same
figures there (passed to the guide as ``fork``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from trl import GRPOTrainer

from sage.objective.aggregation import aggregate, informative_groups, total_rewards
from sage.objective.divergences import k3
from sage.train.checkpointing import CheckpointMixin
from sage.train.deferred_ratio import DeferredRatioMixin
from sage.train.vllm_hookup import VllmHookupMixin


class SageGRPOTrainer(CheckpointMixin, DeferredRatioMixin, VllmHookupMixin, GRPOTrainer):
    """GRPO-family trainer whose anchor is q * pi_ref; see the module docstring for what it overrides.

    ``divergence`` has ``beta`` and ``per_token(logp, ref_logp)``; ``guide`` is called with the loss
    pass's log-probs and entropies and returns q (B, T). ``args.beta`` must equal ``divergence.beta``:
    TRL uses it to decide whether to load the reference model. ``fork_markers``: tokens where a strategy is
    chosen (the testbed fork world's); those in the model's vocabulary are where q is logged apart, and what
    guide=fork reads.
    """

    def __init__(
        self,
        *args,
        divergence,
        guide,
        filter_zero_variance_groups: bool = False,
        anchor_buckets: bool = True,
        fork_markers: Iterable[str] = (),
        **kwargs,
    ):
        self.divergence = divergence
        self.guide = guide
        self.anchor_buckets = anchor_buckets  # log where the anchor acts (sage.objective.buckets)
        self.filter_zero_variance_groups = filter_zero_variance_groups
        self._loss_pass: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rewards_per_func: torch.Tensor | None = None  # (N, F): last generation batch, every process
        self._generated_at = 0  # optimiser step the buffered training generation batch was generated at
        self._batch_id: tuple[int, int] | None = None  # (step, micro) of the micro-batch being trained on
        self._eval_batch = (-1, -1)  # (step, index) of the last evaluation batch
        config = kwargs["args"]  # refused before TRL loads a model
        if config.beta != divergence.beta:
            raise ValueError(f"GRPOConfig.beta={config.beta} differs from divergence.beta={divergence.beta}")
        if config.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"algorithm.loss_type={config.loss_type!r} is not supported by SageGRPOTrainer")
        if config.use_bias_correction_kl != divergence.importance_weighted:
            raise ValueError(
                f"GRPOConfig.use_bias_correction_kl={config.use_bias_correction_kl} differs from "
                f"divergence.importance_weighted={divergence.importance_weighted}"
            )
        super().__init__(*args, **kwargs)
        vocab = self.processing_class.get_vocab()
        self._fork_ids = torch.tensor([vocab[m] for m in fork_markers if m in vocab], dtype=torch.long)

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        out = super()._generate_and_score_completions(inputs)
        if training:
            self._generated_at = self.state.global_step
        if not self.filter_zero_variance_groups:
            return out
        group_size = self.num_generations if training else self.num_generations_eval
        rewards = total_rewards(self._rewards_per_func, self.reward_weights)  # (N,) every process's
        local = out["advantages"].size(0)
        start = self.accelerator.process_index * local  # TRL's slice of this process's completions
        mask = out["completion_mask"]
        keep = informative_groups(rewards, group_size)[start : start + local].to(mask.device)
        out["completion_mask"] = loss_mask = mask * keep.unsqueeze(1).to(mask.dtype)
        if "tool_mask" in out:  # tool-result tokens are not the model's: the loss does not count them
            loss_mask = loss_mask * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        mode = "train" if training else "eval"
        self._metrics[mode]["frac_groups_filtered"].append(1.0 - keep.float().mean().item())
        return out

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            # TRL hands out micro-batch (self._step % steps_per_generation) of the buffered generation batch
            # (self._step counts micro-batches; TRL's training_step increments it after the loss).
            self._batch_id = (self._generated_at, self._step % self.args.steps_per_generation)
        else:  # evaluation generates per batch: its index within this step's evaluation, negative
            step = self.state.global_step
            index = self._eval_batch[1] + 1 if self._eval_batch[0] == step else 0
            self._eval_batch = (step, index)
            self._batch_id = (step, -1 - index)
        return inputs

    def _get_per_token_logps_and_entropies(self, *args, compute_entropy: bool = False, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, compute_entropy=compute_entropy, **kwargs)
        if compute_entropy:  # only the loss pass asks for entropies: keep it for the guide and divergence
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
        # The micro-batch's identity (see _prepare_inputs); a loss computed outside TRL's input pipeline is
        # micro-batch 0 of the current step. Steps are optimiser steps: the schedule must not run faster
        # under accumulation.
        step, micro = self._batch_id or (self.state.global_step, 0)
        mode = "train" if self.model.training else "eval"
        fork = None
        if len(self._fork_ids):
            fork = torch.isin(inputs["completion_ids"], self._fork_ids.to(mask.device)) & mask.bool()
        with torch.no_grad():
            q = self.guide(
                logps=logps.detach(),
                ref_logps=ref_logps,
                entropies=entropies,
                mask=mask,
                step=step,
                rank=self.accelerator.process_index,
                micro=micro,
                fork=fork,
            )
        self._log_guide(q, mask, step, mode, fork)
        if beta == 0.0:
            if mode == "train" and self.anchor_buckets:
                self._log_buckets(inputs, logps, entropies, mask, q, None, beta)
            return loss
        if self.divergence.level == "sequence":  # each completion's term spread over its tokens
            per_token = self.divergence.per_token(logps, ref_logps + torch.log(q), mask)  # (B, T)
        else:
            per_token = self.divergence.per_token(logps, ref_logps + torch.log(q))  # (B, T)
        if self.divergence.importance_weighted:
            per_token = per_token * self._importance_ratio(logps, inputs, mask)
        if mode == "train" and self.anchor_buckets:
            self._log_buckets(inputs, logps, entropies, mask, q, per_token, beta)
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

    def _log_buckets(self, inputs, logps, entropies, mask, q, per_token, beta: float) -> None:
        """Where the anchor acts (``sage.objective.buckets``), per token-entropy bucket of this micro-batch,
        logged under ``anchor_buckets/``. The anchor's per-token gradient signal is the derivative of its
        per-token term with respect to the token's log-prob (autograd over the elementwise divergence only,
        not the model); the policy-gradient term's is TRL's ``-A * r`` where the clip lets it through."""
        from sage.objective.buckets import bucket_stats

        advantages = inputs["advantages"]
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        old = inputs.get("old_per_token_logps")
        with torch.no_grad():
            ratio = torch.exp(logps.detach() - (logps.detach() if old is None else old))
            clipped = ((ratio < 1 - self.epsilon_low) & (adv < 0)) | (
                (ratio > 1 + self.epsilon_high) & (adv > 0)
            )
            pg = adv * ratio * (~clipped)
            if "importance_sampling_ratio" in inputs:
                pg = pg * inputs["importance_sampling_ratio"]
        anchor_grad = None
        if per_token is not None:
            (grad,) = torch.autograd.grad((per_token * mask).sum(), logps, retain_graph=True)
            anchor_grad = beta * grad
        stats = bucket_stats(
            entropies.detach(),
            mask,
            q=q,
            anchor=None if per_token is None else per_token.detach(),
            anchor_grad=anchor_grad,
            pg_grad=pg,
            clipped=clipped,
            advantages=advantages,
        )
        m = self._metrics["train"]
        for name, value in stats.items():
            if value == value:  # an empty bucket's NaN is left out of the step's mean
                m[f"anchor_buckets/{name}"].append(value)

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

    def _log_guide(self, q: torch.Tensor, mask: torch.Tensor, step: int, mode: str, fork=None) -> None:
        valid = mask.bool()
        qv = q[valid]
        if qv.numel() == 0:
            return
        m = self._metrics[mode]
        m["guide/q_mean"].append(qv.mean().item())
        m["guide/q_min"].append(qv.min().item())
        m["guide/q_max"].append(qv.max().item())
        m["guide/active_frac"].append((qv != 1.0).float().mean().item())
        if fork is not None and fork.any():  # where the fork world decides: does the guide act there?
            m["guide/q_fork"].append(q[fork].mean().item())
            m["guide/active_frac_fork"].append((q[fork] != 1.0).float().mean().item())
        for name, value in self.guide.params(step).items():
            m[f"guide/{name}"].append(value)
