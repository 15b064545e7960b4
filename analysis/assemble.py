"""One report from the MLflow record: its inputs gathered and checked (``analysis.inputs``), its sections
in order (``analysis.sections``), under a head that says where the numbers come from and how to read them,
with the notes at the end and the included files after them; the Markdown written to ``out``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from analysis import bootstrap, load, moved, tables
from analysis.inputs import Inputs, gather
from analysis.load import ReportError
from analysis.page import Page
from analysis.sections import analyses, anchor, curves, differences, methods, perplexity, problems_moved
from analysis.sections.differences import NOISE_SENTENCE
from analysis.selection import Selection
from analysis.tables import Table
from sage.tracking import redact


def portable_uri(uri: str) -> str:
    """The store as a report may record it: credentials redacted, and a SQLite file relative to the folder
    sage-report ran from (a machine's absolute paths do not belong in committed results)."""
    uri = redact(uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and os.path.isabs(uri[len(prefix) :]):
        return prefix + os.path.relpath(uri[len(prefix) :])
    return uri


def cwd_relative_path(path: Path) -> str:
    """A file as a committed report names it: relative to the folder sage-report ran from."""
    return os.path.relpath(path) if Path(path).is_absolute() else str(path)


def provenance(uri: str, experiment: str, run_ids: Sequence[str], sel: Selection) -> str:
    commits = sel.runs["git_commit"].value_counts()
    commit_text = ", ".join(f"`{c[:12]}` ({n} runs)" for c, n in commits.items())
    names = [] if run_ids else load.experiment_names(experiment)
    label = "experiment" if len(names) == 1 else "experiments"
    what = f"runs {', '.join(run_ids)}" if run_ids else f"{label} " + ", ".join(f"`{n}`" for n in names)
    return (
        f"Provenance: {what} in `{portable_uri(uri)}`; {len(sel.runs)} finished sage-train runs used"
        f" ({sel.skipped} left out); seeds asked {sel.seeds}; git commits: {commit_text};"
        f" generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by sage-report."
    )


def head(
    uri: str, experiment: str, run_ids: Sequence[str], inputs: Inputs, page: Page, paired_seeds: bool
) -> str:
    """The title, provenance and warnings, and how to read the cells and the differences shown."""
    text = f"# Results: {'selected runs' if run_ids else 'experiment ' + experiment}\n\n"
    text += provenance(uri, experiment, run_ids, inputs.sel) + "\n\n"
    text += "".join(f"**Warning:** {w}\n\n" for w in inputs.warnings)
    text += (
        "Cells: mean ± std (ddof=1) over training seeds; `± —`: one seed; `(n/m seeds)`: fewer seeds than "
        "asked, the mean is over those present.\n"
    )
    if {"diff_vs_reference", "diff_vs_base"} & set(page.tables):
        text += (
            f"Differences between methods are shown with {bootstrap.LEVEL:.0%} t intervals over problems "
            f"and seeds, `{tables.MARKER}` where the interval excludes 0, `{tables.HOLM}` where the "
            f"difference also survives Holm's correction over its table. {NOISE_SENTENCE}\n"
        )
        if paired_seeds and "diff_vs_reference" in page.tables:
            text += (
                f"Differences against {inputs.ref_row} are paired by training seed (--paired-seeds) for "
                "the rows run on its seeds; the other rows, and the differences against the start model, "
                "are not.\n"
            )
    return text


@dataclass
class Report:
    """A written report: its Markdown, its tables and figures by name, its notes and warnings."""

    markdown: str
    tables: dict[str, Table]
    figures: dict[str, Path]
    notes: list[str]
    warnings: list[str] = field(default_factory=list)


def make_report(
    client,
    uri: str,
    *,
    experiment: str = "sage",
    run_ids: Sequence[str] = (),
    filter_string: str = "",
    seeds: Sequence[int] | None = None,
    k: int | None = None,
    out: Path,
    figures_dir: Path,
    tables_dir: Path,
    perplexity_cap: int = 2000,
    digits: int = 3,
    extra_ks: Sequence[int] = (),
    includes: Sequence[Path] = (),
    reference: str | None = None,
    draws: int = 2000,
    rng_seed: int = 0,
    min_seeds: int = 5,
    primary: tuple[str, str, int] | None = None,
    lost_threshold: float = moved.LOST_THRESHOLD,
    paired_seeds: bool = False,
) -> Report:
    """The report as the sections below add to it, in this order; written to ``out`` with its tables and
    figures. A ReportError, before anything is written, when the runs and flags make no report."""
    if not 0 < lost_threshold <= 1:
        raise ReportError(f"--lost-threshold must be in (0, 1], not {lost_threshold}")
    if primary is not None and draws <= 0:
        raise ReportError("--primary needs the intervals that --bootstrap 0 turns off")
    if draws < 0:
        raise ReportError(f"--bootstrap {draws}: the bootstrap draws are 0 (no intervals nor bands) or more")
    inputs = gather(client, experiment, run_ids, filter_string, seeds, k, extra_ks, reference, min_seeds)
    page = Page(out, figures_dir, tables_dir, digits, inputs.notes)
    methods.add_ablation(page, inputs, extra_ks)
    if draws > 0:
        differences.add(page, inputs, extra_ks, primary, paired_seeds)
        problems_moved.add(page, inputs, lost_threshold)
        page.notes += list(inputs.pv.compared_on.values())
    else:
        page.notes.append(
            "no differences nor 'Which problems moved' section: --bootstrap 0 computes no intervals"
        )
    methods.add_grid(page, inputs)
    methods.add_grad_norm(page, inputs)
    anchor.add(page, inputs)
    analyses.add(page, inputs)
    if perplexity_cap > 0:
        perplexity.add(page, inputs, perplexity_cap)
    curves.add_passk(page, inputs, draws, rng_seed)
    curves.add_reward_vs_heldout(page, inputs)

    notes = page.notes
    note_text = "\n## Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n" if notes else ""
    # Included files (another sage-report, a measurement, a written reading) follow verbatim.
    included = "".join("\n" + Path(f).read_text() for f in includes)
    markdown = head(uri, experiment, run_ids, inputs, page, paired_seeds) + "\n" + "\n".join(page.sections)
    markdown += note_text + included
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    return Report(markdown, page.tables, page.figures, notes, inputs.warnings)
