"""Stage B of the sequence-anchor study (docs/results/sequence_anchor.md): the target tilt Branch would give
the rare strategy under ``divergence=sequence_kl``, measured offline on the fork base model's own samples.

    .venv/bin/python scripts/sequence_tilt.py --save-data docs/results/data/sequence_anchor_tilt.json.gz
    .venv/bin/python scripts/sequence_tilt.py --data docs/results/data/sequence_anchor_tilt.json.gz

The base model of ``sage-train model=tiny_fork`` samples ``--k`` completions per tail problem (the study's
evaluation set: ``eval.datasets.arith_tail`` at ``--problems``) at temperature 1, with each generated token's
next-token entropy from the sampling distribution (``sage.eval.testbed_measure.sample``). Branch's q_t at the
paper's settings (``guide=branch``: its ratio, the model's threshold, the clamp) gives each completion
log q(y) = sum_t log q_t over its tokens up to and including its end token, as the trainer's mask counts
them. A sequence anchor's target is q(y) * pi_ref(y), normalised; reweighting the base model's samples by q(y)
estimates that target's rare share, per problem (sum over rare samples of q(y) / sum of q(y)), averaged
over problems as the study's primary is. Printed: each strategy's samples and log q(y), Branch's mean q at
the fork token (the q of Stage C's token-blind fork oracle), the base and tilted rare shares and their
difference with a 95% interval over problems (sampling noise only: the problems resampled), and the stop rule
the design declares (a difference below 0.002 ends the study before any training run).

``--save-data`` writes every sample's strategy and log q(y) (and q at its fork token), from which ``--data``
prints the same text without a model."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import torch

STOP_BELOW = 0.002
"""The design's stop rule: the smallest difference a 16-seed paired design has been shown to detect here."""
DIGITS = 5


def measure(problems: int, k: int, seed: int) -> dict:
    """Sample the fork base model on the tail problems and return the data file's content."""
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.data.arith import FORK_MARKERS
    from sage.eval.sampling import prompt_texts
    from sage.eval.testbed_measure import _compose, sample
    from sage.objective.guides import BranchGuide, branch_q
    from sage.testbed.task import classify_strategy
    from sage.tracking import git_commit

    cfg = _compose("tiny_fork", "guide=branch", f"eval.datasets.arith_tail.n={problems}")
    path = str(instantiate(cfg.model.source))
    rows = instantiate(cfg.eval.datasets.arith_tail)
    guide = instantiate(cfg.guide)
    if not isinstance(guide, BranchGuide):
        raise SystemExit(f"error: guide=branch composed {type(guide).__name__}, not BranchGuide")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = prompt_texts(tokenizer, rows, chat=bool(cfg.model.chat))
    max_new_tokens = int(cfg.eval.max_new_tokens or cfg.model.max_completion_length)  # the evaluation's
    completions, entropies, tokens = sample(
        model, tokenizer, prompts, k, max_new_tokens, batch_prompts=2, seed=seed
    )
    markers = torch.tensor(tokenizer.convert_tokens_to_ids(list(FORK_MARKERS.values())))
    log_q, fork_q = [], []
    for h, ids in zip(entropies, tokens, strict=True):  # one batch: (prompts x k, T)
        valid = ~h.isnan()
        q = branch_q(h.nan_to_num(0.0), guide.ratio, guide.threshold).clamp(guide.q_min, guide.q_max)
        log_q += torch.where(valid, q.log(), torch.zeros_like(q)).sum(1).tolist()
        at_fork = valid & torch.isin(ids, markers)
        first = at_fork.float().argmax(1)
        fork_q += [float(q[i, first[i]]) if at_fork[i].any() else None for i in range(q.shape[0])]
    strategies = [classify_strategy(c) for group in completions for c in group]
    return {
        "what": "scripts/sequence_tilt.py: the fork base model's tail samples and Branch's log q(y)",
        "model": "tiny_fork",
        "git_commit": git_commit(),  # as a run's MLflow tag records it
        "guide": {
            "ratio": guide.ratio,
            "threshold": guide.threshold,
            "q_min": guide.q_min,
            "q_max": guide.q_max,
        },
        "problems": len(rows),
        "k": k,
        "sampling_seed": seed,
        "max_new_tokens": max_new_tokens,
        "strategy": strategies,
        "log_q": [round(v, DIGITS) for v in log_q],
        "fork_q": [None if v is None else round(v, DIGITS) for v in fork_q],
    }


