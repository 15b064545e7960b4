"""SageGRPOTrainer: TRL's GRPOTrainer with a shaped anchor q * pi_ref and a choice of divergence.

What changes w.r.t. ``trl.GRPOTrainer`` (trl==1.16.0), and nothing else:
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
- ``_load_optimizer_and_scheduler``: on resume, ``max_steps`` is the run's total length. TRL/transformers
  restore the learning rate the checkpoint's own schedule had reached (0 at the end of a finished run
  with a decaying schedule); we set it to the value the resumed schedule (over the new ``max_steps``) has
  at the checkpoint's step, which is the same value when ``max_steps`` is unchanged.
- ``_save_checkpoint`` (with ``_get_output_dir``): the same files, written into a temporary folder and
  renamed to ``checkpoint-N/`` once flushed to the disk, so a checkpoint is whole or absent.
- ``__init__`` (``rollout=vllm``): the rollout function's engine (``sage.train.vllm_rollout``) becomes TRL's
  ``vllm_generation`` and ``use_vllm`` is turned on after TRL's own setup (so TRL builds no engine): TRL
  then calls its ``sync_weights`` (the adapter hand-over) before each step's first rollout, and applies its
  importance-sampling correction to the engine's log-probs, as for an engine of its own.
- The importance-sampling correction of a vLLM rollout (``rollout=vllm``, ``rollout=vllm_merged``): the
  engine returns the log-probs the trainer computes (``sage.vllm_worker.use_tempered_logprobs``: at the
  sampling temperature, before min-p/top-p/top-k truncation). When the policy cannot have moved between a
  generation batch and its last micro-batch (``num_iterations == 1`` and the generation batch consumed
  within one optimiser step: TRL's own condition for dropping ``old_per_token_logps``), TRL's extra no-grad
  log-prob pass over every completion computes what the loss pass computes again at the same weights. Then
  ``_generate_and_score_completions`` runs with the correction off (no pass), and the loss pass
  (``_get_per_token_logps_and_entropies``) computes the ratio from its own detached log-probs
  (:func:`vllm_importance_ratio`, TRL's rule) and puts it where TRL's loss reads it, with TRL's metrics.
- ``VLLMGeneration._iter_named_params`` (``rollout=vllm_merged``, on the engine TRL builds): a LoRA policy's
  weights are sent to vLLM as ``W + s * B @ A`` computed out of place (``sage.train.weight_sync``), not by
  TRL's in-place merge_adapter / unmerge_adapter, whose bfloat16 rounding moves the frozen base, and with it
  the reference, on every sync (TRL issue #6688). Same names and order as TRL; each weight is rounded once.
Generation (through TRL's ``rollout_func`` hook under ``rollout=fast`` and ``rollout=vllm``), rewards,
advantages, the reference model and what a checkpoint holds are TRL's.

Logged per step on top of TRL's metrics: ``kl`` (k3 to the UNSHAPED pi_ref: comparable across GRPO and
all SAGE variants), ``divergence`` (the shaped term actually optimised, before beta), ``guide/q_mean``,
``guide/q_min``, ``guide/q_max``, ``guide/active_frac`` (share of completion tokens with q != 1) and the
guide's current hyperparameters; with a model of the testbed's fork world, ``guide/q_fork`` and
``guide/active_frac_fork``, the same at the tokens that choose a strategy (passed to the guide as ``fork``).
Also, in training: the mass the sampler's truncation removed at the loss's tokens and, with a vLLM rollout,
the importance weights' spread and cut share, with a one-line warning past their bounds
(``sage.train.importance``). The truncated mass is measured through a forward hook on the policy's backbone
in the loss pass (TRL's fused head never holds the full logits).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import torch
from trl import GRPOTrainer

from sage.objective.aggregation import aggregate, informative_groups, total_rewards
from sage.objective.divergences import k3
from sage.testbed.task import FORK_MARKERS
from sage.train import importance
from sage.train.weight_sync import sync_out_of_place

log = logging.getLogger(__name__)


def describe_batch(args, num_processes: int, longest_prompt_tokens: int) -> str:
    """One line on how TRL's knobs shape a step: completions per forward pass (the memory-bound
    micro-batch), accumulation, completions and prompts per optimiser step, and the longest micro-batch
    in tokens. ``args`` is a GRPOConfig after its own __post_init__ (steps_per_generation resolved)."""
    from sage.train.memory import Batch

    batch = Batch(
        micro=args.per_device_train_batch_size,
        accumulation=args.gradient_accumulation_steps,
        processes=num_processes,
        num_generations=args.num_generations,
        prompt_tokens=longest_prompt_tokens,
        completion_tokens=args.max_completion_length,
    )
    return f"{batch.describe()}; {args.generation_batch_size} completions generated at a time"


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


class SageGRPOTrainer(GRPOTrainer):
    """GRPO-family trainer whose anchor is q * pi_ref; see the module docstring for what it overrides.

    ``divergence`` has ``beta`` and ``per_token(logp, ref_logp)``; ``guide`` is called with the loss
    pass's log-probs and entropies and returns q (B, T). ``args.beta`` must equal ``divergence.beta``:
    TRL uses it to decide whether to load the reference model.
    """

    def __init__(
        self,
        *args,
        divergence,
        guide,
        filter_zero_variance_groups: bool = False,
        anchor_buckets: bool = True,
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
        self._staging: Path | None = None  # the temporary folder a checkpoint is being saved in
        self._deferred_correction = (
            False  # the buffered generation batch's ratio is computed in the loss pass
        )
        self._loss_inputs: dict | None = None  # the micro-batch whose loss is being computed
        self._ratio_stats: torch.Tensor | None = None  # the deferred ratio's metrics over a generation batch
        self._weight_sums: torch.Tensor | None = None  # importance.weight_sums over a generation batch
        self._truncated: torch.Tensor | None = None  # (B, T) mass truncation removed, of the loss pass
        if getattr(kwargs.get("args"), "use_vllm", False):
            # TRL's colocated engine (rollout=vllm_merged) on the V1 model runner, whose sampler
            # use_tempered_logprobs patches below (sage.vllm_engine.build_llm does the same for its engines)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        super().__init__(*args, **kwargs)
        # the fork world's strategy markers in this model's vocabulary (none in any other model): where q is
        # logged apart, and what guide=fork reads
        vocab = self.processing_class.get_vocab()
        self._fork_ids = torch.tensor(
            [vocab[m] for m in FORK_MARKERS.values() if m in vocab], dtype=torch.long
        )
        if self.beta != divergence.beta:
            raise ValueError(f"GRPOConfig.beta={self.beta} differs from divergence.beta={divergence.beta}")
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(f"algorithm.loss_type={self.loss_type!r} is not supported by SageGRPOTrainer")
        if self.args.use_bias_correction_kl != divergence.importance_weighted:
            raise ValueError(
                f"GRPOConfig.use_bias_correction_kl={self.args.use_bias_correction_kl} differs from "
                f"divergence.importance_weighted={divergence.importance_weighted}"
            )
        if self.use_vllm:  # TRL's sync merges LoRA into the frozen base in place: see weight_sync
            sync_out_of_place(self.vllm_generation)
            from sage.vllm_worker import use_tempered_logprobs

            # TRL's colocated engine runs in this process: its sampler is reachable here
            executor = self.vllm_generation.llm.llm_engine.model_executor
            use_tempered_logprobs(executor.driver_worker.model_runner.sampler)
        attach = getattr(self.rollout_func, "attach", None)
        engine = attach(self) if attach is not None else None
        if engine is not None:
            # rollout=vllm: sage's engine serves the adapter (sage.train.vllm_rollout). TRL syncs it before a
            # step's first rollout and corrects for its sampling log-probs as it does for its own engine.
            self.vllm_generation = engine
            self._last_loaded_step = -1  # the first rollout hands over what the weights are by then
            self.use_vllm = True

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        return self._rewards_per_func

    def _policy_fixed_through_generation_batch(self) -> bool:
        """Whether the weights cannot move between a generation batch's rollout and its last micro-batch:
        one pass over it (num_iterations 1) within one optimiser step (TRL's own test for dropping
        old_per_token_logps)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.num_iterations == 1 and self.args.gradient_accumulation_steps % generate_every == 0

    def _generate_and_score_completions(self, inputs):
        training = self.model.training
        # the correction's ratio from the loss pass instead of TRL's extra log-prob pass (module docstring)
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
        if training:
            self._generated_at = self.state.global_step
        if training and self.use_vllm and self.vllm_importance_sampling_correction and not defer:
            mask = out["completion_mask"] * out.get("tool_mask", 1)
            self._log_weights(self._weight_sums_of(out["old_per_token_logps"], out, mask))
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

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        # The loaded state keeps the checkpoint's step and base rates; the lambdas stay this run's (LambdaLR
        # restores only a callable object's __dict__, empty for transformers' partials): the schedule over
        # the current max_steps.
        sched = self.lr_scheduler
        step = sched.last_epoch
        rates = [base * fn(step) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, rate in zip(sched.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        sched._last_lr = rates  # what get_last_lr() reports (the logged learning_rate): LambdaLR's own field

    def _save_checkpoint(self, model, trial):
        """TRL's and transformers' save, redirected into ``.tmp-checkpoint-N/checkpoint-N/`` and renamed to
        ``checkpoint-N/`` once every process has written its files and the main one has flushed them to
        the disk: a checkpoint is whole or absent, never resumed from half-written (a kill during the save
        leaves only the temporary folder, which the next start sets aside). The Trainer writes a
        checkpoint's files from several methods (weights, optimiser, each process's RNG state, trainer
        state, TRL's entropy controller), and every one takes the folder from ``_get_output_dir``: that is
        the one redirection. A callback could not do it: ``on_save`` runs after the files are in place.
        Old checkpoints are then rotated among the published ones (``_rotate_published``)."""
        from sage.run_folder import publish

        run_dir = Path(super()._get_output_dir(trial))
        name = f"checkpoint-{self.state.global_step}"
        staging = run_dir / f".tmp-{name}"
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)  # a save of this step that failed earlier in this process
        self.accelerator.wait_for_everyone()
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()  # every process's files are in the temporary folder
        if self.args.should_save:
            target = run_dir / name
            if target.exists():  # a save of the same step by an earlier attempt of this run
                shutil.rmtree(target)
            publish(staging / name, target)
            staging.rmdir()
            self._rotate_published(run_dir)
        self.accelerator.wait_for_everyone()  # no process goes on before the checkpoint is in place

    def _rotate_published(self, run_dir: Path) -> None:
        """transformers' rotation (keep ``save_total_limit``, the newest and the best), over the published
        ``checkpoint-N/`` folders in step order only: its own glob also counts the ``checkpoint-N.incomplete``
        folders sage-train sets aside for inspection, and would delete them."""
        limit = self.args.save_total_limit
        steps = sorted(
            int(p.name.removeprefix("checkpoint-"))
            for p in run_dir.glob("checkpoint-*")
            if p.is_dir() and p.name.removeprefix("checkpoint-").isdigit()
        )
        if limit is None or limit <= 0 or len(steps) <= limit:
            return
        checkpoints = [run_dir / f"checkpoint-{step}" for step in steps]
        protected = {checkpoints[-1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if checkpoint not in protected:
                shutil.rmtree(checkpoint, ignore_errors=True)
                remaining -= 1

    def _get_output_dir(self, trial):
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

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
        if compute_entropy:  # keep the loss pass for the guide and divergence
            self._loss_pass = (out[0], out[1])
            inputs = self._loss_inputs
            if inputs is not None and "importance_sampling_ratio" not in inputs:
                self._deferred_ratio(out[0].detach(), inputs)
        return out

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

    def _compute_loss(self, model, inputs):
        beta, self.beta = self.beta, 0.0  # TRL's unshaped term off: the shaped one is added below
        deferred = self.model.training and self._deferred_correction
        self._loss_inputs = inputs if deferred else None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.beta = beta
            self._loss_inputs = None
        assert self._loss_pass is not None, "TRL's loss pass did not request entropies"
        logps, entropies = self._loss_pass  # (B, T) each; logps carries the gradient
        self._loss_pass = None

        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        truncated, self._truncated = self._truncated, None
        if truncated is not None:  # the loss's tokens: what the anchor term is estimated on
            self._metrics["train"][importance.MASS_KEY].append(self._masked_mean(truncated, mask))
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
