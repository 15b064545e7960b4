"""What sage-train prints: once, how TRL's knobs shape a step (:func:`describe_batch`); then per optimiser
step one short line, instead of transformers' dict of every logged metric (30-odd entries, about 900
characters a step). Every metric still reaches MLflow: the per-step record is
``sage.tracking.step_callback``, which reads the same logs."""

from __future__ import annotations

from transformers.trainer_callback import PrinterCallback, ProgressCallback


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


# (log key, printed name): what a user watches a run by; the rest is in MLflow.
SHOWN = (
    ("loss", "loss"),
    ("reward", "reward"),
    ("kl", "kl"),
    ("entropy", "entropy"),
    ("learning_rate", "lr"),
    ("step_time", "s/step"),
)


def step_line(logs: dict, step: int, max_steps: int) -> str | None:
    """``step 3/100: loss 0.0123, reward 0.4375, kl 0.00124, ...``; the end-of-training summary as
    ``trained 100 steps in 812 s``; None for a log with none of these keys."""
    if "train_runtime" in logs:
        return f"trained {step} steps in {float(logs['train_runtime']):.0f} s"
    shown = [f"{name} {float(logs[key]):.4g}" for key, name in SHOWN if _is_number(logs.get(key))]
    return f"step {step}/{max_steps}: " + ", ".join(shown) if shown else None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class StepLineProgress(ProgressCallback):
    """transformers' progress bar, with a short line per log instead of the dict of every metric."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            line = step_line(logs, state.global_step, state.max_steps)
            if line is not None:
                self.training_bar.write(line)


class StepLinePrinter(PrinterCallback):
    """``disable_tqdm=True``'s printer, with the same short line."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero and logs:
            line = step_line(logs, state.global_step, state.max_steps)
            if line is not None:
                print(line)


def short_step_lines(trainer) -> None:
    """Replace the trainer's console callback (the progress bar, or the printer under ``disable_tqdm``) by
    its short-line version, in the same place among the callbacks."""
    for default, short in ((ProgressCallback, StepLineProgress), (PrinterCallback, StepLinePrinter)):
        if trainer.pop_callback(default) is not None:
            trainer.add_callback(short)
