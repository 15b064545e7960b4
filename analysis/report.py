"""sage-report: the paper's tables and figures from the MLflow record, as ONE Markdown file.

    sage-report --experiment sage --out docs/results/testbed.md --figures-dir docs/results/figures
    sage-report --run-ids ID1,ID2 --seeds 1,2,3 --k 64 --out report.md
    sage-report --experiment sage --filter "tags.grid = '/path/of/the/sweep'" --out report.md
    sage-report --experiment sage --grid latest --out report.md   # one grid's runs (or --grid <its name>)

Writes the report, every table also as ``<tables-dir>/<name>.{md,tex,csv}``, and the figures as PNGs.
Only finished ``sage-train`` runs count; a row is one method at one config (see ``analysis.load``), its
cells mean ± std over the training seeds asked (``--seeds``, default: every seed present). Differences
between rows (each minus ``--reference`` and minus base) always carry their t interval over problems and
seeds (``analysis.bootstrap``: each side's own seed noise, Cochran-Cox critical value, coverage checked by
simulation at 2-8 seeds with unequal seed noise), from the correctness matrices each evaluation logged; each
table is a family under Holm's correction. ``--paired-seeds``: a method run on the reference's training seeds
gets the interval paired by seed instead (the seed noise of the per-seed differences: rows sharing seeds
share much of their seed noise); the others, and every difference against the start model, stay unpaired.
Which problems each compared pair moved (lost or gained at pass@k, ``--lost-threshold``) and where its
pass@k curves cross, per seed pair, are a section of their own with ``tables/moved.csv`` and one
``tables/problems_<dataset>.csv`` per dataset (``analysis.moved``).

This module is the command: its flags and their one-line refusals, the store or snapshot it reads, and
what it prints; the report itself is ``analysis.assemble.make_report``, the grid lookup
``analysis.grid_lookup``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis import load, moved, snapshot
from analysis.assemble import cwd_relative_path, make_report, portable_uri
from analysis.grid_lookup import find_grid, grid_line
from analysis.load import ReportError
from sage.tracking import PARENT_TAG, probe_limits, redact, resolve_uri, store_failure


def primary_comparison(text: str) -> tuple[str, str, int]:
    """``--primary 'METHOD|DATASET|K'`` as (method, dataset, k)."""
    parts = text.split("|")
    if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected METHOD|DATASET|K, e.g. 'grpo_branch|arith_tail|256'"
        )
    return parts[0], parts[1], int(parts[2])


class Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line, as sage-report's own are (its usage is what --help prints)."""

    def error(self, message: str):
        self.exit(2, f"sage-report: {message} (sage-report --help lists the flags)\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = Parser(prog="sage-report", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--experiment",
        default="sage",
        help="MLflow experiment name, or several separated by commas (default: sage)",
    )
    p.add_argument("--run-ids", default="", help="comma-separated run ids instead of a whole experiment")
    p.add_argument("--filter", default="", help="MLflow filter string, e.g. \"tags.grid = '/sweep/dir'\"")
    p.add_argument(
        "--grid",
        default=None,
        help="only the runs of one grid (sage-train -m): latest (the grid whose driver ran last, not an "
        "Optuna study; the line printed names it), or its parent run's name (what it compared, e.g. "
        "'experiment=grpo,grpo_branch x seed=1,2'), its sweep dir, study or run id",
    )
    p.add_argument(
        "--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI, else outputs/mlflow.db"
    )
    p.add_argument("--seeds", default="", help="training seeds asked, e.g. 1,2,3 (default: all present)")
    p.add_argument("--k", type=int, default=None, help="k of the pass@k columns (default: largest logged)")
    p.add_argument("--out", type=Path, default=Path("docs/results/report.md"), help="the Markdown report")
    p.add_argument("--figures-dir", type=Path, default=None, help="default: <out dir>/figures")
    p.add_argument("--tables-dir", type=Path, default=None, help="default: <out dir>/tables")
    p.add_argument(
        "--perplexity-max", type=int, default=2000, help="logged perplexities shown per run; 0: no section"
    )
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--extra-k", default="", help="also tabulate methods at these k, e.g. 8 (comma-separated)")
    p.add_argument(
        "--include", type=Path, action="append", default=[], help="Markdown file appended verbatim"
    )
    p.add_argument(
        "--reference",
        default=None,
        help="method the differences are taken against: a conf/experiment preset or a row name, refused "
        "when no trained row is that (default: grpo, when there is a GRPO row)",
    )
    p.add_argument(
        "--primary",
        type=primary_comparison,
        help="the one comparison declared before the run, 'METHOD|DATASET|K' (a preset or row name, minus "
        "--reference, at pass@K): reported first, with its own interval and p-value, outside the tables' "
        "families",
    )
    p.add_argument(
        "--paired-seeds",
        action="store_true",
        help="differences between trained rows run on the same training seeds get the interval paired by "
        "seed (analysis/bootstrap.py: rows sharing seeds share much of their seed noise); rows whose seeds "
        "differ, and differences against the start model, keep the unpaired one (the report says which)",
    )
    p.add_argument(
        "--lost-threshold",
        type=float,
        default=moved.LOST_THRESHOLD,
        help="a problem is lost by a method when its pass@k is below this times the other row's (and gained "
        "the other way round): the 'Which problems moved' section (default: 0.5)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=2000,
        help="bootstrap draws of the curves' bands; 0: no bands nor intervals",
    )
    p.add_argument("--bootstrap-seed", type=int, default=0, help="RNG seed of the bootstrap (reproducible)")
    p.add_argument(
        "--min-seeds", type=int, default=5, help="warn when a Table 1 method has fewer training seeds"
    )
    p.add_argument(
        "--log-to-mlflow",
        action="store_true",
        help="also log the report (markdown, figures, tables) as artifacts of a parent run for these "
        "experiment(s), filter and run ids: made on the first call, reused by the next ones",
    )
    p.add_argument(
        "--export",
        type=Path,
        metavar="FILE",
        help="write the store's runs of --experiment (what this report reads of them: tags, params, latest "
        "metrics, the curves' histories, correctness matrices packed to bits) to FILE (.json.gz) and nothing "
        "else, for --snapshot to rebuild the report without the store (analysis/snapshot.py)",
    )
    p.add_argument(
        "--snapshot",
        type=Path,
        metavar="FILE",
        help="read the runs from a file --export wrote instead of an MLflow store: the same tables",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only check that the store holds runs of the experiment(s) and filter; writes nothing "
        "(a grid whose report reuses another grid's runs checks for them before it trains)",
    )
    return p.parse_args(argv)


