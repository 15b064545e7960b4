"""Every option of every config group composes and its targets bind, without loading a model; bad input
gives a one-line error that names the problem."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from sage.config import ConfigError, register_configs, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["model", "data", "algorithm", "divergence", "guide", "schedule", "rollout", "eval", "trainer"]
# Values the entry point supplies at run time, per target argument name.
RUNTIME = {"chat": False, "schedule": lambda a, b, s: a, "max_steps": 10}

register_configs()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cfg_for(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def bind(node) -> None:
    """Bind a _target_ node's keys (plus runtime-supplied ones) to the target's signature."""
    container = OmegaConf.to_container(node, resolve=True)
    target = get_method(container.pop("_target_"))
    container.pop("_partial_", None)
    sig = inspect.signature(target)
    for name in sig.parameters:
        if name in RUNTIME and name not in container:
            container[name] = RUNTIME[name]
    sig.bind(**container)


ALL = [(g, o) for g in GROUPS for o in options(g)]


def test_every_group_has_options():
    assert {g for g, _ in ALL} == set(GROUPS)
    assert {
        "tiny",
        "qwen2.5-math-7b",
        "r1-distill-qwen-7b",
        "qwen2.5-math-1.5b-instruct",
        "qwen2.5-3b-instruct",
    } <= set(options("model"))
    assert {"grpo", "dapo", "bnpo", "dr_grpo", "gspo"} <= set(options("algorithm"))
    assert {"reverse_kl", "none", "forward_kl"} == set(options("divergence"))
    assert {"none", "random", "token", "branch"} == set(options("guide"))


@pytest.mark.parametrize("group,option", ALL)
def test_option_composes_and_binds(group, option):
    extra = ["divergence=reverse_kl"] if group == "guide" else []
    cfg = cfg_for(f"{group}={option}", *extra)
    node = cfg[group]
    if group == "model":
        bind(node.source)
        if node.sft is not None:
            bind(node.sft.data)
    elif group == "eval":
        for ds in node.datasets.values():
            bind(ds)
    elif "_target_" in node:
        bind(node)
        if group in ("divergence", "schedule", "guide"):
            obj = instantiate(node)  # the cheap objects are built for real
            if group == "schedule" and node.get("_partial_"):
                obj(max_steps=10)
    if group == "rollout" and node.use_vllm:
        with pytest.raises(ConfigError, match="CUDA"):
            validate(cfg)
    elif not (group == "guide" and option != "none" and cfg.divergence.beta == 0):
        validate(cfg)


def test_grpo_args_map_onto_trl():
    from sage.train.main import grpo_args

    cfg = cfg_for("algorithm=dapo", "divergence=forward_kl", "trainer.max_steps=3")
    args = grpo_args(cfg, Path("/tmp/x"))
    assert (args.loss_type, args.epsilon_high, args.mask_truncated_completions) == ("dapo", 0.28, True)
    assert args.beta == 0.05 and args.max_steps == 3 and args.per_device_train_batch_size == 64
    args = grpo_args(cfg_for("algorithm=dr_grpo", "divergence=none"), Path("/tmp/x"))
    assert (args.loss_type, args.scale_rewards, args.beta) == ("dr_grpo", "none", 0.0)
    args = grpo_args(cfg_for("algorithm=gspo"), Path("/tmp/x"))
    assert args.importance_sampling_level == "sequence"


def test_guide_with_no_divergence_is_an_error_that_says_why():
    with pytest.raises(ConfigError, match="divergence=none has no anchor"):
        validate(cfg_for("guide=branch", "divergence=none"))


def test_wrong_type_and_unknown_key_and_bad_enum_fail_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError), match="beta"):
        cfg_for("divergence.beta=lots")
    with pytest.raises(ConfigCompositionException, match="ratoi"):
        cfg_for("guide=branch", "guide.ratoi=0.5")
    with pytest.raises((ConfigCompositionException, ValidationError), match="k1, k2, k3|k4"):
        cfg_for("divergence.estimator=k4")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sage.train", *args], capture_output=True, text=True, timeout=120
    )


def last_line(text: str) -> str:
    return [ln for ln in text.strip().splitlines() if ln.strip()][-1]


def test_cli_errors_are_one_line(tmp_path):
    r = run_cli("guide=nope", f"output_dir={tmp_path}")
    assert r.returncode != 0 and "Could not find 'guide/nope'" in r.stderr
    assert "Available options" in r.stderr and "branch" in r.stderr
    r = run_cli("guide=branch", "divergence=none", f"output_dir={tmp_path}")
    assert r.returncode == 2
    assert last_line(r.stderr).startswith("error: guide=BranchGuide reshapes the anchor")
    r = run_cli("trainer.max_steps=many", f"output_dir={tmp_path}")
    assert r.returncode != 0 and "trainer.max_steps" in r.stderr


def test_data_file_with_missing_field_is_one_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "1+1", "solution": "2"}\n{"prompt": "2+2"}\n')
    r = run_cli("data=dapo_math_17k", f"data.source={bad}", f"output_dir={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr[-2000:]
    line = last_line(r.stderr)
    assert str(bad) in line and "row 1" in line and "'solution'" in line


def test_branch_threshold_default_follows_the_model():
    assert cfg_for("guide=branch").guide.threshold == 0.3  # the testbed's measured q90 entropy
    assert cfg_for("guide=branch", "model=qwen2.5-math-7b").guide.threshold == 1.2  # the paper's
    assert cfg_for("guide=branch", "guide.threshold=2.0").guide.threshold == 2.0
