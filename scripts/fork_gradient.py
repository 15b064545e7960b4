"""The q = 4 sign (issue 58, docs/results/dose_response.md): at the fork token, what each term of GRPO's loss
does to the rare strategy's probability, measured on a policy's own rollouts.

    .venv/bin/python scripts/fork_gradient.py --save-data docs/results/data/fork_gradient_base.json.gz
    .venv/bin/python scripts/fork_gradient.py --data docs/results/data/fork_gradient_base.json.gz

The policy (``--checkpoint``, default the fork base model of ``sage-train model=tiny_fork``) samples
``--groups`` groups of the trainer's ``trl.num_generations`` completions per training prompt at the trainer's
temperature; each completion is graded (the testbed's answer check) and gets GRPO's group advantage
(``scale_rewards=group``). At its fork token (the strategy marker) the policy's and pi_ref's probabilities of
the six strategies are read off the full next-token distribution.

The maths. The fork token's loss terms reach the fork's logits z through d log pi(y) / dz = e_y - pi. TRL's
``loss_type=grpo`` averages a completion's per-token terms over its own length |o|, so the descent step on z
from one completion is w (A + beta (r - 1)) (e_y - pi), with w = 1 / (N |o|), A its advantage (the
policy-gradient term -A r has derivative -A on-policy) and r = q pi_ref(y) / pi(y) (k3 = r - log r - 1 has
derivative 1 - r). The rare strategy's probability then moves by pi_rare (delta_{y,rare} - pi_rare - pi_y
+ sum_k pi_k^2) per unit step (:func:`rare_step`). The anchor's factor splits exactly as
beta (r - 1) = beta q (pi_ref(y) - pi(y)) / pi(y) + beta (q - 1):
- the *restoring* part, beta q (pi_ref - pi) / pi, whose expectation over y ~ pi moves pi towards pi_ref
  (it is 0 where pi = pi_ref), q times as hard as q = 1: q acts here as a larger beta;
- the *constant* part, beta (q - 1), the same positive "advantage" for every sampled fork token. Its
  expectation, beta (q - 1) sum_y pi(y) E[w | y] (e_y - pi), is 0 only if w does not depend on y. Under
  ``loss_type=grpo`` it does: w = 1 / (N |o|) favours the strategies whose completions are short. Under
  ``bnpo`` (one normaliser for the batch) it does not.
So a token-blind q > 1 at the fork is not a larger beta under per-sequence length normalisation: it adds a
push towards short strategies, proportional to q - 1, that 4x beta (q = 1) does not have. Printed per term,
per q (1, 1.4, 4) and beta (the regime's and 4x), under ``grpo`` and ``bnpo``: the mean over prompts of the
expected first-order change of the rare strategy's probability at the fork per unit step of the fork's logits
(over y ~ pi at each prompt's fork, with E[w | y] and E[w A | y] per strategy pooled over a tier's prompts),
with a 95% interval over prompts (resampled with their samples), and each strategy's share and length.

What it leaves out: the fork's logits are not free parameters (a step moves every prompt's logits through the
shared weights) and Adam rescales the step; the terms' signs at the fork, not the trained share, are what this
measures."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

QS = (1.0, 1.4, 4.0)
"""The fork oracle's q of the fork study (1.4, the paper's clamp), of the dose study (4), and GRPO's 1."""
BETA_TIMES = (1.0, 4.0)
"""The regime's beta and the dose study's 4x beta."""
LOSS_TYPES = ("grpo", "bnpo")
DIGITS = 6


def rare_step(pi: np.ndarray, y: np.ndarray, rare: int) -> np.ndarray:
    """d pi_rare along the descent direction e_y - pi of the fork's logits (first order), per sample.
    pi: (S, K) the policy's strategy probabilities at each sample's fork, y: (S,) the chosen strategy."""
    s = np.arange(len(y))
    return pi[:, rare] * ((y == rare) - pi[:, rare] - pi[s, y] + (pi**2).sum(1))


