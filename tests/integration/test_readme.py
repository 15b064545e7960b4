"""Every command the README shows is run here, shrunk by overrides only, as one workflow on one MLflow
store: the quick run, its resume, the evaluations of its checkpoint, the sweeps (on the real SLURM cluster
where the README says slurm, against a real PostgreSQL where it names one), the report over what was logged.

A command runs for real unless it needs what this machine does not have; those are composed with Hydra's
``--cfg job`` (every group, key and type checked, nothing run), and the reason is named in
``COMPOSE_ONLY``. Sweeps are shrunk by overriding their grid or trial count, never by editing the command.
A README command that no rule here covers fails the test, so a new one cannot go untested.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
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
# Keys shrunk only where the README command sets them: a continued run goes one step further, the
# periodic evaluation comes every step.
SHRINK_IF_SET = {
    "resume": {"trl.max_steps": "2"},
    "eval.every_steps": {"eval.every_steps": "1"},
    "model": {"model.sft.data.n": "64", "model.sft.args.num_train_epochs": "1"},  # a model with an SFT stage
}
# A paper grid keeps one of its rows; an Optuna study runs one trial, with an objective the shrunk
# evaluation logs (its default pass@64 needs 64 samples).
SHRINK_GRID = {"hydra.sweeper.params.experiment": "grpo"}
SHRINK_STUDY = {
    "hydra.sweeper.n_trials": "1",
    "hydra.sweeper.n_jobs": "1",
    "hydra.sweeper.objectives": "[pass_at_1/trained/arith_heldout]",
    "hydra.sweeper.directions": "[maximize]",
}
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
    "make reproduce-table": "one table of it: tests/integration/test_reproduce.py runs make reproduce-table6",
    "make reproduce-fork": "the fork world's study: test_reproduce checks its command (make -n); its "
    "methods, controls, tier figures and primary comparison run in tests/test_fork_world.py, "
    "test_trainer_equivalence.py and test_report.py",
    "mlflow ui": "MLflow's UI: tests/integration/test_mlflow_ui.py renders a store served by mlflow server",
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
    """``args`` with the keys of ``shrink_to`` replaced or added."""
    keys = {a.split("=", 1)[0] for a in args if "=" in a}
    out = [
        f"{a.split('=', 1)[0]}={shrink_to[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in shrink_to else a
        for a in args
    ]
    return out + [f"{k}={v}" for k, v in shrink_to.items() if k not in keys]


def one_point(args: list[str]) -> list[str]:
    """A sweep's command-line lists (``seed=1,2,3``) cut to their first value."""
    return [
        f"{a.split('=', 1)[0]}={a.split('=', 1)[1].split(',')[0]}"
        if "=" in a and "," in a and not re.search(r"[\[(]", a)
        else a
        for a in args
    ]


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=env, cwd=cwd)
    assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_every_readme_command_runs(tmp_path, slurm_cluster, postgres_url):
    env = {
        **slurm_cluster,
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    quick = tmp_path / "quick"
    ran = []
    for command in readme_commands():
        command = command.replace("/tmp/quick", str(quick)).replace(
            "outputs/<run>/final", str(quick / "final")
        )
        command = re.sub(r"postgresql\+psycopg://\S+", postgres_url, command)
        if any(command.startswith(c) for c in ELSEWHERE):
            continue
        args = shlex.split(command)
        tool, rest = args[0], args[1:]
        if tool == "make" and rest[:1] == ["run"]:
            overrides = shrink([f"output_dir={tmp_path / 'make_run'}"], SHRINK_TRAIN)
            run(["make", "run", "ARGS=" + shlex.join(overrides)], env, REPO)
        elif tool in ("sage-train", "sage-eval", "torchrun") and any(k in command for k in COMPOSE_ONLY):
            if tool == "torchrun":  # the command after the launcher's own flags, in one process
                tool, rest = (
                    "sage-train",
                    [a for a in rest if not a.startswith("--") and a not in ("-m",)][1:],
                )
            if "-m" in rest:  # a sweep: one of its jobs, launcher settings included
                rest = one_point([a for a in rest if a != "-m"])
                r = run([str(BIN / tool), *rest, "--cfg", "all"], env, tmp_path)
                assert "launcher:" in r.stdout
            else:
                r = run([str(BIN / tool), *rest, "--cfg", "job"], env, tmp_path)
            assert "model:" in r.stdout
        elif tool == "torchrun":
            launcher = [a for a in rest if a.startswith("--")]
            module_at = rest.index("-m")
            overrides = shrink(rest[module_at + 2 :], SHRINK_TRAIN)
            r = run(
                [str(BIN / tool), "--standalone", *launcher, "-m", rest[module_at + 1], *overrides],
                env,
                tmp_path,
            )
            assert " x 2 processes = " in r.stdout, r.stdout[-2000:]
        elif tool == "python" and rest[:2] == ["-m", "sage.train.memory"]:
            r = run([sys.executable, *rest], env, tmp_path)
            assert ", fits (" in r.stdout
        elif tool == "sage-train" and "-m" in rest:
            sweep = tmp_path / f"sweep{len(ran)}"
            shrink_to = {**SHRINK_TRAIN, "hydra.sweep.dir": str(sweep)}
            if "hparams_search=table" in command:
                shrink_to |= SHRINK_GRID
            if "hparams_search=branch_threshold_ratio" in command:
                shrink_to |= SHRINK_STUDY
            args = shrink(one_point(rest), shrink_to)
            run([str(BIN / tool), *args], env, tmp_path)
            # a grid job's folder is <sweep>/<its overrides>, a study's trial's <sweep>/<study>/<number>
            finished = list(sweep.glob("*/metrics.json")) + list(sweep.glob("*/*/metrics.json"))
            assert finished, f"{command}: no job of the sweep finished"
        elif tool == "sage-train":
            if not any(a.startswith("output_dir=") for a in rest):
                rest.append(f"output_dir={tmp_path / f'run{len(ran)}'}")
            shrink_to = dict(SHRINK_TRAIN)
            for key, extra in SHRINK_IF_SET.items():
                if any(a.startswith(key + "=") for a in rest):
                    shrink_to |= extra
            run([str(BIN / tool), *shrink(rest, shrink_to)], env, tmp_path)
        elif tool == "sage-eval":
            run([str(BIN / tool), *shrink(rest, SHRINK_EVAL)], env, tmp_path)
        elif tool == "sage-report":
            rest = [a.replace("docs/results/", f"{tmp_path}/report/") for a in rest]
            run([str(BIN / tool), *rest], env, tmp_path)
            assert (tmp_path / "report").is_dir()
        else:
            pytest.fail(f"README command not covered by tests/integration/test_readme.py: {command}")
        ran.append(command)
    assert len(ran) >= 15, ran
