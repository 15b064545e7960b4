"""Issue 47: the Optuna sweeper's refusals, and an override Hydra cannot parse, are one line on the command
line (they were 31- to 42-line tracebacks: the sweeper refuses while Hydra's full-error mode, which sage sets
for composition, is still on)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import optuna
import prefork

from sweeps.optuna import SageOptunaSweeper


def optuna_study(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    """``sage-train -m`` with the Optuna sweeper over one Branch ratio: (exit code, non-blank lines)."""
    r = prefork.run(
        [
            sys.executable,
            "-m",
            "sage.train",
            "-m",
            "hydra/sweeper=optuna",
            "hydra.sweeper.directions=[maximize]",
            "hydra.sweeper.study_name=s",
            f"hydra.sweeper.storage=sqlite:///{tmp_path / 'study.db'}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "guide=branch",
            "guide.ratio=choice(0.3)",
            "tracking.enabled=false",
            *args,
        ],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return r.returncode, [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]


def test_an_objective_no_trial_writes_is_one_line(tmp_path):
    code, lines = optuna_study(tmp_path, "hydra.sweeper.objectives=[pass_at_999/trained/arith_heldout]")
    assert code == 2 and len(lines) <= 3, "\n".join(lines[-40:])
    assert lines[-1].startswith(
        "error: hydra.sweeper.objectives: pass_at_999/trained/arith_heldout is not a metric a trial writes "
        "({'guide.ratio': 0.3}); its metrics.json holds pass_at_1/base/arith_heldout, "
    )
    assert not (tmp_path / "sweep" / "s").exists()  # no trial ran


def test_a_study_resumed_with_another_learning_rate_is_one_line(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = SageOptunaSweeper(
        study_name="s", storage=storage, n_trials=1, n_jobs=1, objectives=["pass_at_1/trained/arith_heldout"],
        weights=None, directions=["maximize"], params={}, choices_as="points", max_retries=0, max_failures=1,
        sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner(),
    )  # fmt: skip
    # the study as a first driver over the same space left it, at trl.learning_rate=1e-4
    first.create_study(
        *first.search_space(["guide=branch", "guide.ratio=choice(0.3)", "trl.learning_rate=1e-4"])
    )
    code, lines = optuna_study(
        tmp_path, "hydra.sweeper.objectives=[pass_at_1/trained/arith_heldout]", "trl.learning_rate=3e-4"
    )
    assert code == 2 and len(lines) <= 3, "\n".join(lines[-40:])
    assert lines[-1] == (
        f"error: study 's' in {storage} is another experiment: trl.learning_rate=0.0003 (the study's: "
        "0.0001); resume it with its own space and overrides, or start a new study with another "
        "hydra.sweeper.study_name"
    )
    assert not (tmp_path / "sweep" / "s").exists()


def test_an_override_hydra_cannot_parse_is_one_line(tmp_path):
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "model.source.repo_id=a=b", f"output_dir={tmp_path / 'a'}"],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) <= 3, "\n".join(lines[-40:])
    assert lines[-1] == (
        "error: model.source.repo_id=a=b: mismatched input '=' expecting <EOF> "
        "(a value holding = is quoted: model.source.repo_id='a=b')"
    )
