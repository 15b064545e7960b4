"""The importance-sampling correction of a vLLM rollout, computed in the loss pass: ``DeferredRatioMixin``.

The engine returns the log-probs the trainer computes (``sage.vllm_worker.use_tempered_logprobs``: at the
sampling temperature, before min-p/top-p/top-k truncation). When the policy cannot have moved between a
generation batch and its last micro-batch (``num_iterations == 1`` and the generation batch consumed within
one optimiser step: TRL's own condition for dropping ``old_per_token_logps``), TRL's extra no-grad log-prob
pass over every completion computes what the loss pass computes again at the same weights. Then
``_generate_and_score_completions`` runs with the correction off (no pass), and the loss pass computes the
ratio from its own detached log-probs (:func:`vllm_importance_ratio`, TRL's rule) and puts it where TRL's loss
reads it, with TRL's metrics. Either way the pass also logs the importance weights' spread and cut share,
with a one-line warning past their bounds, and in training the mass the sampler's truncation removed at the
loss's tokens, through a forward hook on the policy's backbone (TRL's fused head never holds the full
logits): ``sage.train.importance`` holds that maths.

TRL internals (trl==1.16.0) it relies on:
- overrides ``_generate_and_score_completions`` (switches ``vllm_importance_sampling_correction`` off around
  ``super()`` for a deferred batch), ``_get_per_token_logps_and_entropies`` (only the loss pass asks for
  entropies) and ``_compute_loss`` (notes the micro-batch around ``super()``);
- writes ``inputs["importance_sampling_ratio"]``, the key TRL's loss reads the ratio from, and reads
  ``sampling_per_token_logps``, ``old_per_token_logps``, ``completion_mask`` and ``tool_mask``;
- copies TRL's ratio rule and its metric names ``sampling/sampling_logp_difference/*`` and
  ``sampling/importance_sampling_ratio/{min,mean,max}``, appended to ``_metrics["train"]`` once per
  generation batch as TRL does;
- reads ``use_vllm``, ``vllm_importance_sampling_{mode,clip_min,clip_max}``, ``num_iterations``,
  ``temperature``, ``min_p``, ``top_p``, ``top_k``, and ``_batch_id`` (the micro-batch's index in its
  generation batch, set by the trainer's ``_prepare_inputs``).
"""

from __future__ import annotations

import logging
import math

import torch

from sage.train import importance

log = logging.getLogger(__name__)


