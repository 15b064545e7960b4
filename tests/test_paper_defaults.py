"""A paper model evaluates the paper's benchmarks by default (issue 20, item 6): each paper model option
chooses ``eval=math_suite`` through Hydra's defaults-list ``override``, for sage-train and sage-eval alike;
the testbed models keep ``arith_heldout`` and ``eval=<option>`` on the command line still wins. A paper
model samples its evaluation through vLLM (issue 39), the testbed models through the hf backend."""

import os
import re
import shlex
import sys
from pathlib import Path

import prefork
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sage.eval.main import register_evaluate_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PAPER = ["qwen2.5-math-7b", "r1-distill-qwen-7b", "qwen2.5-math-1.5b-instruct", "qwen2.5-3b-instruct"]
TESTBED = ["tiny", "tiny_arith", "tiny_sft", "tiny_chat"]
MATH_SUITE = ["aime", "amc23", "math500_l5", "minerva"]

register_evaluate_configs()  # sage-train's schemas and sage-eval's base_evaluate


def eval_choice(entry: str, *overrides: str) -> tuple[str, list[str]]:
    """(the eval option chosen, its dataset names) of ``entry`` ("train" | "evaluate") composed."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(entry, overrides=list(overrides), return_hydra_config=True)
    return cfg.hydra.runtime.choices.eval, list(cfg.eval.datasets)


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("model", PAPER)
def test_a_paper_model_evaluates_the_math_suite(entry, model):
    assert eval_choice(entry, f"model={model}") == ("math_suite", MATH_SUITE)
    assert eval_choice(entry, f"model={model}", "eval=amc23") == ("amc23", ["amc23"])  # command line wins


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("model", TESTBED)
def test_a_testbed_model_keeps_the_held_out_problems(entry, model):
    assert eval_choice(entry, f"model={model}") == ("arith_heldout", ["arith_heldout"])


def eval_backend(entry: str, *overrides: str) -> str:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return str(compose(entry, overrides=list(overrides)).eval.backend.value)


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("model", PAPER)
def test_a_paper_model_evaluates_through_vllm(entry, model):
    """At a paper model's scale the hf backend's default batch (512 sequences) holds a KV cache of tens of
    GiB (issue 39): a paper model's evaluation samples through vLLM unless the command line says otherwise,
    whichever eval option it evaluates; the testbed models keep the hf backend."""
    assert eval_backend(entry, f"model={model}") == "vllm"
    assert eval_backend(entry, f"model={model}", "eval=amc23") == "vllm"
    assert eval_backend(entry, f"model={model}", "eval.backend=hf") == "hf"  # command line wins
    assert eval_backend(entry, "model=tiny") == "hf"


def paper_section_commands() -> list[list[str]]:
    """The task overrides of every sage-train / torchrun -m sage.train command of the README's "Paper scale"
    block (the Hydra and launcher overrides dropped: they do not choose the job's config)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Paper scale", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in section.splitlines():
        words = shlex.split(line, comments=True)
        if not words or not {"sage-train", "sage.train"} & set(words):
            continue
        start = words.index("sage-train" if "sage-train" in words else "sage.train") + 1
        commands.append([w for w in words[start:] if "=" in w and not w.startswith("hydra")])
    return commands


def test_the_readme_paper_commands_evaluate_the_math_suite():
    commands = [c for c in paper_section_commands() if any(w.startswith("model=") for w in c)]
    assert len(commands) >= 2, "the README's Paper scale block lost its paper commands"
    for overrides in commands:
        # a grid's comma lists are sweeps: compose each command's first job
        first = [re.sub(r"^([^=]+=)([^,\[]+),.*$", r"\1\2", w) for w in overrides]
        assert eval_choice("train", *first)[0] == "math_suite", overrides


@pytest.mark.parametrize("module", ["sage.train", "sage.eval"])
def test_cfg_job_of_the_entry_points_shows_the_math_suite(module):
    """What a user sees with ``--cfg job``: the resolved job config of a paper model holds the four
    benchmark sets."""
    r = prefork.run(
        [sys.executable, "-m", module, "model=qwen2.5-math-7b", "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},  # as tests/prefork.py imported: forked, not fresh
    )
    assert r.returncode == 0, r.stderr[-2000:]
    job = OmegaConf.create(r.stdout)
    assert list(job.eval.datasets) == MATH_SUITE


def seed_of(*overrides: str) -> int:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides)).seed


def test_the_paper_preset_runs_the_papers_seed_unless_seed_is_given():
    """trl=paper is the paper's recipe, seed 3407 included (issue 55); the command line's seed= wins, and the
    testbed keeps seed 0."""
    assert (
        seed_of("trl=paper")
        == 3407
        == seed_of("trl=paper", "model=qwen2.5-math-7b", "experiment=grpo_branch")
    )
    assert seed_of("trl=paper", "seed=5") == 5 and seed_of("trl=paper", "seed=0") == 0
    assert seed_of() == 0 == seed_of("trl=testbed") and seed_of("trl=testbed", "seed=5") == 5


def test_every_readme_paper_command_runs_the_papers_seed():
    commands = [c for c in paper_section_commands() if "trl=paper" in c]
    assert len(commands) >= 3, "the README's Paper scale block lost its paper commands"
    for overrides in commands:
        first = [re.sub(r"^([^=]+=)([^,\[]+),.*$", r"\1\2", w) for w in overrides]  # a grid's first job
        assert seed_of(*first) == 3407, overrides


@pytest.mark.parametrize("overrides, seed", [(["trl=paper"], 3407), (["trl=paper", "seed=5"], 5), ([], 0)])
def test_the_job_config_shows_the_seed_a_run_takes(overrides, seed):
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *overrides, "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},  # as tests/prefork.py imported: forked, not fresh
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert OmegaConf.create(r.stdout).seed == seed
