"""Every option of every config group composes and its targets bind, without loading a model; bad input
gives a one-line error that names the problem."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import prefork
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from sage.config import ConfigError, default_ks, register_configs, validate
from sage.objective.divergences import SequenceKL
from sage.targets import changed_only, instantiate_node
from sage.train.main import grpo_args, lora_config
from sage.trl_checks import cpu_precision

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["model", "data", "trl", "algorithm", "divergence", "guide", "schedule", "rollout", "eval"]
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


def needs_gpu(args) -> bool:
    """bf16 training args where neither a GPU nor this CPU computes bfloat16 are refused
    (sage.trl_checks.cpu_precision); bind those instead."""
    from sage.hardware import cpu_computes_bfloat16

    return bool(args.get("bf16")) and not torch.cuda.is_available() and not cpu_computes_bfloat16()


def wants_8bit(cfg) -> bool:
    """The paper's presets ask for bitsandbytes' 8-bit Adam, which needs CUDA."""
    sft = cfg.model.get("sft")
    return "8bit" in str(cfg.trl.optim) or (sft is not None and "8bit" in str(sft.args.get("optim")))


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
    assert {"grpo", "dapo", "dapo_full", "bnpo", "dr_grpo", "gspo"} <= set(options("algorithm"))
    assert {"reverse_kl", "none", "forward_kl", "sequence_kl", "reverse_kl_strong"} == set(
        options("divergence")
    )
    assert {"none", "random", "token", "branch", "fork", "fork_rare", "archer"} == set(options("guide"))
    assert {"testbed", "paper"} == set(options("trl"))


@pytest.mark.parametrize("group,option", ALL)
def test_option_composes_and_binds(group, option, tmp_path):
    """Every option composes; its targets bind or build for real: TRL's GRPOConfig for the groups that
    set TRL's knobs, SFTConfig and LoraConfig for the models, the cheap objects of the objective."""
    extra = ["divergence=reverse_kl"] if group == "guide" else []
    if (group, option) in {("guide", "fork"), ("guide", "fork_rare")}:
        extra.append("model=tiny_fork")  # the control acts at the fork world's strategy tokens
    if (group, option) == ("rollout", "vllm"):
        extra.append("model=tiny_sft")  # a LoRA model: vLLM cannot reload the default's tied output layer
    cfg = cfg_for(f"{group}={option}", *extra)
    if group == "model":
        bind(cfg.model.source)
        lora = lora_config(cfg)
        if lora is not None:  # what peft writes beside every adapter checkpoint
            lora.save_pretrained(str(tmp_path / "adapter"))
        if cfg.model.sft is not None:
            bind(cfg.model.sft.data)
            if needs_gpu(cfg.model.sft.args):
                bind(changed_only(cfg.model.sft.args))
            else:
                args = cfg.model.sft.args  # as sage.train.sft builds it: bf16 under the CPU's autocast here
                instantiate_node(
                    changed_only(args), output_dir=str(tmp_path), **cpu_precision(args, "model.sft.args")
                )
    elif group == "eval":
        for ds in cfg.eval.datasets.values():
            bind(ds)
    elif group in ("trl", "algorithm", "rollout"):
        if needs_gpu(cfg.trl):
            bind(changed_only(cfg.trl))
            with pytest.raises(ConfigError, match="bf16"):  # TRL refuses it on this CPU, in one line
                grpo_args(cfg, tmp_path)
        else:
            grpo_args(cfg, tmp_path)
    elif "_target_" in cfg[group]:
        node = cfg[group]
        bind(node)
        if group in ("divergence", "schedule", "guide"):
            obj = instantiate(node)  # the cheap objects are built for real
            if group == "schedule" and node.get("_partial_"):
                obj(max_steps=10)
    if (group == "rollout" and cfg.trl.use_vllm) or (wants_8bit(cfg) and not torch.cuda.is_available()):
        with pytest.raises(ConfigError, match="CUDA"):
            validate(cfg)
    elif not (group == "guide" and option != "none" and cfg.divergence.beta == 0):
        validate(cfg)


