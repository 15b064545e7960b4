"""Measure the testbed base model: ``python -m sage.eval.testbed_measure [--model tiny]`` prints
``name: value`` lines and whether the base model meets the targets of a testbed where exploration matters.
It samples with the evaluator's sampler, so it lives beside the evaluator, not in the world it measures
(sage.testbed).

The figures say whether the base model sits in the regime the experiments need: pass@1 well below 1
(room for RL to improve), pass@k still rising at k = 256 (correct answers reachable only by sampling
wide: the coverage that RLVR is said to lose), a skewed strategy mix (mode collapse is visible) and how
many tokens are high-entropy forks (the paper's branch threshold). Reused by ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sage.testbed.task import (
    FORK_MARKERS,
    FORK_STRATEGIES,
    RARE_STRATEGY,
    STRATEGIES,
    TIERS,
    classify_strategy,
    is_correct,
    make_problems,
    problem_tier,
)

BRANCH_ENTROPY_NATS = 1.2
"""Token entropy above which the paper treats a position as a branching point."""
ENTROPY_QUANTILES = (50, 75, 90, 95, 99)
"""Quantiles of the per-token entropy reported, to place a branch threshold in this model's distribution."""


def sample(
    model, tokenizer, prompts: list[str], k: int, max_new_tokens: int, batch_prompts: int, seed: int
) -> tuple[list[list[str]], list[torch.Tensor], list[torch.Tensor]]:
    """``k`` temperature-1 samples per prompt (left-padded batches across prompts) and, per batch, the
    entropy of the model's full next-token distribution at every generated token up to and including
    eos (other positions are NaN) and the generated token ids. Entropy comes from the raw logits, i.e. the
    sampling distribution."""
    torch.manual_seed(seed)
    completions: list[list[str]] = []
    entropies: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
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
        tokens.append(generated)
    return completions, entropies, tokens


