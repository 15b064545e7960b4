"""The guide diagnostics' two pictures of a report (``python -m sage.eval.guide_diagnostics``):
``completions.html``, a few solutions with each token shaded by its entropy and by each guide's q, and
``summary.md``, the report's tables (``scripts/guide_summary.py`` prints it again from a
``diagnostics.json``)."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from sage.eval.guide_maths import CATEGORIES, DRAWS, LEVEL, PAPER_THRESHOLD


def _shade(value: float, scale: float, rgb: tuple[int, int, int]) -> str:
    alpha = 0.0 if not math.isfinite(value) else min(max(value / scale, 0.0), 1.0)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{alpha:.2f})"


def render_html(
    shown: list[dict[str, Any]], guide_names: list[str], thresholds: dict[str, float], title: str
) -> str:
    """The pictured solutions: per solution one line shaded by entropy (red, full at 3 nats; tokens above
    1.2 nats underlined) and one per guide shaded by q (orange above 1, blue below, full at the clamp's
    ends). Hovering a token shows its entropy, category and every q."""
    paper = thresholds.get("paper", PAPER_THRESHOLD)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>",
        "body{font-family:sans-serif;max-width:70em;margin:1em auto}",
        ".t{font-family:monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ddd;padding:.4em}",
        ".t span{border-radius:2px} .hi{text-decoration:underline 2px} h3{margin-bottom:.2em}",
        "</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p>Entropy: red, full at 3 nats; underlined above "
        f"{paper:g} nats. q: orange above 1, blue below 1, full at the clamp's end (0.6 / 1.4). "
        "Hover a token for its numbers. ↵ marks a line break.</p>",
    ]
    for k, s in enumerate(shown):
        parts.append(f"<h3>solution {k + 1}: problem {html.escape(str(s['problem_id']))}</h3>")
        parts.append(f"<p><i>{html.escape(s['problem'][:400])}</i></p>")
        lines = [("entropy", None)] + [(f"q {g}", g) for g in guide_names]
        for label, guide in lines:
            spans = []
            for i, text in enumerate(s["texts"]):
                h = s["entropy"][i]
                tip = f"H={h:.3f} nats, {s['categories'][i]}; " + ", ".join(
                    f"q_{g}={s['q'][g][i]:.3f}" for g in guide_names
                )
                shown_text = html.escape(text.replace("\n", "↵\n"))
                if guide is None:
                    color = _shade(h, 3.0, (220, 40, 40))
                else:
                    q = s["q"][guide][i]
                    color = _shade(q - 1, 0.4, (240, 140, 0)) if q >= 1 else _shade(1 - q, 0.4, (40, 90, 220))
                cls = " class='hi'" if guide is None and h > paper else ""
                spans.append(
                    f"<span{cls} style='background:{color}' title='{html.escape(tip)}'>{shown_text}</span>"
                )
            parts.append(f"<div><b>{html.escape(label)}</b><div class='t'>{''.join(spans)}</div></div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _fmt(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.3f}"


def markdown(report: dict[str, Any]) -> str:
    """The summary tables of ``report`` (what :func:`diagnose` returns)."""
    s, e, w = report["settings"], report["entropy"], report["where"]
    names = list(e["above"])
    # a diagnostics.json written before issue 58 has no interval_clusters: its intervals resampled solutions
    clusters = s.get("interval_clusters", "solution")
    if clusters == "problem":
        interval = (
            f"bootstrap over problems, {DRAWS} resamples: a problem's solutions and a solution's tokens are "
            "not independent"
        )
    else:
        interval = f"bootstrap over solutions, {DRAWS} resamples: a solution's tokens are not independent"
        if s["n_samples"] > 1:
            interval += (
                f"; these resample solutions although each problem has {s['n_samples']}, so they leave out "
                "the correlation of a problem's solutions and may be too narrow; a rerun resamples problems"
            )
    lines = [
        f"# Guide diagnostics: {s['model']} on {', '.join(s['datasets'])}",
        "",
        f"{e['solutions']} solutions ({s['problems']} problems x {s['n_samples']}, sampled at temperature "
        f"{s['temperature']:g}, top-p {s['top_p']:g}, up to {s['max_new_tokens']} tokens, backend "
        f"{s['backend']}, seed {s['seed']}), {e['tokens']} solution tokens "
        f"({e['mean_tokens_per_solution']:.1f} per solution). Entropy: the model's full next-token "
        "distribution at temperature 1, from a teacher-forced pass over each prompt + solution (nats).",
        "",
        "## Token entropy",
        "",
        "| mean | " + " | ".join(e["quantiles"]) + " |",
        "|---|" + "---|" * len(e["quantiles"]),
        f"| {e['mean']:.3f} | " + " | ".join(f"{v:.3f}" for v in e["quantiles"].values()) + " |",
        "",
        "| threshold | nats | share of tokens above | per solution |",
        "|---|---|---|---|",
    ]
    for name, a in e["above"].items():
        lines.append(f"| {name} | {a['threshold']:.3f} | {a['share']:.4f} | {a['per_solution']:.2f} |")
    lines += ["", "Histogram (share of tokens per entropy bin, nats):", "", "| bin | share |", "|---|---|"]
    for b in e["histogram"]:
        lines.append(f"| [{b['low']:g}, {b['high']:g}) | {b['share']:.4f} |")
    lines += [
        "",
        "## Where the high-entropy tokens fall",
        "",
        "Share of each category among all tokens (base rate) and among the tokens above each threshold, "
        f"with the lift (share / base rate) and its {LEVEL:.0%} interval ({interval}); mean entropy and "
        "P(H > threshold) per category.",
        "",
        "| category | base rate | mean H | "
        + " | ".join(f"share > {n} | lift > {n} | P(H > {n})" for n in names)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(names),
    ]
    for c in CATEGORIES:
        cells = [_fmt(w["base_rate"][c]), _fmt(w["mean_entropy"][c])]
        for n in names:
            lift = _fmt(w[n]["lift"][c])
            if c in w[n].get("lift_interval", {}):
                lo, hi = w[n]["lift_interval"][c]
                lift += f" [{_fmt(lo)}, {_fmt(hi)}]"
            cells += [_fmt(w[n]["share"][c]), lift, _fmt(w[n]["above_rate"][c])]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    approach = ("approach_word", "step_opening")
    cells = [_fmt(sum(w["base_rate"][c] for c in approach)), ""]
    for n in names:
        share = sum(w[n]["share"][c] for c in approach)
        base = sum(w["base_rate"][c] for c in approach)
        cells += [_fmt(share), _fmt(share / base if base else math.nan), ""]
    lines.append("| **approach word or step opening** | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Tokens above each threshold: " + ", ".join(f"{n} {w[n]['tokens']}" for n in names) + ".",
    ]
    for n in names:
        lines += ["", f"The most frequent tokens above {n} ({e['above'][n]['threshold']:.3f} nats):", ""]
        lines += ["| token | count | share of those above | P(above \\| token) |", "|---|---|---|---|"]
        for t in report["top_tokens"][n]:
            shown = json.dumps(t["text"], ensure_ascii=False).replace("|", "\\|")
            lines.append(f"| `{shown}` | {t['count']} | {t['share']:.3f} | {t['selected_rate']:.3f} |")
    lines += [
        "",
        "## Each guide's q (training step 0: the policy is the reference)",
        "",
        "| guide | q mean | q std | q p5 | q p50 | q p95 | q max | share q > 1 | share q < 1 | "
        + " | ".join(f"mean q where H > {n}" for n in names)
        + " |",
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for name, g in report["guides"].items():
        qs = g["quantiles"]
        cells = [
            g["mean"],
            g["std"],
            qs["q5"],
            qs["q50"],
            qs["q95"],
            g["max"],
            g["share_gt_1"],
            g["share_lt_1"],
        ]
        cells += [g["mean_above"][n] for n in names]
        lines.append(f"| {name}: {g['described']} | " + " | ".join(_fmt(v) for v in cells) + " |")
    lines += ["", "Mean q per category:", "", "| guide | " + " | ".join(CATEGORIES) + " |"]
    lines.append("|---|" + "---|" * len(CATEGORIES))
    for name, g in report["guides"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(g["mean_by_category"][c]) for c in CATEGORIES) + " |")
    if "strength_by_bucket" in report:
        buckets = report["strength_by_bucket"]
        guides = [k for k in buckets[0] if k not in ("bucket", "share", "entropy_low", "entropy_high")]
        lines += [
            "",
            "## Each guide's anchor strength by entropy bucket",
            "",
            "The buckets of the training log (`anchor_buckets/`: the entropy quintiles of these tokens, q1 "
            "lowest, and the tokens above 1.2 nats); the anchor's mean strength under k3 (the factor on "
            "beta: a guide's q, Archer's 0 where it releases the anchor).",
            "",
            "| bucket | share of tokens | entropy (nats) | " + " | ".join(guides) + " |",
            "|---|---|---|" + "---|" * len(guides),
        ]
        for b in buckets:
            span = f"{b['entropy_low']:.3f}-{b['entropy_high']:.3f}"
            cells = " | ".join(_fmt(b[g]) for g in guides)
            lines.append(f"| {b['bucket']} | {_fmt(b['share'])} | {span} | {cells} |")
    if "branch_vs_archer" in report:
        lines += [
            "",
            "## Branch against Archer on the same tokens",
            "",
            "The anchor's mean strength (the factor on beta at a token under k3) of each by entropy bin "
            "(nats). Branch's strength is its q: it pulls harder toward pi_ref at high-entropy tokens. "
            "Archer's is q_low at each solution's low-entropy tokens and q_high above its quantile, 0 for "
            "its release (q_high = 0: there its q is pi/pi_ref, 1 at step 0 as in the table above, and the "
            "anchor is the policy itself); the ratio is Branch's pull over Archer's (n/a where Archer's is "
            "0).",
            "",
            "| entropy bin | share of tokens | branch strength | archer strength | branch / archer |",
            "|---|---|---|---|---|",
        ]
        for b in report["branch_vs_archer"]:
            cells = [b["share"], b["a"], b["b"], b["ratio"]]
            lines.append(f"| [{b['low']:g}, {b['high']:g}) | " + " | ".join(_fmt(v) for v in cells) + " |")
    lines += ["", "Categories: " + CATEGORY_NOTE, ""]
    return "\n".join(lines)


# the lexicon's path as the committed summaries print it (docs/results/real_entropy_*.md, rebuilt byte for
# byte by scripts/guide_summary.py); it now lives in sage.eval.guide_maths
CATEGORY_NOTE = (
    "approach_word: the first token of a word of the approach lexicon (sage.eval.guide_diagnostics."
    "APPROACH_WORDS); step_opening: any other first visible token of a line or sentence; number: has a "
    "digit; operator: symbols only or a LaTeX command; whitespace: spaces and line breaks; other: the rest "
    "(word pieces, other words, special tokens). One category per token, the first that applies."
)
