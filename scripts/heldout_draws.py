"""GRPO minus base on several draws of the fork world's held-out problems, through sage-eval's own path: how
much a 100-problem draw moves the difference, against the problem part of the interval each draw reports.

    .venv/bin/python scripts/heldout_draws.py outputs/gap/grpo_s{1..8} --draws 0-9
    .venv/bin/python scripts/heldout_draws.py --draws 0,1          # the base model alone

Each RUN folder's ``final/`` and the fork world's base model (``model=tiny_fork``) are evaluated on the
held-out draws ``heldout_rows(n=--problems, seed=d)`` by ``sage.eval.evaluate.evaluate_model`` under the
config ``sage-eval model=tiny_fork eval.n_samples=--samples`` composes (temperature 1.0, top-p 1.0, 64 new
tokens, eval seed 0, the hf backend): draw 1 is the fair test's second draw (`docs/results/fork_reading.md`).
Cells go to ``--out/<run>/`` and are reused by a rerun. Prints, per draw, its tier mix, base and GRPO
pass@1, GRPO minus base with the interval of ``analysis/bootstrap.difference`` (base as the reference), the
problem part of its standard error, and the difference the tier mix predicts from draw ``--reference``'s
per-tier differences; then the spread of the difference over the draws against the problem parts. The runs'
own in-run figures (``metrics.json``) are printed beside, where the runs evaluated held-out pass@1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from analysis import bootstrap  # noqa: E402

TIERS = ("easy", "hard", "tail")


def draws_arg(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in text.split(",")]


def eval_config(samples: int):
    """The model and eval nodes ``sage-eval model=tiny_fork eval.n_samples=<samples>`` runs with."""
    from hydra import compose, initialize_config_dir

    from sage.eval.main import register_evaluate_configs

    register_evaluate_configs()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        return compose("evaluate", overrides=["model=tiny_fork", f"eval.n_samples={samples}", "eval.ks=[1]"])


def per_problem(model_path: str, rows: dict[str, list[dict]], cfg, out: Path, pool) -> dict[str, np.ndarray]:
    """Per draw, the model's per-problem pass@1 (mean over samples; one eval seed)."""
    from sage.eval.evaluate import evaluate_model

    res = evaluate_model(
        model_path,
        rows,
        cfg.eval,
        chat=cfg.model.chat,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.model.max_completion_length,
        results_dir=out,
        dtype=str(cfg.model.dtype),
        pool=pool,
    )
    return {name: np.mean([c.mean(axis=1) for c in r["correct"]], axis=0) for name, r in res.items()}


def problem_part(values: np.ndarray, base: np.ndarray) -> float:
    """The problem part of ``bootstrap.difference``'s variance (base as the reference); with one run, whose
    residual noise nothing separates, the whole spread over problems."""
    noise = bootstrap.seed_noise(values)
    per = values.mean(axis=0) - base.mean(axis=0)
    resid = noise.resid_var / len(values) if noise is not None else 0.0
    return max(0.0, float(per.var(ddof=1)) - resid) / len(per)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "runs",
        nargs="*",
        type=Path,
        help="run folders holding final/ (one GRPO row, its seeds); none: base only",
    )
    p.add_argument(
        "--draws", type=draws_arg, default=draws_arg("0-9"), help="held-out draw seeds: 0-9 or 0,1"
    )
    p.add_argument("--problems", type=int, default=100)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--reference", type=int, default=0, help="the draw whose per-tier differences predict")
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "heldout_draws")
    args = p.parse_args()

    from sage.grading import GradingPool
    from sage.targets import instantiate_node
    from sage.testbed.task import heldout_rows, problem_tier

    cfg = eval_config(args.samples)
    rows = {f"draw{d}": heldout_rows(n=args.problems, seed=d) for d in args.draws}
    tiers = {
        name: np.array(
            [problem_tier("fork", *map(int, r["problem"][:-1].split("+")[0].split("*"))) for r in rs]
        )
        for name, rs in rows.items()
    }
    base_path = instantiate_node(cfg.model.source)
    with GradingPool(workers=2) as pool:
        base = per_problem(base_path, rows, cfg, args.out / "base", pool)
        trained = [per_problem(str(run / "final"), rows, cfg, args.out / run.name, pool) for run in args.runs]

    in_run = []
    for run in args.runs:
        metrics = run / "metrics.json"
        if metrics.is_file():
            in_run.append(json.loads(metrics.read_text()).get("pass_at_1/trained/arith_heldout"))
    if in_run and None not in in_run:
        sd = np.std(in_run, ddof=1) if len(in_run) > 1 else math.nan
        print(f"in-run held-out pass@1 of the {len(in_run)} runs: {np.mean(in_run):.3f} ± {sd:.3f}")

    base_tiers = {name: {t: float(base[name][tiers[name] == t].mean()) for t in TIERS} for name in rows}
    ref_base = base_tiers[f"draw{args.reference}"]
    print("| draw | easy/hard/tail | base pass@1 | base by tier (easy/hard/tail) | tier mix predicts |")
    print("|---|---|---|---|---|")
    for name in rows:
        counts = {t: int((tiers[name] == t).sum()) for t in TIERS}
        predicted = sum(counts[t] * ref_base[t] for t in TIERS) / args.problems
        by_tier = "/".join(f"{base_tiers[name][t]:.3f}" for t in TIERS)
        print(
            f"| {name[4:]} | {counts['easy']}/{counts['hard']}/{counts['tail']} | {base[name].mean():.3f} | "
            f"{by_tier} | {predicted:.3f} |"
        )
    if not args.runs:
        return

    def tier_diff(name: str) -> dict[str, float]:
        values = np.stack([t[name] for t in trained])
        return {
            t: float(values[:, tiers[name] == t].mean() - base[name][tiers[name] == t].mean()) for t in TIERS
        }

    ref = tier_diff(f"draw{args.reference}")
    print(
        f"{len(args.runs)} runs, {args.problems} problems x {args.samples} samples per draw; per-tier "
        f"differences of draw {args.reference}: " + ", ".join(f"{t} {ref[t]:+.3f}" for t in TIERS)
    )
    print("| draw | easy/hard/tail | base | GRPO | GRPO - base [95%] | problem se | tier mix predicts |")
    print("|---|---|---|---|---|---|---|")
    diffs, parts = [], []
    for name in rows:
        values = np.stack([t[name] for t in trained])
        interval = bootstrap.difference(values, base[name][None, :], ref_is_base=True)
        part = problem_part(values, base[name][None, :])
        counts = {t: int((tiers[name] == t).sum()) for t in TIERS}
        predicted = sum(counts[t] * ref[t] for t in TIERS) / args.problems
        diffs.append(interval.diff)
        parts.append(part)
        print(
            f"| {name[4:]} | {counts['easy']}/{counts['hard']}/{counts['tail']} | {base[name].mean():.3f} | "
            f"{values.mean():.3f} | {interval.diff:+.3f} [{interval.lo:.3f}, {interval.hi:.3f}] | "
            f"{math.sqrt(part):.4f} | {predicted:+.3f} |"
        )
    if len(diffs) > 1:
        print(
            f"over {len(diffs)} draws: GRPO - base {np.mean(diffs):+.3f}, SD between draws "
            f"{np.std(diffs, ddof=1):.4f}"
            f" (range {min(diffs):+.3f} to {max(diffs):+.3f}); the problem part's se, root mean square "
            f"{math.sqrt(np.mean(parts)):.4f}"
        )


if __name__ == "__main__":
    main()
