"""Measure the testbed base model: ``python -m sage.testbed.measure`` prints ``name: value`` lines.

The figures say whether the base model sits in the regime the experiments need: pass@1 well below 1
(room for RL to improve), pass@k near 1 (the answers are reachable by sampling), a skewed strategy mix
(mode collapse is visible) and how many tokens are high-entropy forks (the paper's branch threshold).
Reused by ``make bench``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage.testbed.model import build_tiny_model
from sage.testbed.task import STRATEGIES, classify_strategy, is_correct, make_problems

BRANCH_ENTROPY_NATS = 1.2
"""Token entropy above which the paper treats a position as a branching point."""
ENTROPY_QUANTILES = (50, 75, 90, 95, 99)
"""Quantiles of the per-token entropy reported, to place a branch threshold in this model's distribution."""


def sample(
    model_path: str, prompts: list[str], k: int, max_new_tokens: int, batch_prompts: int, seed: int
) -> tuple[list[list[str]], list[torch.Tensor]]:
    """``k`` temperature-1 samples per prompt (left-padded batches across prompts) and, per batch, the
    entropy of the model's full next-token distribution at every generated token up to and including
    eos (other positions are NaN). Entropy comes from the raw logits, i.e. the sampling distribution."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    completions: list[list[str]] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch_prompts):
        chunk = prompts[start : start + batch_prompts]
        inputs = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=k,
                return_dict_in_generate=True,
                output_logits=True,
            )
        generated = out.sequences[:, inputs["input_ids"].shape[1] :]
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        completions.extend(texts[i * k : (i + 1) * k] for i in range(len(chunk)))
        entropies.append(_masked_entropy(torch.stack(out.logits, dim=1), generated, tokenizer.eos_token_id))
    return completions, entropies


def _masked_entropy(logits: torch.Tensor, generated: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token entropy in nats, NaN after the first eos (those positions are padding, not choices)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    is_eos = (generated == eos_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return entropy.masked_fill(after_eos, float("nan"))


def measure(
    model_path: str,
    n_problems: int = 200,
    k: int = 64,
    max_new_tokens: int = 64,
    batch_prompts: int = 25,
    seed: int = 0,
) -> dict[str, float]:
    """The base-model figures on ``n_problems`` held-out problems, ``k`` samples each."""
    problems = make_problems("heldout", n_problems, seed)
    start = time.perf_counter()
    completions, entropies = sample(
        model_path, [p["problem"] for p in problems], k, max_new_tokens, batch_prompts, seed
    )
    seconds = time.perf_counter() - start
    correct = [
        [is_correct(c, p["answer"]) for c in group] for p, group in zip(problems, completions, strict=True)
    ]
    strategies = Counter(classify_strategy(c) for group in completions for c in group)
    n_samples = n_problems * k
    tokens = torch.cat([e.flatten() for e in entropies])
    tokens = tokens[~tokens.isnan()]
    figures = {
        "pass@1": sum(map(sum, correct)) / n_samples,
        f"pass@{k}": sum(map(any, correct)) / n_problems,
        "mean_token_entropy_nats": tokens.mean().item(),
        f"frac_tokens_entropy_gt_{BRANCH_ENTROPY_NATS}": (tokens > BRANCH_ENTROPY_NATS).float().mean().item(),
        **{f"token_entropy_q{q}": torch.quantile(tokens, q / 100).item() for q in ENTROPY_QUANTILES},
        "mean_completion_tokens": tokens.numel() / n_samples,
        "sampling_seconds": seconds,
    }
    figures.update({f"strategy_{name}": strategies[name] / n_samples for name in (*STRATEGIES, "other")})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", help="a saved model folder; default: build/load the default testbed model"
    )
    parser.add_argument("--n-problems", type=int, default=200)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of the default model build and of sampling")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown section (for reports)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = time.perf_counter()
    model_path = args.model_path or build_tiny_model(seed=args.seed)
    if not args.markdown:
        print(f"model_path: {model_path}")
        print(f"build_or_load_seconds: {time.perf_counter() - start:.1f}")
    figures = measure(model_path, args.n_problems, args.k, seed=args.seed)
    if args.markdown:
        print(markdown(figures, args.n_problems, args.k))
        return
    for name, value in figures.items():
        print(f"{name}: {value:.4f}")


def markdown(figures: dict[str, float], n_problems: int, k: int) -> str:
    """The base model's figures as a report section (printed by ``--markdown``)."""
    active = figures[f"frac_tokens_entropy_gt_{BRANCH_ENTROPY_NATS}"]
    lines = [
        "## The testbed base model (python -m sage.testbed.measure)",
        "",
        f"{n_problems} held-out problems x {k} samples at temperature 1.0. The branch guide's default "
        "threshold for the testbed (model.branch_threshold) is the 90th percentile of this per-token "
        f"entropy, because the paper's 1.2 nats fires on only {active:.1%} of this model's tokens.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value:.4f} |" for name, value in figures.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
