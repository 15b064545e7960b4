"""rollout=fast (sage/train/rollout.py): TRL's rollout_func through the evaluator's compact sampler.

Its output is what TRL's GRPOTrainer takes (one completion per prompt entry, ending at the first eos or at
max_completion_length); greedy rollouts equal transformers' generate, before and after an optimiser step
changes the weights; sampled first tokens follow the distribution transformers' generate samples under
TRL's temperature, top_p and min_p; a rollout is a function of (seed, step, process, call); settings and
policies it cannot sample are refused in one line naming rollout=fast; and sage-train trains and evaluates
with it, a resumed run exactly as an uninterrupted one.

Tests on the testbed model are marked slow (``build_tiny_model`` trains it when no build is cached)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import prefork
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from sage.config import ConfigError
from sage.eval.decode_loop import pick
from sage.objective.guides import noise_seed
from sage.train.rollout import CompactRollout, rollout_seed, runs

SMALL = {
    "vocab_size": 23,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "pad_token_id": 0,
}


def grpo_args(tmp_path, **config) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=64,
        min_p=0.01,  # trl=testbed's
        report_to="none",
        max_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        disable_dropout=True,
    )
    return GRPOConfig(**{**settings, **config})


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture
def testbed_path(testbed_model) -> str:
    """The testbed model's folder as TRL takes a model to load: a string."""
    return str(testbed_model)


def trainer_for(path, tmp_path, **config) -> GRPOTrainer:
    """TRL's own GRPOTrainer on ``path`` with the fast rollout as its rollout_func."""
    from sage.testbed.task import arith_dataset

    args = grpo_args(tmp_path, **config)
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=arith_dataset(16, 0),
        rollout_func=CompactRollout(args, lora=None),
    )
    trainer.model.train()  # as during training: the rollout must not depend on the module's mode
    return trainer


def repeated(prompts: list[str], n: int) -> list[str]:
    """A generation batch as TRL's RepeatSampler lays it out: each prompt n times in a row."""
    return [p for p in prompts for _ in range(n)]


def greedy(model, ids: list[int], max_new_tokens: int, eos: list[int], pad_id: int) -> list[int]:
    """transformers' generate, greedy, one prompt at a time (no padding), cut after the first eos."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad_id,
    )[0, len(ids) :].tolist()
    ends = [i for i, t in enumerate(out) if t in eos]
    return out[: ends[0] + 1] if ends else out


# ------------------------------------------------------------------------------------------- pure parts
def test_runs_group_consecutive_equal_prompts():
    assert runs([[1, 2], [1, 2], [3], [3], [3], [1, 2]]) == ([[1, 2], [3], [1, 2]], [2, 3, 1])
    assert runs([]) == ([], [])


def test_rollout_seeds_are_a_pure_function_of_their_four_integers():
    assert rollout_seed(0, 5, 0, 0) == rollout_seed(0, 5, 0, 0)
    keys = [(s, step, r, c) for s in (0, 1) for step in (0, 1) for r in (0, 1) for c in (-1, 0, 1)]
    seeds = {rollout_seed(*key) for key in keys}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
    assert rollout_seed(0, 5, 0, 0) != noise_seed(0, 5, 0, 0)  # not the guide's noise of the same step


@pytest.mark.parametrize(
    ("top_p", "min_p", "kept"),
    [(0.8, 0.01, 6), (0.88, 0.3, 5)],  # the nucleus decides the first, min_p the second
)
def test_min_p_and_top_p_keep_what_transformers_keeps(top_p, min_p, kept):
    """pick's support under temperature, top_p and min_p is the set transformers' warpers leave finite, and
    its frequencies follow their renormalised softmax (within 5 sigma)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    # distinct probabilities (ties would leave the order of a sort to decide) whose tempered cumulative
    # mass and ratios to the top token are far from the cut-offs
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.006, 0.004])
    logits = probs.log()[None].repeat(4000, 1)  # (B, V)
    temperature = 1.2
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)]
    )
    processed = warpers(None, logits[:1].clone())[0]
    assert set(torch.isfinite(processed).nonzero().squeeze(1).tolist()) == set(range(kept))
    expected = torch.softmax(processed, -1).double()

    samples = pick(logits, temperature, top_p, torch.Generator().manual_seed(0), min_p=min_p)
    assert set(samples.tolist()) == set(range(kept))
    counts = torch.bincount(samples, minlength=len(probs)).double()
    n = len(samples)
    assert ((counts - n * expected).abs() <= 5 * (n * expected * (1 - expected)).sqrt() + 1e-9).all()
    # unfiltered, hundreds of draws fall outside: the filters are visible
    unfiltered = pick(logits, temperature, 1.0, torch.Generator().manual_seed(0))
    assert (unfiltered >= kept).sum() > 300