def test_regime_sets_one_learning_rate_and_the_beta_of_every_divergence_that_has_one(tmp_path):
    """regime=anchored over a grid mixing KL and no-KL rows (Table 1): no row refuses it, the KL rows get
    beta 0.2, the no-KL row keeps none, every row the doubled learning rate; the command line still wins."""
    base = cfg_for("experiment=grpo")
    for experiment, beta in [("grpo", 0.2), ("grpo_fkl", 0.2), ("grpo_branch", 0.2), ("grpo_nokl", 0.0)]:
        cfg = cfg_for(f"experiment={experiment}", "regime=anchored")
        validate(cfg)
        args = grpo_args(cfg, tmp_path)
        assert (args.beta, args.learning_rate) == (beta, 2 * base.trl.learning_rate), experiment
    strong = {"reverse_kl_strong": 1.4}  # the control whose beta is the regime's times a factor
    for divergence in options("divergence"):  # every option with a beta, a new one too, gets the regime's
        cfg = cfg_for(f"divergence={divergence}", "regime=anchored")
        expected = 0.0 if divergence == "none" else 0.2 * strong.get(divergence, 1.0)
        assert cfg.divergence.beta == pytest.approx(expected), divergence
    for regime in ("default", "anchored"):  # the control stays 1.4x GRPO's beta in every regime
        grpo, control = (cfg_for(f"experiment={e}", f"regime={regime}") for e in ("grpo", "grpo_strong_kl"))
        assert control.divergence.beta == pytest.approx(1.4 * grpo.divergence.beta), regime
        assert control.guide._target_ == grpo.guide._target_ and control.method == "grpo_strong_kl"
    default = cfg_for("experiment=grpo", "regime=default")
    assert (base.divergence.beta, default.divergence.beta) == (0.05, 0.05)
    cfg = cfg_for("experiment=grpo", "regime=anchored", "divergence.beta=0.1", "trl.learning_rate=3e-4")
    assert (cfg.divergence.beta, cfg.trl.learning_rate) == (0.1, 3e-4)


def test_grpo_args_map_onto_trl():
    cfg = cfg_for("algorithm=dapo_full", "divergence=forward_kl", "trl.max_steps=3", "seed=5")
    args = grpo_args(cfg, Path("/tmp/x"))
    assert (args.loss_type, args.epsilon_high, args.mask_truncated_completions) == ("dapo", 0.28, True)
    assert args.beta == 0.05 and args.max_steps == 3 and args.per_device_train_batch_size == 64
    assert args.seed == 5 and args.max_completion_length == cfg.model.max_completion_length
    assert args.model_init_kwargs == {"dtype": "float32"} and cfg.filter_zero_variance_groups
    # algorithm=dapo is what the paper's Table 3 ran: TRL's loss_type=dapo, nothing else of DAPO's recipe
    paper = cfg_for("algorithm=dapo")
    args, grpo = grpo_args(paper, Path("/tmp/x")), grpo_args(cfg_for("algorithm=grpo"), Path("/tmp/x"))
    assert args.loss_type == "dapo" and not paper.filter_zero_variance_groups
    assert (args.epsilon_high, args.mask_truncated_completions) == (
        grpo.epsilon_high,
        grpo.mask_truncated_completions,
    )
    assert cfg_for("algorithm=dapo", "filter_zero_variance_groups=true").filter_zero_variance_groups
    args = grpo_args(cfg_for("algorithm=dr_grpo", "divergence=none"), Path("/tmp/x"))
    assert (args.loss_type, args.scale_rewards, args.beta) == ("dr_grpo", "none", 0.0)
    args = grpo_args(cfg_for("algorithm=gspo"), Path("/tmp/x"))
    assert args.importance_sampling_level == "sequence"
    assert not grpo_args(cfg_for("algorithm=grpo"), Path("/tmp/x")).use_bias_correction_kl
    args = grpo_args(cfg_for("divergence.importance_weighted=true"), Path("/tmp/x"))
    assert args.use_bias_correction_kl


def test_any_trl_and_peft_key_is_settable_by_its_own_name(tmp_path):
    """Keys that no file of ours mentions reach TRL's and peft's config objects unchanged."""
    for key in ("vllm_importance_sampling_correction", "top_entropy_quantile", "lora_dropout"):
        assert not any(key in p.read_text() for p in CONF.rglob("*.yaml")), key
    cfg = cfg_for("trl.vllm_importance_sampling_correction=false", "trl.top_entropy_quantile=0.2")
    args = grpo_args(cfg, tmp_path)
    assert args.vllm_importance_sampling_correction is False and args.top_entropy_quantile == 0.2
    cfg = cfg_for("model=tiny_sft", "model.lora.lora_dropout=0.1", "model.sft.args.packing=true")
    assert lora_config(cfg).lora_dropout == 0.1
    assert instantiate_node(changed_only(cfg.model.sft.args), output_dir=str(tmp_path)).packing is True


def test_trl_typos_and_keys_owned_elsewhere_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="learnig_rate"):
        cfg_for("trl.learnig_rate=1e-5")
    # beta is divergence.beta, seed is seed: one key per fact, so the trl node has no such key
    for key in ("beta", "seed", "max_completion_length", "output_dir"):
        with pytest.raises(ConfigCompositionException, match=key):
            cfg_for(f"trl.{key}=1")


