"""The docs point at what exists: every relative link of README.md and docs/ (markdown links and images)
and every repository path they name in backticks (``sage/...``, ``docs/...``, ``tests/...`` and the other
top folders) resolves to a file or folder of the repository, as does every repository path or page a
config comment (conf/) names; no code, guide or config cites the spec by its section numbers, and no file
but the archived records names the spec's file: no clone has it, docs/method.md describes the method."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = (
    "sage/",
    "docs/",
    "conf/",
    "tests/",
    "scripts/",
    "analysis/",
    "launchers/",
    "sweeps/",
    "hydra_plugins/",
)
# the studies' pages as their runs wrote them (their report's words included) are records, not guides
RECORDS = REPO / "docs" / "results"
# the superseded studies' pages, kept as they were written when the spec's file was beside the repository
ARCHIVE = "docs/results/archive/"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z][a-z0-9+.-]*:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_repository_path_named_in_backticks_exists():
    missing = []
    for page in pages():
        for name in re.findall(r"`([A-Za-z0-9_./-]+(?:::[A-Za-z0-9_]+)?)`", page.read_text(encoding="utf-8")):
            path = name.split("::")[0]
            if path.startswith(TOPS) and not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_no_guide_or_code_cites_the_spec_by_section():
    cited = []
    files = [p for p in pages() if RECORDS not in p.parents]
    files += [
        p for d in ("sage", "analysis", "launchers", "sweeps", "scripts") for p in (REPO / d).rglob("*.py")
    ]
    files += sorted((REPO / "conf").rglob("*.yaml"))
    for path in files:
        if re.search(r"SAGE\.md section", path.read_text(encoding="utf-8")):
            cited.append(str(path.relative_to(REPO)))
    assert not cited, cited


def conf_comments() -> list[tuple[Path, str]]:
    """(file, text) of every comment of the config tree: what follows a ``#`` that opens a line or a space."""
    return [
        (path, comment)
        for path in sorted((REPO / "conf").rglob("*.yaml"))
        for line in path.read_text(encoding="utf-8").splitlines()
        for comment in re.findall(r"(?:^|\s)#(.*)", line)[:1]
    ]


def test_every_repository_path_or_page_a_config_comment_names_exists():
    # a pattern (conf/regime_divergence/anchored_*.yaml) names the files it matches: one at least
    missing = []
    for path, comment in conf_comments():
        for name in re.findall(r"[A-Za-z0-9_./*-]+", comment):
            name = name.rstrip("./")
            if (name.startswith(TOPS) or name.endswith(".md")) and not any(REPO.glob(name)):
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_no_file_but_the_archived_records_names_the_spec():
    spec = "SAGE" + ".md"  # spelt apart: this file is tracked
    git = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]  # what a clone holds
    listed = subprocess.check_output(git, cwd=REPO, text=True).split("\0")
    naming = [
        name
        for name in listed
        if name and not name.startswith(ARCHIVE) and (REPO / name).is_file()
        if spec in (REPO / name).read_text(encoding="utf-8", errors="ignore")
    ]
    assert not naming, naming
