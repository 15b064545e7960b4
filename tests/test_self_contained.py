"""A clone is self-sufficient: a copy of the repository alone, with no folder beside it, composes a paper
model's config and loads its evaluation rows, and no file of the repository points outside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run inside the copy: every import, the config tree and the benchmark files must come from it.
COMPOSE_AND_LOAD = """
import json
from pathlib import Path
from hydra import compose, initialize_config_dir
import sage
from sage.config import register_configs
from sage.eval.evaluate import load_eval_rows
from sage.paths import CONF_DIR

register_configs()
with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    cfg = compose("train", overrides=["model=qwen2.5-math-7b"])
rows = load_eval_rows(cfg.eval.datasets, cfg.eval.limit)
print(json.dumps({
    "sage": str(Path(sage.__file__).resolve()),
    "conf": str(Path(CONF_DIR).resolve()),
    "rows": {name: len(r) for name, r in rows.items()},
}))
"""


def tracked_files() -> list[str]:
    """What a clone holds: the committed files plus the ones not yet committed but not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [f for f in listed.split("\0") if f and (REPO / f).is_file()]


def test_a_copy_of_the_repository_alone_composes_a_paper_model_and_loads_its_benchmarks(tmp_path):
    copy = tmp_path / "clone"
    for name in tracked_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clone"]  # no sibling folder to lean on
    env = {k: v for k, v in os.environ.items() if k != "SAGE_MATH_DATA"}
    env.update(PYTHONPATH=str(copy), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    script = [sys.executable, "-c", COMPOSE_AND_LOAD]
    done = subprocess.run(script, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["sage"]).is_relative_to(copy) and Path(out["conf"]) == copy / "conf"
    # model=qwen2.5-math-7b evaluates on the paper's suite (AIME 24+25, AMC23, MATH-500 level 5, Minerva)
    assert out["rows"] == {"aime": 60, "amc23": 40, "math500_l5": 134, "minerva": 272}


def test_no_file_of_the_repository_points_outside_it():
    outside = ("../" + "shared", "shared/" + "docs", "shared/" + "data")  # spelt apart: this file is tracked
    found = [
        f"{name}: {needle}"
        for name in tracked_files()
        for needle in outside
        if needle in (REPO / name).read_text(encoding="utf-8", errors="ignore")
    ]
    assert not found, found