def vllm_importance_ratio(
    logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's (1.16) importance-sampling ratio of the trainer's log-probs ``logps`` over the engine's
    ``sampling_logps`` (B, T), ``mask`` the tokens that count: per token (B, T) in the ``token_*`` modes,
    per sequence (B, 1) in the ``sequence_*`` ones; ``*_truncate`` clamps it to [clip_min, clip_max],
    ``*_mask`` sets it to 0 outside. A token the engine gave no log-prob for (NaN) has ratio 1."""
    diff = torch.nan_to_num((logps - sampling_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(
        f"trl.vllm_importance_sampling_mode={mode!r}: token_truncate, token_mask, "
        "sequence_truncate or sequence_mask"
    )


class DeferredRatioMixin:
    """Put before ``GRPOTrainer`` among the bases; see the module docstring."""

    _deferred_correction = False  # the buffered generation batch's ratio is computed in the loss pass
    _loss_inputs: dict | None = None  # the micro-batch whose loss is being computed
    _ratio_stats: torch.Tensor | None = None  # the deferred ratio's metrics over a generation batch
    _weight_sums: torch.Tensor | None = None  # importance.weight_sums over a generation batch
    _truncated: torch.Tensor | None = None  # (B, T) mass truncation removed, of the loss pass

    def _policy_fixed_through_generation_batch(self) -> bool:
        """Whether the weights cannot move between a generation batch's rollout and its last micro-batch:
        one pass over it (num_iterations 1) within one optimiser step (TRL's own test for dropping
        old_per_token_logps)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.num_iterations == 1 and self.args.gradient_accumulation_steps % generate_every == 0

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        defer = (
            training
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and self._policy_fixed_through_generation_batch()
        )
        if training:
            self._deferred_correction = defer
        if defer:
            self.vllm_importance_sampling_correction = False
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            if defer:
                self.vllm_importance_sampling_correction = True
        if training and self.use_vllm and self.vllm_importance_sampling_correction and not defer:
            mask = out["completion_mask"] * out.get("tool_mask", 1)
            self._log_weights(self._weight_sums_of(out["old_per_token_logps"], out, mask))
        return out

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, compute_entropy: bool = False, **kwargs
    ):
        # only the loss pass asks for entropies; in training it also measures what truncation removed
        watch = compute_entropy and self.model.training
        masses: list[torch.Tensor] = []
        hook = None
        if watch and importance.truncation_active(self.min_p, self.top_p, self.top_k):
            from accelerate.utils import is_peft_model

            causal = self.accelerator.unwrap_model(model)
            causal = causal.get_base_model() if is_peft_model(causal) else causal
            keys = (self.temperature, self.min_p, self.top_p, self.top_k)
            hook = importance.watch_truncation(causal, logits_to_keep, *keys, masses=masses)
        try:
            out = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                *args,
                compute_entropy=compute_entropy,
                **kwargs,
            )
        finally:
            if hook is not None:
                hook.remove()
        if watch:
            self._truncated = torch.cat(masses) if masses else torch.zeros_like(out[0])
        inputs = self._loss_inputs
        if compute_entropy and inputs is not None and "importance_sampling_ratio" not in inputs:
            self._deferred_ratio(out[0].detach(), inputs)
        return out

    def _compute_loss(self, model, inputs):
        deferred = self.model.training and self._deferred_correction
        self._loss_inputs = inputs if deferred else None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None
        truncated, self._truncated = self._truncated, None
        if truncated is not None:  # the loss's tokens: what the anchor term is estimated on
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            totals = self.accelerator.reduce(
                torch.stack([(truncated * mask).sum(), mask.sum().float()]), reduction="sum"
            )
            self._metrics["train"][importance.MASS_KEY].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return loss

    def _weight_sums_of(self, logps: torch.Tensor, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
        return importance.weight_sums(
            logps,
            inputs["sampling_per_token_logps"],
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )

    def _log_weights(self, sums: torch.Tensor) -> None:
        """Log a generation batch's importance-weight figures (every process's ``sums`` added), and warn in
        one line when they pass their bounds (``sage.train.importance``)."""
        every = self.accelerator.gather(sums.unsqueeze(0)).view(-1, sums.numel()).sum(dim=0)
        figures = importance.weight_figures(every)
        for key, value in figures.items():
            self._metrics["train"][key].append(value)
        line = importance.weight_warning(
            figures, self.vllm_importance_sampling_mode, self.state.global_step + 1
        )
        if line is not None and self.accelerator.is_main_process:
            log.warning(line)

    def _deferred_ratio(self, logps: torch.Tensor, inputs: dict) -> None:
        """The correction's ratio of a micro-batch whose generation batch skipped TRL's log-prob pass, from
        the loss pass's own log-probs, with the metrics TRL logs for it."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        sampling = inputs["sampling_per_token_logps"]
        ratio = vllm_importance_ratio(
            logps,
            sampling,
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        inputs["importance_sampling_ratio"] = ratio
        sums = self._weight_sums_of(logps, inputs, mask)
        self._weight_sums = sums if self._weight_sums is None else self._weight_sums + sums
        # TRL logs these once per generation batch: accumulated over its micro-batches, logged at the last
        valid = mask.bool()
        delta = (logps - sampling).abs()[valid & ~torch.isnan(sampling)]
        counted = ratio.flatten() if ratio.size(1) == 1 else ratio[valid]
        inf = logps.new_tensor(math.inf)
        local = torch.stack(
            [
                delta.sum(),
                logps.new_tensor(delta.numel()),
                delta.max() if delta.numel() else -inf,
                counted.sum(),
                logps.new_tensor(counted.numel()),
                counted.min() if counted.numel() else inf,
                counted.max() if counted.numel() else -inf,
            ]
        ).float()
        acc = self._ratio_stats
        if acc is None:
            acc = local
        else:
            acc = torch.cat(
                [
                    acc[[0, 1]] + local[[0, 1]],
                    torch.maximum(acc[2:3], local[2:3]),
                    acc[[3, 4]] + local[[3, 4]],
                    torch.minimum(acc[5:6], local[5:6]),
                    torch.maximum(acc[6:7], local[6:7]),
                ]
            )
        self._ratio_stats = acc
        if self._batch_id is not None and self._batch_id[1] < self.args.steps_per_generation - 1:
            return
        self._ratio_stats = None
        sums, self._weight_sums = self._weight_sums, None
        self._log_weights(sums)
        every = self.accelerator.gather(acc.unsqueeze(0)).view(-1, acc.numel())  # (processes, 7)
        m = self._metrics["train"]
        m["sampling/sampling_logp_difference/mean"].append(
            (every[:, 0].sum() / every[:, 1].sum().clamp(min=1)).item()
        )
        m["sampling/sampling_logp_difference/max"].append(every[:, 2].max().clamp(min=0).item())
        m["sampling/importance_sampling_ratio/min"].append(every[:, 5].min().item())
        m["sampling/importance_sampling_ratio/mean"].append(
            (every[:, 3].sum() / every[:, 4].sum().clamp(min=1)).item()
        )
        m["sampling/importance_sampling_ratio/max"].append(every[:, 6].max().item())
