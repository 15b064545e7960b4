"""Measure the testbed base model: ``python -m sage.testbed.measure [--model tiny]`` prints ``name: value``
lines and whether the base model meets the targets of a testbed where exploration matters.

The figures say whether the base model sits in the regime the experiments need: pass@1 well below 1
(room for RL to improve), pass@k still rising at k = 256 (correct answers reachable only by sampling
wide: the coverage that RLVR is said to lose), a skewed strategy mix (mode collapse is visible) and how
many tokens are high-entropy forks (the paper's branch threshold). Reused by ``make bench``.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage.testbed.task import STRATEGIES, TIERS, classify_strategy, is_correct, make_problems, tier_of

BRANCH_ENTROPY_NATS = 1.2
"""Token entropy above which the paper treats a position as a branching point."""
ENTROPY_QUANTILES = (50, 75, 90, 95, 99)
"""Quantiles of the per-token entropy reported, to place a branch threshold in this model's distribution."""


def sample(
    model, tokenizer, prompts: list[str], k: int, max_new_tokens: int, batch_prompts: int, seed: int
) -> tuple[list[list[str]], list[torch.Tensor]]:
    """``k`` temperature-1 samples per prompt (left-padded batches across prompts) and, per batch, the
    entropy of the model's full next-token distribution at every generated token up to and including
    eos (other positions are NaN). Entropy comes from the raw logits, i.e. the sampling distribution."""
    torch.manual_seed(seed)
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


TARGETS = {"pass@1": (0.2, 0.45), "pass@256": (0.75, 0.95)}
"""Base model on 200 held-out problems x 256 samples: room for RL at pass@1, room to lose at pass@256."""
PASS_KS = (1, 4, 16, 64, 256)


def targets(figures: dict[str, float]) -> dict[str, bool]:
    """Which base-model targets ``figures`` meet (pass@1 and pass@256 in range, pass@k rising 64 -> 256)."""
    met = {f"{name} in [{lo}, {hi}]": lo <= figures[name] <= hi for name, (lo, hi) in TARGETS.items()}
    met["pass@256 > pass@64"] = figures["pass@256"] > figures["pass@64"]
    return met


def measure(
    model_path: str,
    n_problems: int = 200,
    k: int = 256,
    entropy_k: int = 16,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> dict[str, float]:
    """The base-model figures on ``n_problems`` held-out problems: pass@k from ``k`` samples each (the
    evaluator's sampler, unbiased estimator), per tier of the graded world, the strategy mix and each
    strategy's accuracy; the token entropy from ``entropy_k`` samples each (it needs the full logits)."""
    from sage.eval.sampling import SamplingSettings, sample_completions
    from sage.metrics import pass_at_k_curve

    problems = make_problems("heldout", n_problems, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    start = time.perf_counter()
    settings = SamplingSettings(k, 1.0, 1.0, max_new_tokens, chat=False, seed=seed)
    completions = sample_completions(model, tokenizer, problems, settings, batch_size=4096)
    seconds = time.perf_counter() - start
    correct = np.array(
        [[is_correct(c, p["answer"]) for c in group] for p, group in zip(problems, completions, strict=True)]
    )
    ks = [j for j in PASS_KS if j <= k]
    figures = {f"pass@{j}": v for j, v in pass_at_k_curve(correct, ks).items()}
    tiers = np.array([tier_of(p["b"]) for p in problems])
    for tier in TIERS:
        rows = tiers == tier
        if rows.any():
            curve = pass_at_k_curve(correct[rows], [1, k])
            figures[f"{tier}_share"] = float(rows.mean())
            figures[f"{tier}_pass@1"], figures[f"{tier}_pass@{k}"] = curve[1], curve[k]
    strategies = np.array([[classify_strategy(c) for c in group] for group in completions])
    for name in (*STRATEGIES, "other"):
        used = strategies == name
        figures[f"strategy_{name}"] = float(used.mean())
        if name != "other" and used.any():
            figures[f"accuracy_{name}"] = float(correct[used].mean())
    figures["sampling_seconds"] = seconds
    prompts = [p["problem"] for p in problems]
    _, entropies = sample(model, tokenizer, prompts, entropy_k, max_new_tokens, batch_prompts=25, seed=seed)
    tokens = torch.cat([e.flatten() for e in entropies])
    tokens = tokens[~tokens.isnan()]
    figures |= {
        "mean_token_entropy_nats": tokens.mean().item(),
        f"frac_tokens_entropy_gt_{BRANCH_ENTROPY_NATS}": (tokens > BRANCH_ENTROPY_NATS).float().mean().item(),
        **{f"token_entropy_q{q}": torch.quantile(tokens, q / 100).item() for q in ENTROPY_QUANTILES},
        "mean_completion_tokens": tokens.numel() / (n_problems * entropy_k),
    }
    return figures


def model_path_of(model: str) -> str:
    """Build (or load from the cache) the base model of ``sage-train model=<model>``: its config group is
    the one source of the world, the sizes and the seed, so what is measured is what the trainer loads."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from sage.config import register_configs
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={model}"])
    return str(instantiate(cfg.model.source))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="the model config group to build/load (default tiny)")
    parser.add_argument("--model-path", help="a saved model folder instead of --model")
    parser.add_argument("--n-problems", type=int, default=200)
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--entropy-k", type=int, default=16, help="samples per problem for the token entropy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out problems and of sampling")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown section (for reports)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = time.perf_counter()
    model_path = args.model_path or model_path_of(args.model)
    build_seconds = time.perf_counter() - start
    figures = measure(model_path, args.n_problems, args.k, args.entropy_k, seed=args.seed)
    met = targets(figures) if args.k >= 256 else {}
    if args.markdown:
        print(markdown(figures, met, args.model_path or f"model={args.model}", args.n_problems, args.k))
        return
    print(f"model_path: {model_path}")
    print(f"build_or_load_seconds: {build_seconds:.1f}")
    for name, value in figures.items():
        print(f"{name}: {value:.4f}")
    for name, ok in met.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")


def markdown(figures: dict[str, float], met: dict[str, bool], model: str, n_problems: int, k: int) -> str:
    """The base model's figures as a report section (printed by ``--markdown``)."""
    active = figures[f"frac_tokens_entropy_gt_{BRANCH_ENTROPY_NATS}"]
    lines = [
        f"## The testbed base model (python -m sage.testbed.measure, {model})",
        "",
        f"{n_problems} held-out problems x {k} samples at temperature 1.0 (token entropy from 16 samples "
        "each). The branch guide's default threshold for the testbed (model.branch_threshold) is the 90th "
        f"percentile of this per-token entropy; the paper's 1.2 nats fires on {active:.1%} of its tokens.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value:.4f} |" for name, value in figures.items()]
    if met:
        lines += ["", "| target | |", "|---|---|"]
        lines += [f"| {name} | {'met' if ok else 'NOT met'} |" for name, ok in met.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
