"""Every command the README shows is run here, shrunk by overrides only, as one workflow on one MLflow
store: the quick run, its resume, the evaluations of its checkpoint, the local sweeps, the report over what
was logged. The commands that need the services (the SLURM sweeps on the real cluster, the study against a
real PostgreSQL) run as a second workflow on a store of their own, on the worker that holds the services;
the rest need none, so the other worker can take them, in README order.

A command runs for real unless it needs what this machine does not have; those are composed with Hydra's
``--cfg job`` (every group, key and type checked, nothing run), and the reason is named in
``COMPOSE_ONLY``. Sweeps are shrunk by overriding their grid or trial count, never by editing the command.
A README command that no rule here covers fails a test, so a new one cannot go untested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import prefork
import pytest

pytestmark = pytest.mark.slow

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
}
# Commands run elsewhere, and why.
ELSEWHERE = {
    "make test": "it is this test suite (CI runs it: .ci/run)",
    "make reproduce-testbed": "the fair test of SAGE: test_reproduce checks its commands (make -n)",
    "make reproduce-graded": "the graded world's study: its tables are its parts, below",
    "make reproduce-table": "one table of it: tests/integration/test_reproduce.py runs make reproduce-table6",
    "make reproduce-fork": "the fork world's study: test_reproduce checks its command (make -n); its "
    "methods, controls, tier figures and primary comparison run in tests/test_fork_world.py, "
    "test_trainer_equivalence.py and test_report.py",
    "make first-hour": "tests/test_first_hour.py runs its command (python -m launchers.first_hour) here",
    "mlflow ui": "MLflow's UI: tests/integration/test_mlflow_ui.py renders a store served by mlflow server",
}


ACTIVATE = "source .venv/bin/activate"


def block_commands(block: str) -> list[str]:
    """A bash block's commands, continuation lines joined, comments dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            commands.append(" ".join(line.split()))
    return commands


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks, but for the blocks that start by activating `.venv`: those
    run as written, in a fresh shell (``test_an_activated_block_runs_in_a_fresh_shell``)."""
    return [c for b in readme_blocks() if ACTIVATE not in block_commands(b) for c in block_commands(b)]


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
    # the console scripts fork from the tests' pre-imported interpreter (tests/prefork.py: the same script
    # file, argv, environment and folder); `make run` and torchrun start fresh ones, as a user's shell does
    r = prefork.run(argv, timeout=1500, env=env, cwd=cwd)
    assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def rule(command: str) -> str:
    """How the test covers a README command: ``elsewhere``, ``compose``, ``services`` (run, on the SLURM
    cluster or against PostgreSQL) or ``run``; a command no rule covers is an error."""
    args = shlex.split(command)
    tool, rest = args[0], args[1:]
    if any(command.startswith(c) for c in ELSEWHERE):
        return "elsewhere"
    if tool in ("sage-train", "sage-eval", "torchrun") and any(k in command for k in COMPOSE_ONLY):
        return "compose"
    if tool == "python" and rest[:2] == ["-m", "sage.train.plan"]:
        return "run"  # a plan, for a SLURM grid too: nothing is submitted
    if "hydra/launcher=slurm" in command or "postgresql" in command:
        return "services"
    known = (tool == "make" and rest[:1] == ["run"]) or tool in (
        "torchrun",
        "sage-train",
        "sage-eval",
        "sage-report",
    )
    if not known:
        raise ValueError(f"README command not covered by tests/integration/test_readme.py: {command}")
    return "run"


def covered() -> list:
    """The README commands this file runs (or composes), in README order, each a test; those that need the
    services carry the integration mark, which puts them on the services' worker."""
    params = []
    for i, command in enumerate(readme_commands()):
        how = rule(command)
        if how == "elsewhere":
            continue
        marks = [pytest.mark.integration] if how == "services" else []
        if how == "run" and "rollout=vllm" in command:  # one vLLM engine at a time (tests/conftest.py)
            marks.append(pytest.mark.vllm)
        params.append(pytest.param(i, command, marks=marks, id=f"{i:02d}-{shlex.split(command)[0]}"))
    return params


def test_every_readme_command_has_a_rule_and_most_run():
    rules = [rule(c) for c in readme_commands()]  # raises on a command no rule covers
    assert rules.count("run") + rules.count("services") >= 15, rules


