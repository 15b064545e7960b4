"""Every command the README shows is run here, shrunk by overrides only, as one workflow on one MLflow
store: the quick run, its resume, the evaluations of its checkpoint, the report over what was logged.

A command runs for real unless it needs what this machine does not have; those are composed with
Hydra's ``--cfg job`` (every group, key and type checked, nothing run), and the reason is named in
``COMPOSE_ONLY``. A README command that no rule here covers fails the test, so a new one cannot go
untested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Overrides that shrink a sage-train run (a value the README command sets is replaced, not repeated).
SHRINK_TRAIN = {
    "trl.max_steps": "1",
    "trl.per_device_train_batch_size": "4",
    "trl.num_generations": "2",
    "trl.save_steps": "1",
    "eval.n_samples": "2",
    "eval.limit": "2",
    "eval.seeds": "[0]",
}
SHRINK_EVAL = {"eval.n_samples": "2", "eval.limit": "2", "eval.seeds": "[0]"}
# Commands that cannot run here, by what they need; they are composed instead.
COMPOSE_ONLY = {
    "model=qwen": "a hub model and a GPU",
    "model=r1-distill": "a hub model and a GPU",
    "rollout=vllm": "CUDA",
    "eval.backend=vllm": "CUDA",
}
# Commands run elsewhere, and why.
ELSEWHERE = {
    "make test": "it is this test suite (CI runs it: .ci/run)",
    "make reproduce-testbed": "the whole testbed study; its parts run in tests/test_report.py",
}


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks, continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def shrink(args: list[str], shrink_to: dict[str, str]) -> list[str]:
    keys = {a.split("=", 1)[0] for a in args if "=" in a}
    out = [
        f"{a.split('=', 1)[0]}={shrink_to[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in shrink_to else a
        for a in args
    ]
    return out + [f"{k}={v}" for k, v in shrink_to.items() if k not in keys]


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1200, env=env, cwd=cwd)
    assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_every_readme_command_runs(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    quick = tmp_path / "quick"
    ran = []
    for command in readme_commands():
        command = command.replace("/tmp/quick", str(quick)).replace(
            "outputs/<run>/final", str(quick / "final")
        )
        if any(command.startswith(c) for c in ELSEWHERE):
            continue
        args = shlex.split(command)
        tool, rest = args[0], args[1:]
        if tool == "make" and rest[:1] == ["run"]:
            run(
                [
                    "make",
                    "run",
                    "ARGS=" + shlex.join(shrink([f"output_dir={tmp_path / 'make_run'}"], SHRINK_TRAIN)),
                ],
                env,
                REPO,
            )
        elif tool in ("sage-train", "sage-eval") and any(k in command for k in COMPOSE_ONLY):
            r = run([str(BIN / tool), *rest, "--cfg", "job"], env, tmp_path)
            assert "model:" in r.stdout
        elif tool == "sage-train" and "-m" not in rest:
            if not any(a.startswith("output_dir=") for a in rest):
                rest.append(f"output_dir={tmp_path / f'run{len(ran)}'}")
            run([str(BIN / tool), *shrink(rest, SHRINK_TRAIN)], env, tmp_path)
        elif tool == "sage-eval":
            run([str(BIN / tool), *shrink(rest, SHRINK_EVAL)], env, tmp_path)
        elif tool == "sage-report":
            rest = [a.replace("docs/results/", f"{tmp_path}/report/") for a in rest]
            run(
                [str(BIN / tool), *rest, "--experiment", "sage"]
                if "--experiment" not in rest
                else [str(BIN / tool), *rest],
                env,
                tmp_path,
            )
        else:
            pytest.fail(f"README command not covered by tests/test_readme.py: {command}")
        ran.append(command)
    assert ran