def test_min_p_off_leaves_the_draws_unchanged():
    """min_p = 0 is the evaluator's old path: the same generator gives the same tokens."""
    logits = torch.randn(64, 23, generator=torch.Generator().manual_seed(1))
    for top_p in (1.0, 0.8):
        a = pick(logits, 1.0, top_p, torch.Generator().manual_seed(3))
        b = pick(logits, 1.0, top_p, torch.Generator().manual_seed(3), min_p=0.0)
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("config", "lora", "named"),
    [
        ({}, LoraConfig(r=8), "LoRA"),
        ({"top_k": 5}, None, "trl.top_k=5"),
        ({"repetition_penalty": 1.1}, None, "trl.repetition_penalty=1.1"),
        ({"generation_kwargs": {"typical_p": 0.9}}, None, "trl.generation_kwargs"),
        ({"use_transformers_continuous_batching": True}, None, "continuous_batching"),
    ],
)
def test_settings_it_cannot_sample_are_one_line_errors(tmp_path, config, lora, named):
    with pytest.raises(ConfigError) as error:
        CompactRollout(grpo_args(tmp_path, **config), lora=lora)
    message = str(error.value)
    assert message.startswith("rollout=fast") and named in message and "rollout=hf" in message
    assert "\n" not in message


def test_the_rollout_group_selects_the_function(tmp_path):
    """rollout=fast builds the compact rollout from the composed config; the default (hf) leaves TRL's
    own generation; a knob it cannot sample fails when the function is built."""
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.paths import CONF_DIR
    from sage.train.main import grpo_args as sage_grpo_args
    from sage.train.main import rollout_function

    register_configs()

    def built(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides))
        return rollout_function(cfg, sage_grpo_args(cfg, tmp_path))

    rollout = built("rollout=fast", "seed=7")
    assert isinstance(rollout, CompactRollout) and rollout.seed == 7
    assert built() is None and built("rollout=hf") is None
    with pytest.raises(ConfigError, match=r"^rollout=fast cannot sample with trl\.top_k=3"):
        built("rollout=fast", "trl.top_k=3")


def test_use_vllm_is_refused(tmp_path):
    args = grpo_args(tmp_path)
    args.use_vllm = True  # GRPOConfig itself would look for vLLM at construction
    with pytest.raises(ConfigError, match=r"rollout=fast .*trl\.use_vllm=true"):
        CompactRollout(args, lora=None)


def test_unsupported_policies_are_named_in_one_line():
    from peft import LoraConfig, get_peft_model

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=23, n_positions=32))
    lora = get_peft_model(
        Qwen2ForCausalLM(Qwen2Config(**SMALL)), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    )
    for model, reason in ((gpt2, "model_type 'gpt2'"), (lora, "PeftModel")):
        with pytest.raises(ConfigError) as error:
            CompactRollout.check(model)
        message = str(error.value)
        assert message.startswith("rollout=fast cannot decode") and reason in message, message
        assert "rollout=hf" in message and "\n" not in message
    CompactRollout.check(Qwen2ForCausalLM(Qwen2Config(**SMALL)))  # a supported one passes


def test_a_lora_run_stops_before_anything_is_built(tmp_path):
    """sage-train model=tiny_sft (LoRA SFT, then LoRA RL) rollout=fast: one line, exit 2, no model built."""
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "model=tiny_sft", "rollout=fast", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "SAGE_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout=fast cannot sample with a LoRA policy") and "rollout=hf" in last
    assert not (tmp_path / "cache").exists()  # neither the base model nor the SFT stage was built


