"""Which vLLM engine the trainer's rollouts come from, and what it hands back: ``VllmHookupMixin``.

- ``rollout=vllm``: the rollout function's engine (``sage.train.vllm_rollout``) becomes TRL's
  ``vllm_generation`` and ``use_vllm`` is turned on after TRL's own setup (so TRL builds no engine): TRL then
  calls its ``sync_weights`` (the adapter hand-over) before each step's first rollout, and applies its
  importance-sampling correction to the engine's log-probs, as for an engine of its own.
- ``rollout=vllm_merged`` (TRL's colocated engine): its sampler returns the log-probs the trainer computes
  (``sage.vllm_worker.use_tempered_logprobs``: at the sampling temperature, before min-p/top-p/top-k
  truncation), and ``VLLMGeneration._iter_named_params`` sends a LoRA policy's weights as ``W + s * B @ A``
  computed out of place (``sage.train.weight_sync``), not by TRL's in-place merge_adapter / unmerge_adapter,
  whose bfloat16 rounding moves the frozen base, and with it the reference, on every sync (TRL issue #6688).

TRL internals (trl==1.16.0) it relies on: ``GRPOTrainer.__init__`` builds its engine when ``args.use_vllm``
and reads nothing of ours; ``vllm_generation`` (replaced; TRL's own reached at
``vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.sampler``), ``use_vllm`` (turned
on), ``_last_loaded_step`` (reset so that the first rollout syncs) and ``rollout_func``.
"""

from __future__ import annotations

import os

from sage.train.weight_sync import sync_out_of_place


class VllmHookupMixin:
    """Put before ``GRPOTrainer`` among the bases; see the module docstring."""

    def __init__(self, *args, **kwargs):
        if getattr(kwargs.get("args"), "use_vllm", False):
            # TRL's colocated engine (rollout=vllm_merged) on the V1 model runner, whose sampler
            # use_tempered_logprobs patches below (sage.vllm_engine.build_llm does the same for its engines)
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        super().__init__(*args, **kwargs)
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