@pytest.mark.parametrize("group", ["trl", "divergence", "guide", "schedule", "eval", "peft"])
def test_option_files_list_only_what_differs_from_their_schema(group):
    """Each default has one source: an option file never restates a value its schema already has."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    for path in (CONF / group).glob("*.yaml"):
        own = OmegaConf.load(path)
        base_name = own.get("defaults", [None])[0]
        if path.read_text().startswith("# @package _global_"):  # trl=paper: its group's keys under `trl:`
            own, base_name = (
                OmegaConf.create({**own[group], "defaults": own.defaults}),
                base_name.split("@")[0],
            )
        while f"{base_name}.yaml" not in repo[group]:  # an option that extends another option
            base_name = OmegaConf.load(CONF / group / f"{base_name}.yaml").defaults[0]
        schema = OmegaConf.create(repo[group][f"{base_name}.yaml"].node)
        for key, value in OmegaConf.to_container(own, resolve=False).items():
            if key == "defaults" or key not in schema or OmegaConf.is_missing(schema, key):
                continue
            if isinstance(value, str) and value.startswith("${"):
                continue
            assert OmegaConf.to_container(schema)[key] != value, f"{path.name}: {key}={value} is the default"


def test_eval_ks_follow_n_samples_unless_given():
    assert default_ks(1) == [1] and default_ks(8) == [1, 8] and default_ks(20) == [1, 8, 20]
    assert default_ks(64) == [1, 8, 64] and default_ks(256) == [1, 8, 64, 256]
    cfg = cfg_for("eval.n_samples=8", "eval.limit=20")
    validate(cfg)
    assert list(cfg.eval.ks) == [1, 8]
    cfg = cfg_for("eval.n_samples=8", "eval.ks=[2,4]")
    validate(cfg)
    assert list(cfg.eval.ks) == [2, 4]
    with pytest.raises(ConfigError, match="eval.ks contains 16"):
        validate(cfg_for("eval.n_samples=8", "eval.ks=[16]"))
    # refused, not reordered: the tables' columns are eval.ks as given (issue 56)
    for ks in ("[2,1,1]", "[1,1]", "[8,2]"):
        with pytest.raises(
            ConfigError, match=r"^eval.ks=\[.*\] must be increasing, each k once: give eval.ks="
        ):
            validate(cfg_for("eval.n_samples=8", f"eval.ks={ks}"))


def test_guide_with_no_divergence_is_an_error_that_says_why():
    with pytest.raises(ConfigError, match="divergence=none has no anchor"):
        validate(cfg_for("guide=branch", "divergence=none"))


def test_vllm_in_bfloat16_on_a_cpu_without_bfloat16_is_refused_before_training(monkeypatch):
    """vLLM's CPU build emulates bfloat16 on such a CPU and its first realistic step outlives the engine's
    RPC timeout, after the training the evaluation follows: the run is refused at validation instead, in one
    line that names the setting to use. A CPU with bfloat16 arithmetic, float32, or the hf backend pass."""
    from sage import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_computes_bfloat16", lambda: False)
    bf16 = ("model=qwen2.5-math-1.5b-instruct", "model.dtype=bfloat16")
    with pytest.raises(ConfigError) as e:
        validate(cfg_for(*bf16, "eval.backend=vllm"))
    assert "\n" not in str(e.value) and "set model.engine_dtype=float32" in str(e.value)
    validate(cfg_for(*bf16, "eval.backend=vllm", "eval.at_end=false"))  # no engine is ever built
    validate(cfg_for(*bf16, "eval.backend=hf"))
    validate(cfg_for("model=qwen2.5-math-1.5b-instruct", "model.dtype=float32", "eval.backend=vllm"))
    monkeypatch.setattr(hardware, "cpu_computes_bfloat16", lambda: True)
    validate(cfg_for(*bf16, "eval.backend=vllm"))


def test_engines_run_in_bfloat16_where_the_machine_computes_it(monkeypatch):
    """model.engine_dtype=auto (the default): vLLM engines serve in bfloat16 on a CPU with bfloat16
    arithmetic, as the cluster's do, else in model.dtype; a set value is kept; the evaluation's sampling
    dtype is the engine's under eval.backend=vllm and the model's under hf, and sage-eval's settings key
    follows it (a bfloat16 evaluation is not a float32 one)."""
    from sage import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_computes_bfloat16", lambda: True)
    assert hardware.engine_dtype("auto", "float32") == "bfloat16"
    assert hardware.engine_dtype("float32", "float32") == "float32"
    cfg = cfg_for("model=qwen2.5-coder-0.5b-instruct", "eval.backend=vllm")
    assert cfg.model.engine_dtype == "auto" and cfg.model.dtype == "float32"
    assert hardware.sampling_dtype(cfg.model, cfg.eval) == "bfloat16"
    assert hardware.sampling_dtype(cfg.model, cfg_for("eval.backend=hf").eval) == "float32"
    monkeypatch.setattr(hardware, "cpu_computes_bfloat16", lambda: False)
    assert hardware.engine_dtype("auto", "float32") == "float32"
    assert hardware.engine_dtype("auto", "bfloat16") == "bfloat16"  # then refused by check_vllm, above
    assert hardware.sampling_dtype(cfg.model, cfg.eval) == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert hardware.engine_dtype("auto", "float32") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert hardware.engine_dtype("auto", "float16") == "float16"
    with pytest.raises((ConfigCompositionException, ValidationError), match="engine_dtype"):
        cfg_for("model.engine_dtype=int8")


def test_wrong_type_and_unknown_key_and_bad_enum_fail_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError), match="beta"):
        cfg_for("divergence.beta=lots")
    with pytest.raises(ConfigCompositionException, match="ratoi"):
        cfg_for("guide=branch", "guide.ratoi=0.5")
    with pytest.raises((ConfigCompositionException, ValidationError), match="k1, k2, k3|k4"):
        cfg_for("divergence.estimator=k4")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return prefork.run(
        [sys.executable, "-m", "sage.train", *args], timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def last_line(text: str) -> str:
    return [ln for ln in text.strip().splitlines() if ln.strip()][-1]


def test_cli_errors_are_one_line(tmp_path):
    r = run_cli("guide=nope", f"output_dir={tmp_path}")
    assert r.returncode == 2 and last_line(r.stderr).startswith("error: guide=nope: no such guide option")
    assert "branch" in last_line(r.stderr)
    r = run_cli("guide=branch", "divergence=none", f"output_dir={tmp_path}")
    assert r.returncode == 2
    assert last_line(r.stderr).startswith("error: guide=branch reshapes the anchor")
    r = run_cli("trl.max_steps=many", f"output_dir={tmp_path}")
    assert r.returncode != 0 and "trl.max_steps" in r.stderr


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The refusal's line, after asserting it is the only thing the command printed to stderr."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    return lines[0]


def test_a_misspelt_option_lists_only_the_options_a_user_chooses(tmp_path):
    # conf/guide/*.yaml build on schemas registered as guide/base_*: internal, never a choice
    line = one_error_line(run_cli("guide=brnach", f"output_dir={tmp_path}"))
    assert "guide=brnach" in line and "did you mean guide=branch?" in line
    assert "base_" not in line and all(o in line for o in ("branch", "fork", "none", "random", "token"))


def test_a_misspelt_key_names_the_key_it_is_closest_to_and_never_suggests_adding_it(tmp_path):
    # Hydra's "+guide.ratoi=0.5" adds the key, which the schema then refuses with a second error
    line = one_error_line(run_cli("guide.ratoi=0.5", f"output_dir={tmp_path}"))
    assert "guide.ratoi=0.5" in line and "did you mean guide.ratio" in line and "guide=branch" in line
    assert "+" not in line
    line = one_error_line(run_cli("guide=branch", "guide.ratoi=0.5", f"output_dir={tmp_path}"))
    assert "did you mean guide.ratio?" in line and "+" not in line


def test_a_key_of_another_option_names_the_option_that_has_it(tmp_path):
    # the default data generates its problems; data.source belongs to the option that reads files
    line = one_error_line(run_cli("data.source=prompts.jsonl", f"output_dir={tmp_path}"))
    assert "data.source=prompts.jsonl" in line and "'source'" in line
    assert "data=dapo_math_17k data.source=prompts.jsonl" in line and "+" not in line


def test_data_file_with_missing_field_is_one_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "1+1", "solution": "2"}\n{"prompt": "2+2"}\n')
    r = run_cli("data=dapo_math_17k", f"data.source={bad}", f"output_dir={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr[-2000:]
    line = last_line(r.stderr)
    assert str(bad) in line and "row 1" in line and "'solution'" in line


def test_archer_experiment_is_grpo_with_the_archer_guide_under_k3():
    cfg = cfg_for("experiment=grpo_archer")
    assert cfg.guide._target_ == "sage.objective.guides.ArcherGuide" and cfg.method == "grpo_archer"
    assert cfg.divergence._target_ == "sage.objective.divergences.ReverseKL" and cfg.divergence.beta > 0
    g = cfg.guide
    assert (g.quantile, g.threshold, g.level, g.q_high, g.q_low) == (0.8, None, "response", 0.0, 1.0)
    validate(cfg)
    with pytest.raises(ConfigCompositionException):  # a typed schema: an unknown level fails at composition
        cfg_for("guide=archer", "guide.level=token")


def test_branch_threshold_default_follows_the_model():
    assert cfg_for("guide=branch").guide.threshold == 0.3  # the testbed's measured q90 entropy
    assert cfg_for("guide=branch", "model=qwen2.5-math-7b").guide.threshold == 1.2  # the paper's
    assert cfg_for("guide=branch", "guide.threshold=2.0").guide.threshold == 2.0


def test_paper_batch_shape_separates_micro_batch_from_the_step():
    from trl import GRPOConfig

    from sage.train.console import describe_batch

    cfg = cfg_for("trl=paper", "model=qwen2.5-math-7b")
    values = {k: v for k, v in OmegaConf.to_container(changed_only(cfg.trl)).items() if k != "_target_"}
    values["bf16"] = False  # a CPU without bfloat16 refuses it; the batch arithmetic does not depend on it
    args = GRPOConfig(output_dir="/tmp/x", max_completion_length=cfg.model.max_completion_length, **values)
    line = describe_batch(args, num_processes=1, longest_prompt_tokens=300)
    # 8 prompts x 8 rollouts per optimiser step (Table 8), generated at once, one completion per forward pass
    assert "1 completions per forward pass x 64 accumulation steps x 1 processes = 64 completions" in line
    assert "(8 prompts x 8 generations)" in line and "64 completions generated at a time" in line
    assert "longest micro-batch 1 x (300 prompt + 2048 completion) = 2348 tokens" in line
    # eight processes: the same 64 completions per step need an eighth of the accumulation
    args = GRPOConfig(output_dir="/tmp/x", **{**values, "gradient_accumulation_steps": 8})
    assert "x 8 accumulation steps x 8 processes = 64 completions" in describe_batch(args, 8, 300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trl.optim=adamw_8bit"], "trl.optim"),
        (["model=tiny_sft", "model.sft.args.optim=paged_adamw_8bit"], "model.sft.args.optim"),
    ],
)
def test_an_8bit_optimiser_without_cuda_fails_at_config_time(overrides, key):
    with pytest.raises(
        ConfigError, match=rf"^{key}=\S+ needs a CUDA GPU and none is visible; use {key}=adamw_torch"
    ):
        validate(cfg_for(*overrides))
    validate(cfg_for("model=tiny_sft"))  # the testbed's own SFT stage uses a CPU optimiser: accepted


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.seeds=[]", "eval.seeds is empty"),
        ("eval.n_samples=0", "eval.n_samples must be >= 1"),
        ("eval.limit=0", "eval.limit must be >= 1"),
        ("eval.batch_size=0", "eval.batch_size must be >= 1"),
        ("eval.every_steps=0", "eval.every_steps must be >= 1"),
        ("eval.perplexity_cap=-1", "eval.perplexity_cap must be >= 0"),
    ],
)
def test_bad_eval_values_fail_at_config_time(override, message):
    """Before training, not when the evaluation after it starts (issue 14)."""
    with pytest.raises(ConfigError, match=message):
        validate(cfg_for(override, "eval.ks=[1]"))


# rollout=vllm's refusals at composition (issue 46): the line sage.train.vllm_rollout.refusal writes, before
# any model is built, instead of an engine traceback from vLLM's add_lora or a refusal once the model is built
LM_HEAD = ("model=tiny_chat", "model.lora.target_modules=[q_proj,lm_head]", "rollout=vllm")
TIED = ("model=tiny", "rollout=vllm")  # full fine-tuning of the testbed model, whose output layer is tied


@pytest.mark.parametrize(
    "overrides, named",
    [
        (LM_HEAD, ("model.lora.target_modules naming lm_head", "q_proj", "vllm_merged", "rollout=hf")),
        (
            ("model=tiny_sft", "model.lora.target_modules=[model.embed_tokens,v_proj]", "rollout=vllm"),
            ("model.lora.target_modules naming model.embed_tokens", "rollout=vllm_merged"),
        ),
        (TIED, ("model.lora=null", "tie_word_embeddings", "rollout=vllm_merged", "model.lora")),
        (
            ("model=qwen2.5-3b-instruct", "model.dtype=float32", "rollout=vllm"),
            ("model.lora=null", "tie_word_embeddings"),
        ),
    ],
)
def test_what_rollout_vllm_cannot_serve_is_refused_at_composition(overrides, named):
    with pytest.raises(ConfigError) as e:
        validate_all(cfg_for(*overrides))
    message = str(e.value)
    assert "\n" not in message and message.startswith("rollout=vllm serves the policy to vLLM; ")
    assert all(n in message for n in named), message


def test_the_output_layer_and_the_embeddings_are_found_in_target_modules_as_peft_matches_them():
    from sage.train.vllm_rollout import unserved_targets

    assert unserved_targets(["q_proj", "lm_head", "v_proj"]) == ["lm_head"]
    assert unserved_targets({"model.embed_tokens", "transformer.wte", "up_proj"}) == [
        "model.embed_tokens",
        "transformer.wte",
    ]
    assert unserved_targets(["q_proj", "k_proj", "lm_head_proj"]) == [] and unserved_targets(None) == []
    assert unserved_targets("all-linear") == []  # peft leaves the output layer out
    assert unserved_targets(r".*\.(q_proj|v_proj)") == [] and unserved_targets("(") == []
    assert unserved_targets(r".*(lm_head|embed_tokens)") == ["lm_head", "embed_tokens"]


def validate_all(cfg) -> None:
    """sage-train's checks at composition: validate, then rollout=vllm's (sage.train.memory.check_rollout)."""
    from sage.train.memory import check_rollout

    validate(cfg)
    check_rollout(cfg)


def test_what_rollout_vllm_can_serve_passes_composition():
    validate_all(cfg_for("model=tiny_chat", "rollout=vllm"))  # LoRA on the projections
    validate_all(cfg_for(*LM_HEAD[:2]))  # rollout=hf trains LoRA on the output layer
    validate_all(cfg_for("model=tiny", "rollout=hf"))
    untied = "model.source.repo_id=Qwen/Qwen2.5-Math-7B"  # a stored architecture with an untied output layer
    validate_all(cfg_for("model=qwen2.5-3b-instruct", untied, "model.dtype=float32", "rollout=vllm"))


@pytest.mark.parametrize(
    "overrides, key", [(LM_HEAD, "model.lora.target_modules"), (TIED, "model.lora=null")]
)
def test_rollout_vllm_refusals_are_one_line_on_the_command_line(tmp_path, overrides, key):
    """The issue's commands: sage-train prints the one line and exits 2, nothing built."""
    r = run_cli(*overrides, f"output_dir={tmp_path / 'out'}")
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    line = one_error_line(r)
    assert line.startswith("error: rollout=vllm serves the policy to vLLM; ") and key in line