def _masked_entropy(logits: torch.Tensor, generated: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per-token entropy in nats, NaN after the first eos (those positions are padding, not choices)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    is_eos = (generated == eos_id).long()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return entropy.masked_fill(after_eos, float("nan"))


TARGETS = {"pass@1": (0.2, 0.45), "pass@256": (0.75, 0.95)}
"""Base model on 200 held-out problems x 256 samples: room for RL at pass@1, room to lose at pass@256."""
FORK_TARGETS = {"fork_entropy_nats": 1.0, "fork_q_mean": 1.2}
"""The fork world's: the strategy fork is a real choice (entropy in nats), and the branch guide, at the
model's default threshold and ratio, amplifies the anchor there (mean q at the fork tokens)."""
PASS_KS = (1, 4, 16, 64, 256)


def targets(figures: dict[str, float]) -> dict[str, bool]:
    """Which base-model targets ``figures`` meet (pass@1 and pass@256 in range, pass@k rising 64 -> 256;
    in the fork world, the fork's entropy and the guide's q there at least :data:`FORK_TARGETS`)."""
    met = {f"{name} in [{lo}, {hi}]": lo <= figures[name] <= hi for name, (lo, hi) in TARGETS.items()}
    met["pass@256 > pass@64"] = figures["pass@256"] > figures["pass@64"]
    for name, low in FORK_TARGETS.items():
        if name in figures:
            met[f"{name} >= {low}"] = figures[name] >= low
    return met


def fork_figures(
    entropies: list[torch.Tensor],
    tokens: list[torch.Tensor],
    marker_ids: list[int],
    ratio: float,
    threshold: float,
) -> dict[str, float]:
    """Where the fork world's strategy is chosen: the entropy of the distribution each strategy marker was
    sampled from, and what the branch guide (``ratio``, ``threshold``: the model's defaults) makes of it
    there, its mean q (clamped as in training) and the share of fork tokens where it is active (H above
    the threshold), beside its active share over all tokens."""
    from sage.objective.guides import BranchGuide, branch_q

    clamp = BranchGuide()
    h = torch.cat([e.flatten() for e in entropies])
    ids = torch.cat([t.flatten() for t in tokens])
    valid = ~h.isnan()
    at_fork = valid & torch.isin(ids, torch.tensor(marker_ids))
    if not at_fork.any():
        raise ValueError("no sample chose a strategy marker: is this a fork-world model?")
    q = branch_q(h[at_fork], ratio, threshold).clamp(clamp.q_min, clamp.q_max)
    return {
        "fork_entropy_nats": h[at_fork].mean().item(),
        "fork_q_mean": q.mean().item(),
        "fork_guide_active": (h[at_fork] > threshold).float().mean().item(),
        "guide_active_all_tokens": (h[valid] > threshold).float().mean().item(),
    }


def measure(
    model_path: str,
    n_problems: int = 200,
    k: int = 256,
    entropy_k: int = 16,
    max_new_tokens: int = 64,
    seed: int = 0,
    guide: tuple[float, float] = (0.3, 0.3),
) -> dict[str, float]:
    """The base-model figures on ``n_problems`` held-out problems: pass@k from ``k`` samples each (the
    evaluator's sampler, unbiased estimator), per tier of the model's world, the strategy mix and each
    strategy's accuracy (and in the fork world, the rare strategy's share on tail problems); the token
    entropy from ``entropy_k`` samples each (it needs the full logits), and in the fork world the fork's
    figures (:func:`fork_figures`) under the branch guide's (ratio, threshold) ``guide``."""
    from sage.eval.sampling import SamplingSettings, sample_completions
    from sage.metrics import pass_at_k_curve

    problems = make_problems("heldout", n_problems, seed)
    world = world_of(model_path)
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
    tiers = np.array([problem_tier(world, p["a"], p["b"]) for p in problems])
    for tier in TIERS:
        rows = tiers == tier
        if rows.any():
            curve = pass_at_k_curve(correct[rows], [1, k])
            figures[f"{tier}_share"] = float(rows.mean())
            figures[f"{tier}_pass@1"], figures[f"{tier}_pass@{k}"] = curve[1], curve[k]
    strategies = np.array([[classify_strategy(c) for c in group] for group in completions])
    for name in (*(FORK_STRATEGIES if world == "fork" else STRATEGIES), "other"):
        used = strategies == name
        figures[f"strategy_{name}"] = float(used.mean())
        if name != "other" and used.any():
            figures[f"accuracy_{name}"] = float(correct[used].mean())
    if world == "fork":
        for tier in TIERS:  # does the base model pick its strategy by tier? (its teacher did not)
            rows = tiers == tier
            if rows.any():
                figures[f"{tier}_strategy_{RARE_STRATEGY}"] = float(
                    (strategies[rows] == RARE_STRATEGY).mean()
                )
    figures["sampling_seconds"] = seconds
    prompts = [p["problem"] for p in problems]
    _, entropies, tokens = sample(
        model, tokenizer, prompts, entropy_k, max_new_tokens, batch_prompts=25, seed=seed
    )
    every = torch.cat([e.flatten() for e in entropies])
    every = every[~every.isnan()]
    figures |= {
        "mean_token_entropy_nats": every.mean().item(),
        f"frac_tokens_entropy_gt_{BRANCH_ENTROPY_NATS}": (every > BRANCH_ENTROPY_NATS).float().mean().item(),
        **{f"token_entropy_q{q}": torch.quantile(every, q / 100).item() for q in ENTROPY_QUANTILES},
        "mean_completion_tokens": every.numel() / (n_problems * entropy_k),
    }
    if world == "fork":
        marker_ids = tokenizer.convert_tokens_to_ids(list(FORK_MARKERS.values()))
        figures |= fork_figures(entropies, tokens, marker_ids, *guide)
    return figures


def world_of(model_path: str) -> str:
    """The teacher's world of a testbed model folder (its build info); ``arith`` for the first builds."""
    from sage.testbed.model import BUILD_INFO_FILE

    info = Path(model_path) / BUILD_INFO_FILE
    if not info.is_file():
        raise ValueError(f"{model_path}: no {BUILD_INFO_FILE}; not a testbed model folder")
    return json.loads(info.read_text())["config"].get("world", "arith")


def _compose(model: str, *overrides: str):
    """``sage-train model=<model>``'s composed config: the one source of the world, the sizes, the seed and
    the guide's defaults, so that what is measured is what the trainer loads."""
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=[f"model={model}", *overrides])


def model_path_of(model: str) -> str:
    """Build (or load from the cache) the base model of ``sage-train model=<model>``."""
    from hydra.utils import instantiate

    return str(instantiate(_compose(model).model.source))


def branch_defaults(model: str) -> tuple[float, float]:
    """(ratio, threshold) of ``sage-train model=<model> guide=branch``: what the fork figures are taken at."""
    guide = _compose(model, "guide=branch").guide
    return float(guide.ratio), float(guide.threshold)


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
    guide = branch_defaults(args.model)
    figures = measure(model_path, args.n_problems, args.k, args.entropy_k, seed=args.seed, guide=guide)
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
        f"## The testbed base model (python -m sage.eval.testbed_measure, {model})",
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