# ------------------------------------------------------------------------------------ on the testbed
@pytest.mark.slow
def test_rollouts_are_what_trl_takes_and_end_at_eos(testbed_path, tmp_path):
    from sage.testbed.task import arith_dataset

    trainer = trainer_for(testbed_path, tmp_path)
    rows = [dict(r) for r in arith_dataset(4, 1) for _ in range(4)]  # 4 prompts x 4 generations
    prompts = [r["prompt"] for r in rows]
    out = trainer.rollout_func(prompts, trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"} and out["logprobs"] is None
    assert out["prompt_ids"] == trainer._tokenize_prompts(prompts)[0]  # TRL's own tokenisation
    completions = out["completion_ids"]
    assert len(completions) == len(prompts)
    eos, longest = trainer.eos_token_ids, trainer.max_completion_length
    for c in completions:
        assert all(isinstance(t, int) for t in c)
        assert 1 <= len(c) <= longest and not any(t in eos for t in c[:-1])  # cut at the first eos
        assert c[-1] in eos or len(c) == longest
    assert sum(c[-1] in eos for c in completions) >= 12  # the testbed model ends its answers
    assert len({tuple(c) for c in completions}) > 1  # sampled, not one answer copied

    # TRL scores them: one completion per row, its mask ending at eos, one advantage per row
    seen = []

    def recording(prompts, trainer, fn=trainer.rollout_func):
        seen.append(fn(prompts, trainer))
        return seen[-1]

    trainer.rollout_func = recording
    batch = trainer._generate_and_score_completions(rows)
    sampled = seen[-1]["completion_ids"]
    assert batch["completion_ids"].shape[0] == len(rows) and batch["advantages"].shape == (len(rows),)
    lengths = batch["completion_mask"].sum(1).tolist()
    assert lengths == [len(c) for c in sampled]
    assert [batch["completion_ids"][i, :n].tolist() for i, n in enumerate(lengths)] == sampled


@pytest.mark.slow
def test_greedy_rollouts_equal_generate_and_follow_an_optimiser_step(testbed_path, tmp_path):
    """At temperature 0 the rollout is transformers' greedy generate on the same prompts (of different
    lengths, so left padding is in play), before and after an SGD step; the step changes them, so a
    decoder that kept the weights it was first built with would fail the second comparison."""
    from sage.testbed.task import heldout_rows

    trainer = trainer_for(testbed_path, tmp_path, temperature=0.0)
    model, tok = trainer.model, trainer.processing_class
    problems = [r["problem"] for r in heldout_rows(4)]
    problems[2] = problems[2][:5]  # cut short: a shorter prompt, and an answer the model must improvise
    prompts = repeated(problems, 2)
    ids = trainer._tokenize_prompts(prompts)[0]
    eos, pad, longest = trainer.eos_token_ids, tok.pad_token_id, trainer.max_completion_length

    def expected():
        with torch.no_grad():
            return [greedy(model, i, longest, eos, pad) for i in ids]

    before = trainer.rollout_func(prompts, trainer)["completion_ids"]
    assert before == expected()
    assert len(set(map(len, ids))) > 1 and sum(c[-1] in eos for c in before) >= 4

    # one SGD step on the likelihood of another prompt's answer: every weight moves
    target = before[2]
    x = torch.tensor([ids[0] + target])
    logits = model(x).logits[0, len(ids[0]) - 1 : -1]
    torch.nn.functional.cross_entropy(logits, torch.tensor(target)).backward()
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    model.zero_grad()

    after = trainer.rollout_func(prompts, trainer)["completion_ids"]
    assert after == expected()
    assert after != before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("top_p", "min_p"),
    [(0.7, 0.0), (1.0, 0.2)],  # the nucleus decides the first, min_p the second
)
def test_sampled_first_tokens_follow_the_distribution_generate_samples(testbed_path, tmp_path, top_p, min_p):
    """The first token of 4000 rollouts of one prompt follows the softmax of the scores transformers'
    generate samples from under TRL's temperature, top_p and min_p (its processed scores), within 5 sigma;
    and neither the plain softmax nor the distribution without the filter that decides, so every knob
    is seen."""
    from sage.testbed.task import heldout_rows

    temperature, n = 1.3, 4000
    trainer = trainer_for(
        testbed_path,
        tmp_path,
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        max_completion_length=1,
        per_device_train_batch_size=n,
        num_generations=n,
    )
    model, tok = trainer.model, trainer.processing_class

    def distribution(prompt: str, temperature: float, top_p: float, min_p: float) -> torch.Tensor:
        """The next-token probabilities generate samples from after ``prompt``."""
        ids = torch.tensor([trainer._tokenize_prompts([prompt])[0][0]])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                min_p=min_p,
                top_k=0,
                max_new_tokens=1,
                pad_token_id=tok.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
        return torch.softmax(out.scores[0][0], -1)

    def alternatives(prompt: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The processed distribution, and those the rollouts must not follow: the plain softmax and the
        processed one without the filter under test."""
        plain = distribution(prompt, 1.0, 1.0, 0.0)
        unfiltered = distribution(prompt, temperature, 1.0, min_p if top_p < 1.0 else 0.0)
        return distribution(prompt, temperature, top_p, min_p), [plain, unfiltered]

    def has_power(prompt: str) -> bool:
        """Several tokens kept, none dominant, and for each alternative some token whose count under it
        would be 10 of its standard deviations away from its count under the processed distribution."""
        processed, others = alternatives(prompt)
        spread = processed.max() < 0.6 and (processed > 0).sum() >= 2
        return bool(
            spread and all(((processed - p).abs() * n > 10 * (n * p * (1 - p)).sqrt()).any() for p in others)
        )

    # Which prefix leaves the next token open depends on the build's weights (they differ between CPUs):
    # take the first prefix of a held-out problem that gives the check its power
    candidates = [r["problem"][:k] for r in heldout_rows(40) for k in range(1, len(r["problem"]) + 1)]
    prompt = next((c for c in candidates if has_power(c)), None)
    assert prompt is not None, "no held-out prefix has a spread next-token distribution"
    processed, others = alternatives(prompt)

    first = torch.tensor([c[0] for c in trainer.rollout_func([prompt] * n, trainer)["completion_ids"]])
    assert set(first.tolist()) <= set((processed > 0).nonzero().squeeze(1).tolist())

    def within_5_sigma(p: torch.Tensor) -> bool:
        counts = torch.bincount(first, minlength=len(p)).double()
        p = p.double()
        return bool(((counts - n * p).abs() <= 5 * (n * p * (1 - p)).sqrt() + 1e-9).all())

    assert within_5_sigma(processed)
    assert not any(within_5_sigma(p) for p in others)


@pytest.mark.slow
def test_a_rollout_is_a_function_of_seed_step_and_call(testbed_path, tmp_path):
    """Two rollout functions (an uninterrupted run's and a resumed one's) sample the same at the same step
    and call; the next call, another step or another seed samples differently."""
    from sage.testbed.task import arith_dataset

    trainer = trainer_for(testbed_path, tmp_path)
    prompts = repeated(arith_dataset(4, 2)["prompt"], 4)
    first, resumed = CompactRollout(trainer.args, lora=None), CompactRollout(trainer.args, lora=None)

    def sample(rollout):
        return rollout(prompts, trainer)["completion_ids"]

    trainer.state.global_step = 5
    a = sample(first)
    assert sample(resumed) == a
    again = sample(first)
    assert again != a and sample(resumed) == again  # the second call of a step has a seed of its own
    trainer.state.global_step = 6
    assert sample(first) != a
    other = copy.copy(trainer.args)
    other.seed = trainer.args.seed + 1
    trainer.state.global_step = 5
    assert sample(CompactRollout(other, lora=None)) != a


# ------------------------------------------------------------------------------------------ sage-train
SHRINK = [
    "trl.per_device_train_batch_size=16",
    "trl.num_generations=4",
    "trl.save_steps=1",
    "trl.lr_scheduler_type=constant",  # a 1-step run's first step is a 2-step run's
    "trl.warmup_steps=0",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=6",
]


def sage_train(*overrides: str) -> subprocess.CompletedProcess:
    r = prefork.run(
        [sys.executable, "-m", "sage.train", "rollout=fast", *SHRINK, *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def steps(out) -> list[dict]:
    log = json.loads((out / "train_log.json").read_text())
    return [{k: v for k, v in e.items() if k != "step_time"} for e in log if "loss" in e]


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_sage_train_with_fast_rollouts_trains_evaluates_and_resumes_exactly(testbed_path, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    r = sage_train("trl.max_steps=2", f"output_dir={straight}")
    assert "| base | arith_heldout |" in r.stdout and "| trained | arith_heldout |" in r.stdout
    logged = steps(straight)
    assert [e["step"] for e in logged] == [1, 2]
    assert all(e["completions/mean_length"] > 0 and "reward" in e for e in logged)
    metrics = json.loads((straight / "metrics.json").read_text())
    assert (
        0.0 <= metrics["pass_at_1/trained/arith_heldout"] <= metrics["pass_at_4/trained/arith_heldout"] <= 1.0
    )
    base, final = weights(Path(testbed_path)), weights(straight / "final")
    assert any(not torch.equal(base[k], final[k]) for k in final)  # it trained

    # stopped after step 1 and resumed: the rollouts of step 2 are drawn as the uninterrupted run drew them
    sage_train("trl.max_steps=1", f"output_dir={stopped}", "eval.at_end=false")
    sage_train("trl.max_steps=2", f"output_dir={stopped}", "eval.at_end=false", "resume=true")
    assert steps(stopped) == logged  # every logged figure of both steps, exactly
    resumed = weights(stopped / "final")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