def test_the_sequence_anchor_is_on_policy_only():
    validate(cfg_for("divergence=sequence_kl", "guide=branch"))
    assert isinstance(instantiate_node(cfg_for("divergence=sequence_kl").divergence), SequenceKL)
    with pytest.raises(
        ConfigError, match=r"^divergence=sequence_kl .* trl.num_iterations must be 1 \(got 2\)$"
    ):
        validate(cfg_for("divergence=sequence_kl", "trl.num_iterations=2"))


def test_a_comma_in_the_experiment_name_is_refused_in_one_line(tmp_path):
    """Issue 47: sage-report --experiment splits its value on commas, so an experiment named with one could
    never be reported; sage-train (and sage-eval) refuse it before anything runs."""
    with pytest.raises(ConfigError, match=r"tracking.experiment='a,b' has a comma"):
        validate(cfg_for('tracking.experiment="a,b"'))
    validate(cfg_for('tracking.experiment="a b-c.d"'))
    line = one_error_line(run_cli('tracking.experiment="my,study"', f"output_dir={tmp_path}"))
    assert "tracking.experiment='my,study' has a comma" in line and "sage-report --experiment" in line
    assert not (tmp_path / "config.yaml").exists()
    r = prefork.run(
        [sys.executable, "-m", "sage.eval", 'tracking.experiment="my,study"', f"output_dir={tmp_path / 'e'}"],
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert "tracking.experiment='my,study' has a comma" in one_error_line(r)


# ------------------------------------------------------------------ TRL's keys at plan time (issue 56)
# Each probe of issue 56 that reached TRL after the MLflow run had started (72, 42, 42 and 40 lines of
# traceback, the accumulation's naming the wrong key) or trained silently (a negative clip range), and the
# eval.ks that gave a table header of pass@2 | pass@1 | pass@1: (override, the refusal's line).
PROBES = [
    (
        "trl.temperature=0",
        "trl.temperature must be a finite number > 0 (got 0.0): the training rollouts' sampling temperature",
    ),
    ("trl.per_device_train_batch_size=0", "trl.per_device_train_batch_size must be >= 1 (got 0)"),
    ("trl.gradient_accumulation_steps=0", "trl.gradient_accumulation_steps must be >= 1 (got 0)"),
    ("model.max_completion_length=0", "model.max_completion_length must be >= 1 (got 0)"),
    (
        "trl.epsilon=-0.2",
        "trl.epsilon must be a finite number > 0 (got -0.2): the importance ratio is clipped to "
        "[1 - epsilon, 1 + epsilon_high]",
    ),
    ("eval.ks=[2,1,1]", "eval.ks=[2,1,1] must be increasing, each k once: give eval.ks=[1,2]"),
]


def store_runs(store: Path) -> list:
    """Every run of an SQLite MLflow store, whatever its state (none if the file was never made)."""
    from mlflow.tracking import MlflowClient

    if not store.exists():
        return []
    client = MlflowClient(f"sqlite:///{store}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, run_view_type=3) if experiments else []


def refused_before_anything(r: subprocess.CompletedProcess, tmp_path: Path) -> str:
    """A refusal as issue 56 asks for it: exit 1 or 2, at most 3 lines of output, no MLflow run and nothing in
    the run's folder (but the empty main.log Hydra's logging opens as the job starts); returns its line."""
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode in (1, 2) and len(lines) <= 3, (r.stdout + r.stderr)[-3000:]
    assert store_runs(tmp_path / "mlflow.db") == []
    out = tmp_path / "out"
    left = {p.name: p.stat().st_size for p in out.iterdir()} if out.exists() else {}
    assert left in ({}, {"main.log": 0}), left
    return one_error_line(r)


def sage_train_in(tmp_path: Path, *args: str, out: str = "out", **env: str) -> subprocess.CompletedProcess:
    """sage-train with its own MLflow store and run folder (``out``) under ``tmp_path``."""
    store = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", **env}
    return prefork.run(
        [sys.executable, "-m", "sage.train", *args, f"output_dir={tmp_path / out}"],
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **store},
    )


@pytest.mark.parametrize("override, message", PROBES)
def test_each_probe_of_issue_56_is_one_line_before_any_run(override, message, tmp_path):
    r = sage_train_in(tmp_path, override)
    assert refused_before_anything(r, tmp_path) == f"error: {message}"


@pytest.mark.parametrize(
    "overrides, line",
    [
        (  # a library check TRL makes itself, named by the keys it is about
            ["trl.num_generations=3"],
            "trl.generation_batch_size=null, trl.num_generations=3: GRPOConfig refuses it: "
            "generation_batch_size (64) must be divisible by num_generations (3).",
        ),
        (
            ["trl.optim=nosuch"],
            "trl.optim=nosuch: GRPOConfig refuses it: nosuch is not a valid OptimizerNames",
        ),
        (
            ["model=tiny_sft", "model.sft.args.lr_scheduler_type=greedy"],
            "model.sft.args.lr_scheduler_type=greedy: SFTConfig refuses it: lr_scheduler_type greedy "
            "requires an eval strategy",
        ),
        (["trl.epsilon_high=0"], "trl.epsilon_high must be a finite number > 0 (got 0.0)"),
        (["trl.delta=-1"], "trl.delta must be a finite number > 0 (got -1.0)"),
        (["trl.per_device_eval_batch_size=0"], "trl.per_device_eval_batch_size must be >= 1 (got 0)"),
        (
            ["model=tiny_sft", "model.sft.args.gradient_accumulation_steps=0"],
            "model.sft.args.gradient_accumulation",
        ),
        (
            ["model.max_completion_length=500"],
            "model.max_completion_length=500 is longer than the model's context of 128 tokens (the testbed "
            "model's max_position_embeddings)",
        ),
    ],
)
def test_trl_and_its_ranges_refuse_at_config_time_naming_the_key(overrides, line):
    from sage.trl_checks import check_trl

    cfg = cfg_for(*overrides)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
        check_trl(cfg, processes=1, preset="testbed")
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_sound_trl_values_pass_and_the_check_joins_no_process_group(monkeypatch):
    """What a run takes passes; the check sees the launcher's processes without joining their group (TRL's
    TrainingArguments would, on construction, before sage's own init with its timeout)."""
    import torch.distributed as dist

    from sage.trl_checks import check_trl

    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, with no rendezvous to join: joining would fail
    monkeypatch.setenv("RANK", "0")
    for overrides in [(), ("model=tiny_chat",), ("trl.epsilon_high=0.28", "trl.delta=1.5")]:
        cfg = cfg_for("trl.per_device_train_batch_size=32", *overrides)
        validate(cfg)
        assert check_trl(cfg, processes=2, preset="testbed") is None
    assert not dist.is_initialized()
    # TRL's own checks see the run's processes: 4 per forward pass x 2 processes is a whole group of 8
    cfg = cfg_for("trl.per_device_train_batch_size=4", "trl.steps_per_generation=1")
    assert check_trl(cfg, processes=2, preset=None) is None
    with pytest.raises(ConfigError, match="must be divisible by num_generations"):
        check_trl(cfg, processes=1, preset=None)


def test_the_plan_refuses_what_sage_train_refuses(capsys):
    """python -m sage.train.plan runs the same checks, in the same line, bar what depends on the planning
    machine: the paper's 8-bit Adam, bf16 and vLLM engine are the cluster's to check."""
    from sage.train.plan import main

    for override, message in PROBES:
        assert main([override]) == 2, override
        assert capsys.readouterr().err.strip() == f"error: {message}"
    assert main(["model=qwen2.5-math-7b", "trl=paper", "rollout=vllm"]) == 0, capsys.readouterr().err


# ------------------------------------------------------------------ the paper's batch, enforced (issue 55)
# model=tiny_chat (an SFT stage, then LoRA RL, as at paper scale) shrunk to seconds: a small base model and
# SFT stage of their own, one RL step, no evaluation; trl=paper as any CPU runs it (no 8-bit Adam, which needs
# CUDA; no bf16, which needs a CPU with bfloat16 arithmetic).
PAPER_HERE = [
    "model=tiny_chat",
    "model.source.train_steps=20",
    "model.sft.data.n=16",
    "model.sft.args.num_train_epochs=1",
    "trl=paper",
    "trl.bf16=false",
    "trl.optim=adamw_torch",
    "trl.max_steps=1",
    "eval.at_end=false",
]


def test_a_run_without_an_optimiser_step_has_no_batch_to_keep():
    """A grid's SFT job (its first dependent's overrides, trl.max_steps=0, on the processes the SFT batch can
    use) and an experiment=base row take no RL step: trl=paper's batch is not theirs to keep."""
    from sage.trl_checks import check_batch

    kept_on_8 = ("trl=paper", "trl.gradient_accumulation_steps=8")
    assert check_batch(cfg_for(*kept_on_8, "trl.max_steps=0"), 1, "paper") is None
    assert check_batch(cfg_for(*kept_on_8, "experiment=base"), 1, "paper") is None
    assert check_batch(cfg_for(*kept_on_8), 8, "paper") is None
    with pytest.raises(
        ConfigError, match=r"1 x 8 x 1 process takes 8: pass trl.gradient_accumulation_steps=64"
    ):
        check_batch(cfg_for(*kept_on_8), 1, "paper")


@pytest.mark.slow
def test_the_papers_batch_on_two_processes_is_refused_unless_kept(tmp_path):
    """sage-train trl=paper under 2 processes without compensating accumulation takes 128 completions per
    step, not the paper's 64: refused in one line naming trl.gradient_accumulation_steps=32, before the
    process group, any model or MLflow run (the launcher's WORLD_SIZE is what each process reads); with
    that key torchrun trains it; allow_batch_change=true runs another batch, its MLflow params saying so."""
    from mlflow.tracking import MlflowClient

    r = sage_train_in(tmp_path, *PAPER_HERE, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    line = refused_before_anything(r, tmp_path)
    assert line == (
        "error: trl=paper states 64 completions per optimiser step (1 per forward pass x 64 accumulation "
        "steps on one process); 1 x 64 x 2 processes takes 128: pass trl.gradient_accumulation_steps=32 to "
        "keep 64, or allow_batch_change=true to train on 128 on purpose"
    )

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "sage.train.main"]
    r = subprocess.run(
        [
            sys.executable,
            *torchrun,
            *PAPER_HERE,
            "trl.gradient_accumulation_steps=32",
            f"output_dir={tmp_path / 'a'}",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "MLFLOW_TRACKING_URI": store, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert "1 completions per forward pass x 32 accumulation steps x 2 processes = 64 completions" in r.stdout
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("sage").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["allow_batch_change"] == "False"

    changed = ["trl.per_device_train_batch_size=8", "trl.gradient_accumulation_steps=1"]  # 1 prompt x 8
    r = sage_train_in(tmp_path, *PAPER_HERE, *changed, out="b")  # one process
    assert "allow_batch_change=true to train on 8 on purpose" in one_error_line(r)
    r = sage_train_in(tmp_path, *PAPER_HERE, *changed, "allow_batch_change=true", out="b")
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    runs = client.search_runs([client.get_experiment_by_name("sage").experiment_id])
    assert sorted(run.data.params["allow_batch_change"] for run in runs) == ["False", "True"]