@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> Path:
    """The folder (and MLflow store) the commands of one worker share, in README order."""
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("i,command", covered())
def test_readme_command_runs(i, command, workflow, request):
    root, how = workflow, rule(command)
    # The services are asked for here only: a session fixture asked for on the other worker would start a
    # second SLURM cluster there.
    base = request.getfixturevalue("slurm_cluster") if how == "services" else os.environ
    env = {**base, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    if "postgresql" in command:  # a services command (rule)
        command = re.sub(r"postgresql\+psycopg://\S+", request.getfixturevalue("postgres_url"), command)
    quick = root / "quick"
    command = command.replace("/tmp/quick", str(quick)).replace("outputs/<run>/final", str(quick / "final"))
    args = shlex.split(command)
    tool, rest = args[0], args[1:]
    if how == "compose":
        if tool == "torchrun":  # the command after the launcher's own flags, in one process
            tool, rest = (
                "sage-train",
                [a for a in rest if not a.startswith("--") and a not in ("-m",)][1:],
            )
        if "-m" in rest:  # a sweep: one of its jobs, launcher settings included
            rest = one_point([a for a in rest if a != "-m"])
            r = run([str(BIN / tool), *rest, "--cfg", "all"], env, root)
            assert "launcher:" in r.stdout
        else:
            r = run([str(BIN / tool), *rest, "--cfg", "job"], env, root)
        assert "model:" in r.stdout
    elif tool == "make":
        overrides = shrink([f"output_dir={root / 'make_run'}"], SHRINK_TRAIN)
        run(["make", "run", "ARGS=" + shlex.join(overrides)], env, REPO)
    elif tool == "torchrun":
        launcher = [a for a in rest if a.startswith("--")]
        module_at = rest.index("-m")
        overrides = shrink(rest[module_at + 2 :], SHRINK_TRAIN)
        r = run(
            [str(BIN / tool), "--standalone", *launcher, "-m", rest[module_at + 1], *overrides],
            env,
            root,
        )
        assert " x 2 processes = " in r.stdout, r.stdout[-2000:]
    elif tool == "python":
        r = run([sys.executable, *rest], env, root)
        assert ", fits (" in r.stdout
    elif tool == "sage-train" and "-m" in rest:
        sweep = root / f"sweep{i}"
        shrink_to = {**SHRINK_TRAIN, "hydra.sweep.dir": str(sweep)}
        if "hparams_search=table" in command:
            shrink_to |= SHRINK_GRID
        if "hparams_search=branch_threshold_ratio" in command:
            shrink_to |= SHRINK_STUDY
        args = shrink(one_point(rest), shrink_to)
        run([str(BIN / tool), *args], env, root)
        # a grid job's folder is <sweep>/<its overrides>, a study's trial's <sweep>/<study>/<number>
        finished = list(sweep.glob("*/metrics.json")) + list(sweep.glob("*/*/metrics.json"))
        assert finished, f"{command}: no job of the sweep finished"
    elif tool == "sage-train":
        if not any(a.startswith("output_dir=") for a in rest):
            rest.append(f"output_dir={root / f'run{i}'}")
        shrink_to = dict(SHRINK_TRAIN)
        for key, extra in SHRINK_IF_SET.items():
            if any(a.startswith(key + "=") for a in rest):
                shrink_to |= extra
        run([str(BIN / tool), *shrink(rest, shrink_to)], env, root)
    elif tool == "sage-eval":
        run([str(BIN / tool), *shrink(rest, SHRINK_EVAL)], env, root)
    elif tool == "sage-report":
        rest = [a.replace("docs/results/", f"{root}/report/") for a in rest]
        if "--k" in rest:  # at most the shrunk evaluations' samples per problem (sage-report refuses more)
            rest[rest.index("--k") + 1] = SHRINK_EVAL["eval.n_samples"]
        run([str(BIN / tool), *rest], env, root)
        assert (root / "report").is_dir()


def shell_line(command: str) -> str:
    """A README command as the fresh shell runs it: sage-train shrunk by overrides only, the rest as
    written, except the MLflow UI, a server that never returns: it is found on PATH and asked for its
    options (tests/integration/test_mlflow_ui.py serves and renders a store)."""
    args = shlex.split(command)
    if args[0] == "sage-train":
        return shlex.join(["sage-train", *shrink(args[1:], SHRINK_TRAIN)])
    if args[:2] == ["mlflow", "ui"]:
        return shlex.join([*args, "--help"]) + " > /dev/null"
    if command == ACTIVATE or args[0] == "sage-report":
        return command
    raise ValueError(f"README command in an activated block not covered by shell_line: {command}")


ACTIVATED = [b for b in readme_blocks() if ACTIVATE in block_commands(b)]


def test_the_readme_has_an_activated_block():
    assert ACTIVATED, f"no README bash block starts with {ACTIVATE!r}"


@pytest.mark.parametrize("block", ACTIVATED, ids=lambda b: "usage")
def test_an_activated_block_runs_in_a_fresh_shell(block, tmp_path):
    """The README's commands as a user types them after the two commands: a fresh shell (no profile, no
    venv on PATH), the block's lines in order in a folder of its own holding `.venv`, shrunk by overrides."""
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    venv_bins = {str(BIN), str(REPO / ".venv" / "bin")}
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p not in venv_bins)
    unset = ("VIRTUAL_ENV", "MLFLOW_TRACKING_URI", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env |= {"PATH": path, "HF_HUB_OFFLINE": "1"}
    fresh = ["bash", "--noprofile", "--norc", "-c"]
    before = subprocess.run([*fresh, "command -v sage-train"], env=env, cwd=tmp_path, capture_output=True)
    assert before.returncode != 0, "sage-train is on PATH before activation: the shell is not fresh"
    script = "set -euo pipefail\n" + "\n".join(shell_line(c) for c in block_commands(block))
    r = subprocess.run([*fresh, script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for command in block_commands(block):
        if command.startswith("sage-report") and "--out" in command:
            out = shlex.split(command)[shlex.split(command).index("--out") + 1]
            assert (tmp_path / out).is_file(), r.stdout[-2000:]
            assert f"report: {out}" in r.stdout