# integer flags and their smallest value, with what it means
AT_LEAST = {
    "k": (1, "pass@k needs k >= 1"),
    "bootstrap": (0, "the bootstrap draws are 0 (no intervals nor bands) or more"),
    "bootstrap_seed": (0, "an RNG seed is 0 or more"),
    "perplexity_max": (0, "the perplexities shown per run are 0 (no section) or more"),
    "digits": (0, "the digits shown are 0 or more"),
}


def checked_flags(args: argparse.Namespace) -> list[int]:
    """A ReportError naming the first flag whose value sage-report cannot use, before any store is opened
    or file written; else ``--extra-k`` as integers."""
    for name, (least, why) in AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ReportError(f"--{name.replace('_', '-')} {value}: {why}")
    parts = [x.strip() for x in args.extra_k.split(",") if x.strip()]
    if not all(x.isdigit() and int(x) >= 1 for x in parts):
        raise ReportError(
            f"--extra-k takes integers >= 1 separated by commas (e.g. 8,64), not {args.extra_k!r}"
        )
    return [int(x) for x in parts]


def readable_store(uri: str | None):
    """``load.open_existing_store`` and one query, under sage-train's probe limits: a corrupt SQLite file or
    a dead or hung server is one line, not MLflow's traceback from the first table read."""
    try:
        with probe_limits():
            client, resolved = load.open_existing_store(uri)
            client.search_experiments(max_results=1)
    except ReportError:
        raise
    except Exception as e:
        raise ReportError(
            f"the MLflow store {redact(resolve_uri(uri))} cannot be read: {store_failure(e)}"
        ) from e
    return client, resolved


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per download otherwise
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or None
    except ValueError:
        print(f"sage-report: --seeds takes integers separated by commas, not {args.seeds!r}", file=sys.stderr)
        return 2
    try:
        extra_ks = checked_flags(args)
    except ReportError as e:
        print(f"sage-report: {e}", file=sys.stderr)
        return 2
    missing = [str(f) for f in args.include if not Path(f).is_file()]
    if missing:
        print(f"sage-report: --include file(s) not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    clash = [
        flag
        for flag, given in (("--tracking-uri", args.tracking_uri), ("--export", args.export),
                            ("--log-to-mlflow", args.log_to_mlflow), ("--check", args.check))
        if given
    ]  # fmt: skip
    if args.snapshot and clash:
        print(f"sage-report: --snapshot reads a file, not a store: drop {', '.join(clash)}", file=sys.stderr)
        return 2
    try:
        if args.snapshot:
            client = snapshot.SnapshotClient(args.snapshot)
            uri = f"{cwd_relative_path(args.snapshot)} (snapshot of {client.source})"
        else:
            client, uri = readable_store(args.tracking_uri)
        if args.export:
            n = snapshot.export(client, portable_uri(uri), args.experiment, args.export)
            size = args.export.stat().st_size
            print(
                f"snapshot: {args.export} ({n['runs']} runs, {n['points']} curve points, {n['artifacts']} "
                f"artifacts, {size / 1e6:.2f} MB) of {args.experiment} in {portable_uri(uri)}"
            )
            return 0
        if args.check:
            n = len(load.fetch_runs(client, args.experiment, [], args.filter))
            if n == 0:
                raise ReportError(f"experiment(s) {args.experiment!r} hold no runs matching {args.filter!r}")
            matching = f" matching {args.filter!r}" if args.filter else ""
            print(f"ok: {n} runs in {args.experiment}{matching}")
            return 0
        filter_string = args.filter
        if args.grid:
            parent, when = find_grid(client, args.experiment, args.grid)
            children = f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
            filter_string = f"{children} and {args.filter}" if args.filter else children
            print(grid_line(parent, when))
        rep = make_report(
            client,
            uri,
            experiment=args.experiment,
            run_ids=[r for r in args.run_ids.split(",") if r.strip()],
            filter_string=filter_string,
            seeds=seeds,
            k=args.k,
            out=args.out,
            figures_dir=args.figures_dir or args.out.parent / "figures",
            tables_dir=args.tables_dir or args.out.parent / "tables",
            perplexity_cap=args.perplexity_max,
            digits=args.digits,
            extra_ks=extra_ks,
            includes=args.include,
            reference=args.reference,
            draws=args.bootstrap,
            rng_seed=args.bootstrap_seed,
            min_seeds=args.min_seeds,
            primary=args.primary,
            lost_threshold=args.lost_threshold,
            paired_seeds=args.paired_seeds,
        )
    except ReportError as e:
        print(f"sage-report: {e}", file=sys.stderr)
        return 2
    for n in rep.notes:
        print(f"note: {n}", file=sys.stderr)
    for w in rep.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"report: {args.out} ({len(rep.tables)} tables, {len(rep.figures)} figures)")
    if args.log_to_mlflow:
        from sage.parent_runs import log_report_files, report_parent

        key = f"experiment={args.experiment} filter={args.filter} run_ids={args.run_ids}"
        run_id = report_parent(client, args.experiment, key)
        figures = args.figures_dir or args.out.parent / "figures"
        log_report_files(client, run_id, args.out, figures, args.tables_dir or args.out.parent / "tables")
        client.set_terminated(run_id, status="FINISHED")
        print(f"logged into MLflow run {run_id} (artifacts under report/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
