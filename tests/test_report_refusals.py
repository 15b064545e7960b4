"""sage-report refuses in one line, before it writes anything (issue 56): a flag it cannot use, a logged
pass@k that its run's correctness matrices contradict (in a store and in a snapshot), a damaged snapshot;
and "Which problems moved" between rows that evaluated different problems compares the ones both did."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np
import prefork
import pytest

from sage.metrics import metric_name, pass_at_k_curve

REPO = Path(__file__).resolve().parents[1]
FORK_SNAPSHOT = REPO / "docs" / "results" / "data" / "fork_study.json.gz"
SCRIPT = Path(sys.executable).parent / "sage-report"
DS = "arith_heldout"
BASE = [2, 2, 1, 1, 0, 0]  # correct samples of 4, per problem
COUNTS = {
    "grpo": {0: [4, 4, 2, 0, 1, 0], 1: [4, 3, 2, 0, 1, 1]},
    "grpo_branch": {0: [4, 0, 2, 3, 1, 0], 1: [0, 0, 2, 3, 1, 1]},
}
IDS = [f"p{i}" for i in range(8)]


def matrix(counts, n=4) -> np.ndarray:
    return np.array([[j < c for j in range(n)] for c in counts])


def constructed_store(root: Path, ids: dict[str, list[str]] | None = None) -> tuple[str, dict]:
    """Two methods x two seeds of finished sage-train runs as sage logs them (tags, pass@1 / pass@4 of the
    start model and the trained one, their correctness matrices and problem ids), without the training.
    ``ids``: the problems each method evaluated (default: the first six for both); a method with more
    problems than its counts repeats them. Returns the store's URI and the run ids by (method, seed)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("r")
    runs = {}
    for method, by_seed in COUNTS.items():
        problems = (ids or {}).get(method, IDS[:6])
        for seed, counts in by_seed.items():
            tags = {"sage.kind": "train", "seed": str(seed), "method": method, "base_model": "tiny"}
            run_id = client.create_run(exp, tags=tags).info.run_id
            runs[(method, seed)] = run_id
            client.log_param(run_id, "seed", str(seed))
            for label, c in (("base", BASE), ("trained", counts)):
                c = (c * 2)[: len(problems)]
                if label == "base":  # one start model: each problem's base count follows the problem
                    c = [BASE[IDS.index(p) % 6] for p in problems]
                correct = matrix(c)
                for k, v in pass_at_k_curve(correct, [1, 4]).items():
                    client.log_metric(run_id, metric_name(label, DS, f"pass@{k}"), v)
                folder = root / run_id
                folder.mkdir(parents=True, exist_ok=True)
                np.savez_compressed(folder / f"{label}_{DS}_correct.npz", correct)
                (folder / f"{label}_{DS}_problems.json").write_text(json.dumps(problems))
                for name in (f"{label}_{DS}_correct.npz", f"{label}_{DS}_problems.json"):
                    client.log_artifact(run_id, str(folder / name), artifact_path=f"eval/{label}")
            client.set_terminated(run_id)
    return uri, runs