def weights(lengths: np.ndarray, prompt: np.ndarray, loss_type: str) -> np.ndarray:
    """Each completion's weight in the loss, each prompt's samples as one batch: the derivative of the
    trainer's own aggregation (``sage.objective.aggregation.aggregate``) with respect to one of the
    completion's per-token terms, i.e. ``grpo`` 1 / (n |o|) (its own length, then the mean over completions),
    ``bnpo`` 1 / sum |o| (one normaliser for all tokens)."""
    import torch

    from sage.objective.aggregation import aggregate

    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    out = np.empty(len(lengths))
    for p in np.unique(prompt):
        at = np.flatnonzero(prompt == p)
        n = torch.as_tensor(lengths[at], dtype=torch.float64)
        mask = (torch.arange(int(n.max()), dtype=torch.float64) < n[:, None]).double()
        per_token = torch.zeros_like(mask, requires_grad=True)
        total = aggregate(
            per_token, mask, loss_type, max_completion_length=mask.shape[1], num_items_in_batch=None,
            grad_accum_steps=1, steps_per_generation=1, num_processes=1, training=False,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(total, per_token)
        out[at] = grad[:, 0].numpy()  # every completion has a first token: its weight
    return out


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO's advantages with ``scale_rewards=group``: (r - group mean) / (group std + 1e-4), std unbiased as
    torch's (TRL's)."""
    g = rewards.reshape(-1, group)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def expected_terms(
    pi: np.ndarray,
    ref: np.ndarray,
    length_moment: np.ndarray,
    advantage_moment: np.ndarray,
    rare: int,
    q: float,
    beta: float,
) -> dict[str, np.ndarray]:
    """Per prompt, each term's expected first-order change of pi_rare at the fork per unit step, over y ~ pi:
    pi, ref (P, K) the fork's strategy probabilities; length_moment (..., P, K) E[n w | y] (n w = 1 / |o|
    under ``grpo``); advantage_moment (..., P, K) E[n w A | y]. With d(y) = :func:`rare_step`: policy
    gradient sum_y pi_y E[n w A | y] d(y); anchor, restoring beta q sum_y E[n w | y] (ref_y - pi_y) d(y);
    anchor, constant beta (q - 1) sum_y pi_y E[n w | y] d(y). Each (..., P)."""
    P, K = pi.shape
    d = np.stack([rare_step(pi, np.full(P, y), rare) for y in range(K)], axis=1)  # (P, K)
    return {
        "policy gradient": (pi * advantage_moment * d).sum(-1),
        "anchor, restoring": beta * q * (length_moment * (ref - pi) * d).sum(-1),
        "anchor, constant": beta * (q - 1.0) * (pi * length_moment * d).sum(-1),
    }


def prompt_sums(data: dict, loss_type: str) -> dict[str, np.ndarray]:
    """Per prompt that chose a strategy in any sample: its fork distributions (the mean of its samples'), its
    tier, and per strategy the count of samples, the sum of n w and of n w A over them ((P, K) each)."""
    chose = np.array(data["fork"]) >= 0
    prompt = np.array(data["prompt"])
    w = weights(np.array(data["length"], dtype=float), prompt, loss_type) * np.bincount(prompt)[prompt]  # n w
    prompt, y = prompt[chose], np.array(data["fork"])[chose]
    w, advantage = w[chose], np.array(data["advantage"], dtype=float)[chose]
    keep, row = np.unique(prompt, return_inverse=True)
    K = len(data["strategies"])

    def per(values):
        out = np.zeros((len(keep), K))
        np.add.at(out, (row, y), values)
        return out

    count = per(np.ones_like(w))
    n = count.sum(1, keepdims=True)
    return {
        "pi": per_prompt_mean(np.array(data["pi"], dtype=float)[chose], row, n),
        "ref": per_prompt_mean(np.array(data["ref"], dtype=float)[chose], row, n),
        "tier": np.array(data["tier"])[keep],
        "count": count,
        "w": per(w),
        "wA": per(w * advantage),
    }


def per_prompt_mean(values: np.ndarray, row: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The mean of each prompt's sample rows of ``values`` (S, K): ``row`` (S,) the prompt's index, ``n``
    (P, 1) its number of samples."""
    out = np.zeros((len(n), values.shape[1]))
    np.add.at(out, row, values)
    return out / n


def tier_moments(sums: dict, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E[n w | y] and E[n w A | y] per strategy, pooled over the prompts of each prompt's tier, each prompt
    counted ``times`` (D, P) (a bootstrap draw's multiplicities): (D, P, K) each (0 where a tier never chose
    the strategy)."""
    D, (P, K) = times.shape[0], sums["count"].shape
    ell, adv = np.zeros((D, P, K)), np.zeros((D, P, K))
    for tier in np.unique(sums["tier"]):
        at = sums["tier"] == tier
        count = times[:, at] @ sums["count"][at]  # (D, K)
        safe = np.where(count > 0, count, 1.0)
        ell[:, at] = np.where(count > 0, times[:, at] @ sums["w"][at] / safe, 0.0)[:, None]
        adv[:, at] = np.where(count > 0, times[:, at] @ sums["wA"][at] / safe, 0.0)[:, None]
    return ell, adv


COLUMNS = ("policy gradient", "anchor, restoring", "anchor, constant", "anchor", "total")


def term_table(data: dict, loss_type: str, rows: list[tuple[float, float]], draws: int, seed: int = 0):
    """Per (beta, q) of ``rows``, each of COLUMNS as the mean over prompts (x 1e3) and its 95% percentile
    interval, prompts resampled with their samples (the pooled moments recomputed in every draw)."""
    rare = data["strategies"].index(data["rare"])
    sums = prompt_sums(data, loss_type)
    P = len(sums["tier"])
    rng = np.random.default_rng(seed)
    times = np.vstack([np.ones(P), rng.multinomial(P, np.full(P, 1 / P), size=draws)])  # the point first
    ell, adv = tier_moments(sums, times)
    out = {}
    for beta, q in rows:
        t = expected_terms(sums["pi"], sums["ref"], ell, adv, rare, q, beta)
        t["anchor"] = t["anchor, restoring"] + t["anchor, constant"]
        t["total"] = t["anchor"] + t["policy gradient"]
        means = {c: 1e3 * (times * t[c]).sum(1) / P for c in COLUMNS}  # (1 + draws,)
        out[beta, q] = {c: (m[0], *np.quantile(m[1:], [0.025, 0.975])) for c, m in means.items()}
    return out


def report(data: dict, draws: int = 2000) -> str:
    strategies = data["strategies"]
    fork = np.array(data["fork"])
    lengths = np.array(data["length"], dtype=float)
    lines = [
        f"fork_gradient.py: {data['policy']} at {data['git_commit']}, {data['prompts']} training prompts x "
        f"{data['groups']} groups of {data['group']} samples, temperature {data['temperature']}, sampling "
        f"seed {data['sampling_seed']}; beta {data['beta']}; {int((fork >= 0).sum())} of {len(fork)} samples "
        "chose a strategy",
        "",
        "| strategy | share | mean length | mean 1 / length | mean pi at the fork | mean pi_ref |",
        "|---|---|---|---|---|---|",
    ]
    pi = np.array(data["pi"], dtype=float)
    ref = np.array(data["ref"], dtype=float)
    chose = fork >= 0
    for k, name in enumerate(strategies):
        at = fork == k
        if not at.any():
            lines.append(f"| {name} | 0 | - | - | {pi[chose, k].mean():.4f} | {ref[chose, k].mean():.4f} |")
            continue
        lines.append(
            f"| {name} | {at.mean():.4f} | {lengths[at].mean():.2f} | {(1 / lengths[at]).mean():.5f} | "
            f"{pi[chose, k].mean():.4f} | {ref[chose, k].mean():.4f} |"
        )
    lines += [
        "",
        f"Expected first-order change of pi({data['rare']}) at the fork per unit descent step of the fork's "
        "logits (over y ~ pi, per-strategy moments pooled by tier), x 1e3, mean over prompts [95%: prompts "
        "resampled]:",
        "",
        "| loss_type | beta | q | policy gradient | anchor, restoring | anchor, constant | anchor | total |",
        "|---|---|---|---|---|---|---|---|",
    ]

    rows = [(data["beta"] * times, q) for times in BETA_TIMES for q in (QS if times == 1.0 else (1.0,))]
    for loss_type in LOSS_TYPES:
        table = term_table(data, loss_type, rows, draws)
        for beta, q in rows:
            t = table[beta, q]
            cells = " | ".join(f"{t[c][0]:+.4f} [{t[c][1]:+.4f}, {t[c][2]:+.4f}]" for c in COLUMNS)
            lines.append(f"| {loss_type} | {beta:g} | {q:g} | {cells} |")
    return "\n".join(lines)


def measure(checkpoint: str | None, prompts: int, groups: int, seed: int) -> dict:
    """Sample the policy on training prompts and return the data file's content. One prompt per batch: no
    padding, so the scoring pass's positions are the sampling pass's."""
    import torch
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.eval.sampling import prompt_texts
    from sage.eval.testbed_measure import _compose
    from sage.testbed.task import FORK_MARKERS, RARE_STRATEGY, is_correct, make_problems, problem_tier
    from sage.tracking import git_commit

    cfg = _compose("tiny_fork", "regime=anchored", "experiment=grpo_fork")
    base = str(instantiate(cfg.model.source))
    path = checkpoint or base
    group = int(cfg.trl.num_generations)
    temperature = float(cfg.trl.temperature)
    max_new_tokens = int(cfg.model.max_completion_length)
    tokenizer = AutoTokenizer.from_pretrained(base)
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    reference = AutoModelForCausalLM.from_pretrained(base).eval()
    rows = make_problems("train", int(cfg.data.n), int(cfg.data.seed))[
        :prompts
    ]  # the trainer's first prompts
    texts = prompt_texts(tokenizer, rows, chat=bool(cfg.model.chat))
    strategies = list(FORK_MARKERS)
    markers = torch.tensor(tokenizer.convert_tokens_to_ids([FORK_MARKERS[s] for s in strategies]))
    eos = tokenizer.eos_token_id
    k = group * groups
    out = {key: [] for key in ("prompt", "fork", "pi", "ref", "length", "reward")}
    torch.manual_seed(seed)
    for start in range(len(rows)):
        inputs = tokenizer(texts[start : start + 1], return_tensors="pt")
        with torch.inference_mode():
            seqs = policy.generate(
                **inputs,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=k,
            )
            # the distribution each position's token was drawn from (temperature applied, as sampled)
            pi_all = torch.softmax(policy(seqs).logits.float() / temperature, -1)
            ref_all = torch.softmax(reference(seqs).logits.float() / temperature, -1)
        width = inputs["input_ids"].shape[1]
        generated = seqs[:, width:]
        is_eos = generated == eos
        length = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.tensor(generated.shape[1]))
        completions = tokenizer.batch_decode(generated, skip_special_tokens=True)
        for i in range(seqs.shape[0]):
            row = start
            valid = generated[i, : int(length[i])]
            hit = torch.isin(valid, markers).nonzero()
            if len(hit):
                t = int(hit[0])
                pos = width + t - 1  # the logits that predicted the fork token
                choice = int((markers == valid[t]).nonzero()[0])
                pi = pi_all[i, pos, markers].tolist()
                ref = ref_all[i, pos, markers].tolist()
            else:
                choice, pi, ref = -1, [float("nan")] * len(strategies), [float("nan")] * len(strategies)
            out["prompt"].append(row)
            out["fork"].append(choice)
            out["pi"].append([round(v, DIGITS) for v in pi])
            out["ref"].append([round(v, DIGITS) for v in ref])
            out["length"].append(int(length[i]))
            out["reward"].append(float(is_correct(completions[i], rows[row]["answer"])))
    advantage = group_advantages(np.array(out["reward"]), group)
    return {
        "what": "scripts/fork_gradient.py: a policy's fork-world rollouts at the fork token",
        "policy": "the fork base model" if checkpoint is None else relative(checkpoint),
        "git_commit": git_commit(),
        "strategies": strategies,
        "rare": RARE_STRATEGY,
        "beta": float(cfg.divergence.beta),
        "group": group,
        "groups": groups,
        "prompts": prompts,
        "temperature": temperature,
        "sampling_seed": seed,
        "tier": [problem_tier("fork", r["a"], r["b"]) for r in rows],
        **out,
        "advantage": [round(float(a), DIGITS) for a in advantage],
    }


def relative(path: str) -> str:
    """``path`` relative to the working directory where it lies under it (a data file carries no machine's
    absolute paths), else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="print from this data file (no model)")
    parser.add_argument("--save-data", type=Path, help="write the data file (.json or .json.gz)")
    parser.add_argument(
        "--checkpoint", help="a policy folder (a run's final/ or rl/checkpoint-N); default: base"
    )
    parser.add_argument("--prompts", type=int, default=200, help="training prompts (default 200)")
    parser.add_argument(
        "--groups", type=int, default=4, help="groups of num_generations per prompt (default 4)"
    )
    parser.add_argument("--seed", type=int, default=2000, help="sampling seed (default 2000)")
    args = parser.parse_args(argv)
    if args.data is not None and (args.save_data is not None or args.checkpoint is not None):
        parser.error("--data reads a data file: --save-data and --checkpoint are for a measurement")
    if args.data is not None:
        if not args.data.is_file():
            print(f"error: --data {args.data}: no such file", file=sys.stderr)
            return 2
        with (gzip.open if args.data.suffix == ".gz" else open)(args.data, "rt") as f:
            data = json.load(f)
    else:
        if args.checkpoint is not None and not (Path(args.checkpoint) / "config.json").is_file():
            print(
                f"error: --checkpoint {args.checkpoint}: no config.json: not a model folder", file=sys.stderr
            )
            return 2
        data = measure(args.checkpoint, args.prompts, args.groups, args.seed)
        if args.save_data is not None:
            args.save_data.parent.mkdir(parents=True, exist_ok=True)
            with (gzip.open if args.save_data.suffix == ".gz" else open)(args.save_data, "wt") as f:
                json.dump(data, f, separators=(",", ":"))
    print(report(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
