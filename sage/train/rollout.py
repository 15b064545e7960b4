"""``rollout=fast``: TRL's training rollouts sampled by the evaluator's sampler
(``sage.eval.sampling.HFSampler`` on ``sage.eval.decode.CompactDecoder``) instead of transformers'
``generate``.

TRL's GRPOTrainer (trl==1.16.0) calls ``rollout_func(prompts, trainer)`` in place of its own generation, with
this process's slice of the generation batch, in which each prompt already appears once per completion
(TRL's ``RepeatSampler``): one completion is returned per entry. Everything TRL does with them (decoding,
rewards, advantages, masks, the loss) is unchanged.

The distribution is the one TRL's ``generate`` samples: the current policy's next-token softmax at TRL's
``temperature``, inside its ``top_p`` nucleus and above its ``min_p``, up to ``max_completion_length`` tokens,
ending at the first of TRL's eos ids. Knobs the sampler does not implement (``top_k``, ``repetition_penalty``,
``generation_kwargs``), the generation backends it would replace (vLLM, continuous batching) and LoRA policies
are refused when the function is built; a model the compact decoder does not cover is refused by ``check``
before training. Each is one line that names ``rollout=fast``: nothing falls back to another sampler.

Seeding: TRL's ``generate`` draws from the global RNG, which the Trainer restores on resume. Here a call draws
from a generator seeded by a hash of (seed, optimiser step, process, call at that step), so a resumed run
draws what an uninterrupted one draws, processes draw differently, and what a step samples does not depend on
how many random numbers anything else used before it.
"""

from __future__ import annotations

from sage.config import ConfigError
from sage.eval.decode import unsupported_reason
from sage.eval.sampling import HFSampler
from sage.objective.guides import noise_seed


def rollout_seed(seed: int, step: int, rank: int, call: int) -> int:
    """A generator seed that is a pure function of (seed, step, rank, call): the guides' ``noise_seed``
    personalised for rollouts, so that it never equals a guide's noise seed of the same four integers."""
    return noise_seed(seed, step, rank, call, person=b"sage.rollout")


def runs(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each run of equal consecutive rows as (the row, its length): TRL repeats a prompt once per completion,
    and the sampler prefills a prompt once for all its copies. Rows of one run are interchangeable, so the
    completions of run j fill its rows in the order they are drawn."""
    distinct: list[list[int]] = []
    copies: list[int] = []
    for ids in rows:
        if distinct and distinct[-1] == ids:
            copies[-1] += 1
        else:
            distinct.append(ids)
            copies.append(1)
    return distinct, copies


def refused_settings(args, lora: bool) -> list[str]:
    """What in GRPOConfig ``args`` (and a LoRA policy) the compact sampler cannot honour: TRL would sample
    something else with ``generate``, or would not call the rollout function at all."""
    refused = []
    if lora:
        refused.append("a LoRA policy (model.lora; the compact decoder reads plain nn.Linear weights)")
    if args.use_vllm:
        refused.append("trl.use_vllm=true (vLLM would generate; use rollout=vllm)")
    if args.use_transformers_continuous_batching:
        refused.append("trl.use_transformers_continuous_batching=true")
    if args.top_k:
        refused.append(f"trl.top_k={args.top_k} (only 0: top-k off)")
    if args.repetition_penalty != 1.0:
        refused.append(f"trl.repetition_penalty={args.repetition_penalty} (only 1.0)")
    if args.generation_kwargs:
        refused.append(f"trl.generation_kwargs={args.generation_kwargs} (only none)")
    return refused


class RolloutCalls:
    """Names each call of a rollout function by (optimiser step, process, call at that step), from which its
    generator seed is drawn (:func:`rollout_seed`)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._last_call = (-1, True, -1)  # (step, training, index) of the latest call

    def call_id(self, trainer) -> tuple[int, int, int]:
        """(step, rank, call) of this call: ``call`` counts calls at the same optimiser step, from 0 in
        training and from -1 down in evaluation, so two generation batches of one step never share a seed."""
        step, training = trainer.state.global_step, trainer.model.training
        last_step, last_training, last_index = self._last_call
        index = last_index + 1 if (last_step, last_training) == (step, training) else 0
        self._last_call = (step, training, index)
        return step, trainer.accelerator.process_index, index if training else -1 - index


class CompactRollout(RolloutCalls):
    """TRL's ``rollout_func`` for ``rollout=fast``; see the module docstring. Built from GRPOConfig ``args``
    (its seed and generation batch size) and peft's LoraConfig ``lora`` (None: full fine-tuning); the
    sampling knobs are read from the trainer at every call, where TRL's own generation reads them."""

    def __init__(self, args, lora) -> None:
        refused = refused_settings(args, lora is not None)
        if refused:
            raise ConfigError(f"rollout=fast cannot sample with {'; '.join(refused)}: use rollout=hf")
        super().__init__(args.seed)
        # the largest batch a process generates at once; the whole of it is decoded together
        self.batch_size = args.generation_batch_size
        self._sampler: HFSampler | None = None

    def attach(self, trainer) -> None:
        """Refuse, before the first step, a built policy the compact decoder does not compute exactly."""
        self.check(trainer.model)

    @staticmethod
    def check(model) -> None:
        """Refuse, in one line, a policy the compact decoder does not compute exactly: sage-train calls this
        once the trainer has built the model, before the first step."""
        reason = unsupported_reason(model)
        if reason is not None:
            name = model.name_or_path or type(model).__name__
            raise ConfigError(f"rollout=fast cannot decode {name}: {reason}; use rollout=hf")

    def __call__(self, prompts: list, trainer) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self._sampler is None or self._sampler.model is not model:
            self.check(model)
            # One sampler per policy object: it keeps its KV cache between steps. It packs the weights into
            # a new CompactDecoder at every call (the decoder's fused matrices are copies, taken when it is
            # built), so every rollout is sampled from the weights of the latest optimiser step.
            self._sampler = HFSampler(
                model, trainer.processing_class, self.batch_size, eos=trainer.eos_token_ids
            )
        prompt_ids, images, multimodal = trainer._tokenize_prompts(prompts)  # TRL's own tokenisation
        if images is not None or multimodal:
            raise ConfigError("rollout=fast samples text prompts only; these carry images: use rollout=hf")
        distinct, copies = runs(prompt_ids)
        completions: list[list[list[int]]] = [[] for _ in distinct]
        for owners, ids in self._sampler.completion_ids(
            distinct,
            copies,
            max_new_tokens=trainer.max_completion_length,
            temperature=trainer.temperature,
            top_p=trainer.top_p,
            min_p=trainer.min_p or 0.0,
            seed=rollout_seed(self.seed, *self.call_id(trainer)),
        ):
            for j, completion in zip(owners, ids, strict=True):
                completions[j].append(completion)
        # TRL reads sampling log-probs only for vLLM's importance-sampling correction (refused above)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c for per_prompt in completions for c in per_prompt],
            "logprobs": None,
        }