def sage_report(*args: str, out: Path):
    """The console script as a user runs it: (exit code, its non-empty output lines)."""
    r = prefork.run(
        [str(SCRIPT), "--experiment", "r", "--out", str(out), "--perplexity-max", "0", *args],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return r.returncode, [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]


def refused(code: int, lines: list[str], out: Path) -> str:
    """The one line of a refusal, after checking that it is one and that nothing was written."""
    assert code == 2 and len(lines) == 1, "\n".join(lines[-30:])
    assert not out.parent.exists(), sorted(out.parent.rglob("*"))  # no report, no tables, no figures
    assert lines[0].startswith("sage-report: ") and "Traceback" not in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    uri, runs = constructed_store(root)
    return {"root": root, "uri": uri, "runs": runs}


@pytest.mark.slow
def test_every_flag_sage_report_cannot_use_is_one_line_before_anything_is_written(store):
    """Before: --reference nosuch exited 0 with a note and no differences; --bootstrap -5 exited 0 with no
    interval; --k 0 / -1 were 27 lines of traceback after the report folder was made; --extra-k abc 11."""
    out = store["root"] / "flags" / "r.md"
    store_args = ("--tracking-uri", store["uri"])
    expected = {
        (
            "--reference",
            "nosuch",
        ): "sage-report: --reference nosuch: no trained row of that name (rows: GRPO, "
        "GRPO + Branch; --reference picks one)",
        (
            "--bootstrap",
            "-5",
        ): "sage-report: --bootstrap -5: the bootstrap draws are 0 (no intervals nor bands) or more",
        ("--k", "0"): "sage-report: --k 0: pass@k needs k >= 1",
        ("--k", "-1"): "sage-report: --k -1: pass@k needs k >= 1",
        (
            "--extra-k",
            "abc",
        ): "sage-report: --extra-k takes integers >= 1 separated by commas (e.g. 8,64), not 'abc'",
        (
            "--extra-k",
            "2,0",
        ): "sage-report: --extra-k takes integers >= 1 separated by commas (e.g. 8,64), not '2,0'",
        (
            "--extra-k",
            "64",
        ): "sage-report: --extra-k 64 is above n, the samples per problem, of every evaluation "
        "here (at most 4): pass@k needs k <= n; choose --extra-k 4 or less",
        (
            "--k",
            "abc",
        ): "sage-report: argument --k: invalid int value: 'abc' (sage-report --help lists the flags)",
        ("--digits", "-1"): "sage-report: --digits -1: the digits shown are 0 or more",
    }
    for flag, line in expected.items():
        assert refused(*sage_report(*store_args, *flag, out=out), out) == line, flag
    # a reference named by its row, and none named with no GRPO row: the report is made
    code, lines = sage_report(*store_args, "--reference", "GRPO + Branch", "--bootstrap", "50", out=out)
    assert code == 0, "\n".join(lines)
    assert "## Differences against GRPO + Branch" in out.read_text()
    code, lines = sage_report(
        *store_args, "--filter", "tags.method = 'grpo_branch'", "--bootstrap", "50", out=out
    )
    assert code == 0 and "note: no differences against 'GRPO': no trained row of that name" in "\n".join(
        lines
    )


def table_cell(md: str, heading: str, row: str, column: int) -> str:
    section = md.split(f"## {heading}")[1].split("\n## ")[0]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {row} |"))
    return line.split(" | ")[column].strip(" |")


@pytest.mark.slow
def test_the_tables_pass_at_k_agrees_with_the_differences_or_the_report_refuses(tmp_path):
    """Before: a logged pass@k set to 0.999 was the table's cell while the differences, from the matrices,
    stayed where they were (both numbers side by side, exit 0). Now the report checks every logged pass@k it
    tabulates against the run's matrices: untouched, the table's means differ by what the differences say;
    tampered, in the store or in its snapshot, the report is one line naming the run and the metric."""
    uri, runs = constructed_store(tmp_path)  # its own: it is tampered with below
    out = tmp_path / "ok" / "r.md"
    code, lines = sage_report("--tracking-uri", uri, "--bootstrap", "50", out=out)
    assert code == 0, "\n".join(lines)
    md = out.read_text()
    branch, grpo = (
        float(table_cell(md, "Methods", row, 1).split(" ")[0]) for row in ("GRPO + Branch", "GRPO")
    )
    # pass@1 from the counts: GRPO (11/24 + 11/24) / 2, Branch (10/24 + 7/24) / 2
    assert (grpo, branch) == (0.458, 0.354)
    diff = table_cell(md, "Differences against GRPO", "GRPO + Branch", 1)
    assert diff.startswith(f"{(10 + 7 - 22) / 48:+.3f} [")  # = Branch - GRPO of the table's own means

    snap = tmp_path / "r.json.gz"
    r = prefork.run(
        [str(SCRIPT), "--tracking-uri", uri, "--experiment", "r", "--export", str(snap)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(gzip.decompress(snap.read_bytes()))
    run_id = runs[("grpo_branch", 1)]
    key = metric_name("trained", DS, "pass@1")
    record = next(rec for rec in doc["runs"] if rec["info"]["run_id"] == run_id)
    record["metrics"][key] = 0.999
    tampered = tmp_path / "tampered.json.gz"
    tampered.write_bytes(gzip.compress(json.dumps(doc).encode()))
    out = tmp_path / "snap" / "r.md"
    line = refused(*sage_report("--snapshot", str(tampered), out=out), out)
    assert line.startswith(
        f"sage-report: run {run_id} (GRPO + Branch, seed 1): its logged {key} is 0.999, its correctness "
        f"matrices (trained_{DS}_correct.npz) give 0.291667: the tables' pass@k and the differences would "
        "disagree"
    ), line

    from mlflow.tracking import MlflowClient

    MlflowClient(uri).log_metric(run_id, key, 0.999, step=1)  # a later point: the latest value
    out = tmp_path / "store" / "r.md"
    line = refused(*sage_report("--tracking-uri", uri, "--bootstrap", "0", out=out), out)
    assert line.startswith(f"sage-report: run {run_id} (GRPO + Branch, seed 1): its logged {key} is 0.999"), (
        line
    )


def test_a_damaged_snapshot_is_one_line_naming_the_file_and_what_is_wrong(tmp_path):
    """Before: the committed snapshot cut at 100 kB was 22 lines of EOFError, a run without info.status 11
    lines of KeyError, a missing artifact blob 14."""
    whole = FORK_SNAPSHOT.read_bytes()
    doc = json.loads(gzip.decompress(whole))
    first = doc["runs"][0]
    del first["info"]["status"]
    no_status = gzip.compress(json.dumps(doc).encode())
    first["info"]["status"] = "FINISHED"
    name, digest = next(iter(first["artifacts"].items()))
    del doc["artifacts"][digest]
    no_blob = gzip.compress(json.dumps(doc).encode())
    damaged = {
        "cut": (whole[:100_000], "cut short or corrupt (Compressed file ended before the end-of-stream "
                "marker was reached): export it again"),
        "text": (gzip.compress(b"not json"), "not a file sage-report --export wrote (Expecting value: line 1 "
                 "column 1 (char 0))"),
        "status": (no_status, f"run {first['info']['run_id']} has no info.status: not a whole file --export "
                   "wrote, export it again"),
        "blob": (no_blob, f"run {first['info']['run_id']}'s artifact {name} is blob {digest}, which the file "
                 "does not hold: not a whole file --export wrote, export it again"),
    }  # fmt: skip
    for case, (data, why) in damaged.items():
        snap = tmp_path / f"{case}.json.gz"
        snap.write_bytes(data)
        out = tmp_path / case / "r.md"
        code, lines = sage_report("--snapshot", str(snap), "--experiment", "testbed-fork", out=out)
        assert refused(code, lines, out) == f"sage-report: --snapshot {snap}: {why}", case


@pytest.mark.slow
def test_rows_that_evaluated_different_problems_are_compared_on_the_problems_both_evaluated(tmp_path):
    """Before: GRPO + Branch on 8 problems against GRPO on 6 of them was "not paired by problem: 8 vs 6"
    (nothing compared), and on 6 other problems (4 shared) it was compared position by position, problem p0
    against p2, without a word. Now the problems both evaluated (by their logged ids) are compared, in one
    note per pair."""
    note = "note: GRPO + Branch vs GRPO on arith_heldout: the rows evaluated different problems ({}): only "
    for case, ids, common in (("more", IDS[:8], 6), ("shifted", IDS[2:8], 4)):
        uri, _ = constructed_store(tmp_path / case, {"grpo_branch": ids})
        out = tmp_path / case / "report" / "r.md"
        code, lines = sage_report("--tracking-uri", uri, "--bootstrap", "50", out=out)
        assert code == 0, "\n".join(lines)
        said = f"{len(ids)} and 6, {common} in common"
        assert f"{note.format(said)}the {common} both evaluated are compared" in lines, case
        md = out.read_text()
        moved = table_cell(md, "Which problems moved", "GRPO + Branch vs GRPO", 3)
        assert moved == str(common), case
        diff = table_cell(md, "Differences against GRPO", "GRPO + Branch", 1)
        if case == "more":  # its first six problems are GRPO's with the same counts: the six-problem report's
            assert diff.startswith(f"{(10 + 7 - 22) / 48:+.3f} [") and md.count(
                "lost 1 (`p1`), gained 1 (`p3`)"
            )
        else:  # p2..p5: GRPO (2+0+1+0, 2+0+1+1) of 16 each, Branch its first four counts (4+0+2+3, 0+0+2+3)
            assert diff.startswith(f"{((9 + 5) - (3 + 4)) / 32:+.3f} ["), diff
