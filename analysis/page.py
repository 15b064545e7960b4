"""The report's body as its sections build it: each table written as ``<tables-dir>/<name>.{md,tex,csv}`` and
placed under its heading with its caption and its own notes, each figure linked with its caption, and the
notes the sections leave for the end."""

from __future__ import annotations

import os
from pathlib import Path

from analysis import tables
from analysis.tables import Table


def write_table(t: Table, tables_dir: Path, digits: int) -> None:
    tables_dir.mkdir(parents=True, exist_ok=True)
    (tables_dir / f"{t.name}.md").write_text(tables.to_markdown(t, digits) + "\n")
    (tables_dir / f"{t.name}.tex").write_text(tables.to_latex(t, digits) + "\n")
    (tables_dir / f"{t.name}.csv").write_text(tables.to_csv(t))


class Page:
    """The sections in the order they were added (``sections``: Markdown), with the tables and figures they
    hold by name, and the report's notes (``notes``, which the sections extend)."""

    def __init__(self, out: Path, figures_dir: Path, tables_dir: Path, digits: int, notes: list[str]):
        self.out, self.figures_dir, self.tables_dir, self.digits = out, figures_dir, tables_dir, digits
        self.notes = notes
        self.tables: dict[str, Table] = {}
        self.figures: dict[str, Path] = {}
        self.sections: list[str] = []

    def table(self, t: Table, heading: str | None, text: str = "") -> None:
        """Writes ``t`` and places it: under ``## heading`` (None: under the table before it), its title and
        ``text`` as caption, its own notes (its family, its power) below it."""
        self.tables[t.name] = t
        write_table(t, self.tables_dir, self.digits)
        caption = t.title + "." + (" " + text if text else "")
        below = "".join(f"\n- {n}" for n in t.notes)
        below = "\n" + below + "\n" if below else ""
        head = f"## {heading}\n\n" if heading else ""
        self.sections.append(f"{head}{caption}\n\n{tables.to_markdown(t, self.digits)}\n{below}")

    def figure(self, name: str, path: Path, caption: str) -> None:
        """Links the figure at ``path`` (relative to the report), known as ``name``."""
        self.figures[name] = path
        self.sections.append(f"![{caption}]({os.path.relpath(path, self.out.parent)})\n")