def shares(rare: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per problem (rows): the plain rare share and the q(y)-weighted one."""
    return rare.mean(1), (rare * weight).sum(1) / weight.sum(1)


def report(data: dict, draws: int = 4000) -> str:
    from sage.data.arith import RARE_STRATEGY

    p, k = data["problems"], data["k"]
    strategy = np.array(data["strategy"]).reshape(p, k)
    log_q = np.array(data["log_q"], dtype=float).reshape(p, k)
    rare = (strategy == RARE_STRATEGY).astype(float)
    weight = np.exp(log_q - log_q.max(1, keepdims=True))  # per problem: the common factor cancels
    base, tilted = shares(rare, weight)
    diff = tilted - base
    rng = np.random.default_rng(0)
    picks = rng.integers(0, p, size=(draws, p))
    low, high = np.quantile(diff[picks].mean(1), [0.025, 0.975])
    g = data["guide"]
    lines = [
        f"Branch's q(y) on the fork base model's samples (scripts/sequence_tilt.py): {p} tail problems x {k} "
        f"samples, temperature 1, sampling seed {data['sampling_seed']}, at {data['git_commit']}; "
        f"guide=branch ratio {g['ratio']}, "
        f"threshold {g['threshold']}, clamp [{g['q_min']}, {g['q_max']}]",
        "",
        "| strategy | samples | share | mean log q(y) | log q(y) 10% / 50% / 90% | mean q at the fork |",
        "|---|---|---|---|---|---|",
    ]
    fork_q = np.array([np.nan if v is None else v for v in data["fork_q"]], dtype=float).reshape(p, k)
    for name in sorted(set(data["strategy"]), key=lambda s: -(strategy == s).sum()):
        at = strategy == name
        lq = log_q[at]
        fq = fork_q[at]
        fq = fq[~np.isnan(fq)]
        q10, q50, q90 = np.quantile(lq, [0.1, 0.5, 0.9])
        lines.append(
            f"| {name} | {at.sum()} | {at.mean():.4f} | {lq.mean():.4f} | "
            f"{q10:.4f} / {q50:.4f} / {q90:.4f} | " + (f"{fq.mean():.4f} |" if fq.size else "- |")
        )
    every_fork = fork_q[~np.isnan(fork_q)]
    lines += [
        "",
        f"Branch's mean q at the fork token, all samples: {every_fork.mean():.4f} ({every_fork.size} samples "
        "that chose a strategy): the q of Stage C's token-blind fork oracle",
        f"rare share ({RARE_STRATEGY}) of the base model's samples: {base.mean():.5f}",
        "rare share of the q(y)-tilted target (the samples reweighted by q(y), per problem): "
        f"{tilted.mean():.5f}",
        f"tilted minus base: {diff.mean():+.5f} [{low:+.5f}, {high:+.5f}] "
        "(95% over problems: sampling noise)",
    ]
    if abs(diff.mean()) < STOP_BELOW:
        verdict = (
            f"|tilted minus base| {abs(diff.mean()):.5f} < {STOP_BELOW}: by the declared rule the study "
            "stops here; even a fully binding sequence anchor would move the share by less than a "
            "16-seed paired design has been shown to detect in this world"
        )
    else:
        verdict = (
            f"|tilted minus base| {abs(diff.mean()):.5f} >= {STOP_BELOW}: by the declared rule the study "
            "goes on to Stage A"
        )
    return "\n".join([*lines, f"decision: {verdict}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="print from this data file (no model)")
    parser.add_argument("--save-data", type=Path, help="write the data file (.json or .json.gz)")
    parser.add_argument("--problems", type=int, default=100, help="tail problems (the study's: 100)")
    parser.add_argument("--k", type=int, default=256, help="samples per problem (the study's: 256)")
    parser.add_argument("--seed", type=int, default=1000, help="sampling seed (the design's: 1000)")
    args = parser.parse_args(argv)
    if args.data is not None and args.save_data is not None:
        parser.error("--data and --save-data exclude each other: one reads a data file, the other writes one")
    if args.data is not None:
        if not args.data.is_file():
            print(f"error: --data {args.data}: no such file", file=sys.stderr)
            return 2
        opener = gzip.open if args.data.suffix == ".gz" else open
        with opener(args.data, "rt") as f:
            data = json.load(f)
    else:
        data = measure(args.problems, args.k, args.seed)
        if args.save_data is not None:
            args.save_data.parent.mkdir(parents=True, exist_ok=True)
            opener = gzip.open if args.save_data.suffix == ".gz" else open
            with opener(args.save_data, "wt") as f:
                json.dump(data, f, separators=(",", ":"))
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
