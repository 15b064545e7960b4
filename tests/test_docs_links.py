"""The docs point at what exists: every relative link of README.md and docs/ (markdown links and images)
and every repository path they name in backticks (``sage/...``, ``docs/...``, ``tests/...`` and the other
top folders) resolves to a file or folder of the repository; and no code or guide cites the spec by its
section numbers (``SAGE.md section N``): that file is not in the repository, docs/method.md describes the
method."""

from __future__ import annotations

import re
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
    for path in files:
        if re.search(r"SAGE\.md section", path.read_text(encoding="utf-8")):
            cited.append(str(path.relative_to(REPO)))
    assert not cited, cited
