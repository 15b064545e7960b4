"""rollout=vllm (sage/train/vllm_rollout.py): training rollouts from a real vLLM engine (its CPU build here)
that serves the LoRA policy as an adapter, handed over after every optimiser step.

Through SageGRPOTrainer's real training loop: at every rollout of every step, the engine's greedy decode
under the served adapter equals the current policy's (merged) greedy decode, token for token, and the
engine's log-probs of the tokens it sampled are the policy's own, which TRL's importance-sampling correction
reads; a rollout is a function of (seed, step, process, call), as a resumed run needs; 200 adapter hand-overs
leave the engine's memory within a stated bound; what vLLM cannot serve as an adapter is refused in one
line before any model is built."""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
from types import SimpleNamespace

import prefork
import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from peft import LoraConfig
from trl import GRPOConfig

from sage.config import ConfigError
from sage.train import importance
from sage.train.vllm_rollout import VllmRollout

GREEDY_TOKENS = 40  # compared per prompt (the issue asks for at least 32)
LOGPROB_TOLERANCE = 2e-3  # float32 on both sides; vLLM's LoRA kernels sum in another order than peft's
RANK = 64  # a large adapter for the tiny model, so that a leak of each version would show in the RSS
SWAPS = 200


def grpo_args(tmp_path, **config) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=GREEDY_TOKENS,
        beta=0.04,
        use_bias_correction_kl=False,
        learning_rate=3e-2,  # large, so that two steps change what the policy decodes greedily
        lr_scheduler_type="constant",
        # trl=paper's min_p with a temperature other than 1 and top-p: the engine's log-probs must still be
        # the trainer's (at the temperature, before truncation)
        temperature=0.7,
        top_p=0.9,
        min_p=0.01,
        report_to="none",
        max_steps=2,
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        disable_dropout=True,
        seed=5,
    )
    return GRPOConfig(**{**settings, **config})


LORA = dict(
    r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"
)


def length_reward(completions, **kwargs):
    """Rewards that differ within a group (GRPO learns nothing from equal ones)."""
    return [float(len(c) % 7) for c in completions]


def merged_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The policy as it is now (a LoRA policy merged into its base: peft's merge of a copy), decoding
    greedily for ``n`` tokens past any eos; with the top-2 logit margin at each position (a near tie can go
    either way)."""
    merged = copy.deepcopy(model)
    merged = (merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            tokens, margins = [], []
            for _ in range(n):
                logits = merged(input_ids=torch.tensor([seq])).logits[0, -1]
                top = torch.topk(logits, 2)
                tokens.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                seq.append(tokens[-1])
            out.append((tokens, margins))
    return out


def engine_greedy(rollout: VllmRollout, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams

    from sage.vllm_engine import generate_block

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outputs = generate_block(rollout.llm, prompts, params, rollout.request, seed=0)
    return [list(o.outputs[0].token_ids) for o in outputs]


class CheckedRollout(VllmRollout):
    """VllmRollout that, at each training rollout, first decodes greedily through the engine and through
    the merged policy, and after it recomputes the sampled tokens' log-probs under the policy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[dict] = []

    def __call__(self, prompts, trainer):
        prompt_ids = trainer._tokenize_prompts(prompts)[0]
        distinct = [p for i, p in enumerate(prompt_ids) if i == 0 or p != prompt_ids[i - 1]][:4]
        check = {
            "step": trainer.state.global_step,
            "version": self.version,
            "engine": engine_greedy(self, distinct, GREEDY_TOKENS),
            "policy": merged_greedy(self.model, distinct, GREEDY_TOKENS),
        }
        out = super().__call__(prompts, trainer)
        # the policy's log-probs of what the engine sampled, at TRL's temperature
        diffs = []
        with torch.no_grad():
            for p, c, lps in zip(
                out["prompt_ids"][:8], out["completion_ids"][:8], out["logprobs"][:8], strict=True
            ):
                logits = self.model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
                own = torch.log_softmax(logits.float() / trainer.temperature, -1)
                own = own.gather(1, torch.tensor(c)[:, None])[:, 0]
                diffs.append(float((own - torch.tensor(lps)).abs().max()))
        check["logprob_diff"] = max(diffs)
        self.checks.append(check)
        return out


def train_checked(tmp, lora: LoraConfig | None, model: str | None = None):
    """Two steps of SageGRPOTrainer with the checked rollout, on a policy whose weights were moved off the
    base before the first step; returns the trainer and its rollout (its engine still up)."""
    from sage.objective.divergences import ReverseKL
    from sage.objective.guides import NoGuide
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import arith_dataset
    from sage.train.trainer import SageGRPOTrainer
    from sage.train.trl_import import import_grpo_trainer

    import_grpo_trainer(use_vllm=True)
    args = grpo_args(tmp)
    rollout = CheckedRollout(args, lora, dtype="float32", engine_dtype="float32", cpu_memory_utilization=0.1)
    trainer = SageGRPOTrainer(
        model=model or build_tiny_model(),
        reward_funcs=[length_reward],
        args=args,
        train_dataset=arith_dataset(64, 0),
        peft_config=lora,
        divergence=ReverseKL(0.04),
        guide=NoGuide(),
        rollout_func=rollout,
    )
    # peft starts B at 0 (the adapter a no-op): a policy that differs from the base from the first step on
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ("lora_B" in name) if lora is not None else ("proj" in name):
                p.add_((0.05 if lora is not None else 0.02) * torch.randn(p.shape, generator=gen))
    trainer.train()
    return trainer, rollout


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer, rollout = train_checked(tmp_path_factory.mktemp("vllm_rollout"), LoraConfig(**LORA))
    yield trainer, rollout
    rollout.close()


def agreed_prefix(engine: list[int], policy: tuple[list[int], list[float]]) -> int:
    """Tokens the two greedy decodes share from the start."""
    tokens, _ = policy
    n = 0
    while n < len(tokens) and n < len(engine) and engine[n] == tokens[n]:
        n += 1
    return n


@pytest.mark.slow
@pytest.mark.vllm
def test_the_served_adapter_is_the_current_policy_at_every_step(trained):
    """At step 0 and at step 1 (after an optimiser step), the engine serves a new adapter version, and its
    greedy decode equals the merged policy's, token for token over GREEDY_TOKENS tokens per prompt; a
    disagreement is allowed only after a position where the policy's top-2 logits are within 1e-4 (a tie
    either side may break). The adapter matters: the policy's decode changed between the two steps."""
    check_served_policy(trained[1])


@pytest.mark.slow
@pytest.mark.vllm
def test_full_fine_tuning_is_served_as_weights_reloaded_in_place(tmp_path):
    """model.lora=null: after each optimiser step the whole policy is written and vLLM reloads it in place
    (the CPU build packs the reloaded weights again); the engine's greedy decode at steps 0 and 1 is the
    policy's, as for an adapter. The testbed model ties its output layer to its embeddings, which vLLM
    0.31 does not reload: that is refused before the first step, and an untied copy trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sage.testbed.model import build_tiny_model

    with pytest.raises(ConfigError, match="tied to its embeddings"):
        train_checked(tmp_path / "tied", None)
    tied = AutoModelForCausalLM.from_pretrained(build_tiny_model())
    untied = AutoModelForCausalLM.from_config(
        tied.config.__class__(**{**tied.config.to_dict(), "tie_word_embeddings": False})
    )
    untied.load_state_dict({**tied.state_dict(), "lm_head.weight": tied.lm_head.weight.detach().clone()})
    untied.save_pretrained(tmp_path / "untied")
    AutoTokenizer.from_pretrained(build_tiny_model()).save_pretrained(tmp_path / "untied")
    trainer, rollout = train_checked(tmp_path, None, str(tmp_path / "untied"))
    try:
        assert rollout.request is None
        check_served_policy(rollout)
        key = "sampling/importance_sampling_ratio/mean"
        assert [abs(e[key] - 1) < 0.01 for e in trainer.state.log_history if key in e] == [True, True]
    finally:
        rollout.close()


def check_served_policy(rollout) -> None:
    assert [c["step"] for c in rollout.checks] == [0, 1]
    versions = [c["version"] for c in rollout.checks]
    assert versions[1] > versions[0]
    for check in rollout.checks:
        for engine, policy in zip(check["engine"], check["policy"], strict=True):
            n = agreed_prefix(engine, policy)
            if n < GREEDY_TOKENS:
                assert min(policy[1][: n + 1]) < 1e-4, (check["step"], n, engine, policy[0])
            else:
                assert engine == policy[0]
    before, after = ([t for t, _ in c["policy"]] for c in rollout.checks)
    assert before != after, "two optimiser steps did not change the policy's greedy decode: the check is void"


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_logprobs_are_the_policys_and_reach_trls_correction(trained):
    """The log-probs the engine returns for the tokens it sampled equal the policy's own at TRL's
    temperature, within LOGPROB_TOLERANCE; TRL computed its importance-sampling ratio from them."""
    trainer, rollout = trained
    assert max(c["logprob_diff"] for c in rollout.checks) < LOGPROB_TOLERANCE
    key = "sampling/importance_sampling_ratio/mean"
    ratios = [entry[key] for entry in trainer.state.log_history if key in entry]
    assert len(ratios) == 2 and all(abs(r - 1) < 0.01 for r in ratios), ratios


@pytest.mark.slow
@pytest.mark.vllm
def test_a_rollout_is_a_function_of_seed_step_process_and_call(trained):
    """What a resumed run draws: a fresh rollout object (no memory of earlier calls) at the same step draws
    the same completions, on vLLM's batched path at a size where per-request seeds once crashed the CPU
    build (chunked prefill); the next call of the same step draws others."""
    trainer, rollout = trained
    prompts = [r["prompt"] for r in trainer.train_dataset.select(range(16))]
    batch = [p for p in prompts for _ in range(8)]  # 128 sequences
    first = rollout(batch, trainer)["completion_ids"]
    second_call = rollout(batch, trainer)["completion_ids"]
    rollout._last_call = (-1, True, -1)  # as a resumed run's new rollout object starts
    again = rollout(batch, trainer)["completion_ids"]
    assert again == first and second_call != first


@pytest.mark.slow
@pytest.mark.vllm
def test_two_hundred_adapter_swaps_keep_the_engines_memory_bounded(trained):
    """Dynamic LoRA loading is known to leak host memory. Bound: the engine's processes grow by less than
    a quarter of what keeping every version would take (adapter size x swaps) from swap 20 to swap 200,
    and only one version stays loaded and on disk."""
    from pathlib import Path

    _, rollout = trained
    engine = [
        c
        for c in psutil.Process().children(recursive=True)
        if "EngineCore" in c.name() or "VllmWorker" in c.name()
    ]
    assert engine, "no engine process found"

    def rss() -> int:
        return sum(p.memory_info().rss for p in engine)

    gen = torch.Generator().manual_seed(1)
    sizes = []
    for i in range(SWAPS):
        with torch.no_grad():
            for name, p in rollout.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.001 * torch.randn(p.shape, generator=gen))
        rollout.sync_weights()
        if i == 19:
            start = rss()
        sizes.append(sum(f.stat().st_size for f in Path(rollout.request.lora_path).iterdir()))
    growth = rss() - start
    adapter = statistics.median(sizes)
    assert growth < 0.25 * adapter * (SWAPS - 20), (growth, adapter)
    assert set(rollout.llm.llm_engine.list_loras()) == {rollout.request.lora_int_id}
    served = Path(rollout.request.lora_path)
    assert [p.name for p in served.parent.iterdir()] == [served.name]
    handover = statistics.median(rollout.handover_seconds)
    print(
        f"adapter {adapter / 2**20:.1f} MiB, RSS growth over {SWAPS - 20} swaps {growth / 2**20:.1f} MiB, "
        f"median hand-over {handover * 1000:.0f} ms"
    )


class Recorded(VllmRollout):
    """VllmRollout that keeps what it returned, so that another trainer can train on the same completions."""

    def __call__(self, prompts, trainer):
        self.out = super().__call__(prompts, trainer)
        return self.out


class Replay:
    """A rollout function that returns recorded completions, without log-probs: TRL's own path, with no
    importance-sampling correction (as rollout=hf)."""

    def __init__(self, out: dict) -> None:
        self.out = out

    def __call__(self, prompts, trainer):
        assert trainer._tokenize_prompts(prompts)[0] == self.out["prompt_ids"]
        # the log-probs are returned as TRL asks of a rollout function; without an engine TRL corrects nothing
        return {k: self.out[k] for k in ("prompt_ids", "completion_ids", "logprobs")}


def token_reward(completion_ids, **kwargs):
    """Prefers some tokens: the share of a completion's tokens whose id is even (frequent enough in the
    testbed model's samples that the rewards of a group differ)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def one_step_grad_norm(tmp, rollout, lora: LoraConfig) -> float:
    from sage.objective.divergences import NoDivergence
    from sage.objective.guides import NoGuide
    from sage.testbed.model import build_tiny_model
    from sage.testbed.task import arith_dataset
    from sage.train.trainer import SageGRPOTrainer

    args = grpo_args(tmp, beta=0.0, max_steps=1, temperature=1.0, top_p=1.0, min_p=0.01, max_grad_norm=1e9)
    trainer = SageGRPOTrainer(
        model=build_tiny_model(),
        reward_funcs=[token_reward],
        args=args,
        train_dataset=arith_dataset(64, 0),
        peft_config=lora,
        divergence=NoDivergence(),
        guide=NoGuide(),
        rollout_func=rollout,
    )
    trainer.train()
    return next(e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e), trainer


@pytest.mark.slow
@pytest.mark.vllm
def test_under_the_papers_sampling_the_policy_gradient_is_not_shrunk(tmp_path):
    """trl=paper's sampling (min_p 0.01, temperature 1), divergence=none, a reward that prefers some tokens:
    one step on vLLM's rollouts, with TRL's importance-sampling correction, moves the adapter as one step
    on the same completions without the correction (the rollout=hf path) does: gradient norms within 10%.
    With vLLM's processed log-probs (after min-p), every sequence's ratio was the product of (1 - mass
    removed) over its tokens, which shrank the norm by that factor."""
    from sage.train.trl_import import import_grpo_trainer

    import_grpo_trainer(use_vllm=True)
    lora = LoraConfig(**{**LORA, "r": 8})
    args = grpo_args(tmp_path / "a", beta=0.0, temperature=1.0, top_p=1.0, min_p=0.01)
    engine = Recorded(args, lora, dtype="float32", engine_dtype="float32", cpu_memory_utilization=0.1)
    try:
        corrected, trainer = one_step_grad_norm(tmp_path / "vllm", engine, lora)
    finally:
        engine.close()
    key = "sampling/importance_sampling_ratio/mean"
    ratio = next(e[key] for e in trainer.state.log_history if key in e)
    plain, _ = one_step_grad_norm(tmp_path / "hf", Replay(engine.out), lora)
    print(f"gradient norm with the correction {corrected:.5f}, without {plain:.5f}; ratio mean {ratio:.5f}")
    assert plain > 0, "the reward did not vary within a group: the check is void"
    assert abs(corrected / plain - 1) < 0.10, (corrected, plain, ratio)
    assert 0.95 <= ratio <= 1.05, ratio


# ------------------------------------------------------------------------------ refused before any model
def args_for(tmp_path, **config):
    return grpo_args(tmp_path, **config)


@pytest.mark.parametrize(
    ("lora", "config", "named"),
    [
        ({"use_dora": True}, {}, "model.lora.use_dora=true (DoRA)"),
        ({"modules_to_save": ["lm_head"]}, {}, "model.lora.modules_to_save=['lm_head']"),
        ({"bias": "all"}, {}, "model.lora.bias=all"),
        ({"r": 1024}, {}, "model.lora.r=1024"),
        ({"target_modules": ["q_proj", "lm_head"]}, {}, "model.lora.target_modules naming lm_head"),
        ({"target_modules": r".*\.(embed_tokens|q_proj)"}, {}, "target_modules naming embed_tokens"),
        ({}, {"use_vllm": True}, "trl.use_vllm=true"),
        ({}, {"vllm_tensor_parallel_size": 2}, "trl.vllm_tensor_parallel_size=2"),
    ],
)
def test_what_vllm_cannot_serve_as_an_adapter_is_refused_in_one_line(tmp_path, lora, config, named):
    peft_config = None if lora is None else LoraConfig(**{**LORA, **lora})
    with pytest.raises(ConfigError) as e:
        VllmRollout(args_for(tmp_path, **config), peft_config, dtype="float32", cpu_memory_utilization=0.1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("rollout=vllm serves the policy") and named in message


def test_a_servable_adapter_is_accepted_without_starting_an_engine(tmp_path):
    rollout = VllmRollout(
        args_for(tmp_path),
        LoraConfig(**LORA),
        dtype="float32",
        engine_dtype="float32",
        cpu_memory_utilization=0.1,
    )
    assert rollout.llm is None and rollout.rank == RANK
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), model=SimpleNamespace(training=True))
    trainer.accelerator = SimpleNamespace(process_index=1)
    assert rollout.call_id(trainer) == (3, 1, 0) and rollout.call_id(trainer) == (3, 1, 1)


@pytest.mark.parametrize(
    ("share", "free_gib", "refused"), [(0.9, 64.0, True), (0.5, 64.0, False), (0.8, 64.0, False)]
)
def test_an_engine_share_larger_than_what_is_free_is_refused_in_one_line(share, free_gib, refused):
    """An 80 GiB GPU with 16 GiB held (a policy left behind): 0.9 of it is not free, 0.8 is."""
    from sage.vllm_engine import check_gpu_share

    gib = 2**30
    if not refused:
        check_gpu_share("eval.vllm_gpu_memory_utilization", share, int(free_gib * gib), 80 * gib)
        return
    with pytest.raises(ConfigError) as e:
        check_gpu_share("eval.vllm_gpu_memory_utilization", share, int(free_gib * gib), 80 * gib)
    assert str(e.value) == (
        "eval.vllm_gpu_memory_utilization=0.9 asks 72.0 GiB of this GPU's 80.0 GiB, but 64.0 GiB are free: "
        "set eval.vllm_gpu_memory_utilization to at most 0.8"
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_a_block_reports_its_progress_as_each_prompts_samples_finish(trained):
    """generate_block's progress hears of each request's completions as it finishes, not once per block:
    a long evaluation block shows its progress."""
    from vllm import SamplingParams

    from sage.vllm_engine import generate_block

    trainer, rollout = trained
    prompts = trainer._tokenize_prompts([r["prompt"] for r in trainer.train_dataset.select(range(6))])[0]
    heard: list[int] = []
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8)
    outputs = generate_block(rollout.llm, prompts, params, rollout.request, seed=1, progress=heard.append)
    assert len(outputs) == 6 and heard == [3] * 6


# ---------------------------------------------------------------------- the weights watched, through the CLI
WATCHED = [
    "model=tiny_chat",
    "model.sft.data.n=64",
    "model.sft.args.num_train_epochs=1",
    "trl.max_steps=2",
    "trl.per_device_train_batch_size=8",
    "trl.num_generations=4",
    "rollout=vllm",
    "eval.at_end=false",
]


@pytest.mark.slow
@pytest.mark.vllm
def test_sage_train_logs_the_weights_spread_cut_share_and_truncated_mass_every_step(tmp_path):
    """``sage-train model=tiny_chat rollout=vllm`` (shrunk): the importance weights' spread and tail, the
    share the correction mode cuts and the mass min_p 0.01 removed at the sampled tokens are in the run's
    MLflow history once per optimiser step, and in its train_log.json."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": store}
    out = tmp_path / "run"
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *WATCHED, f"output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    keys = [importance.SPREAD_KEY, importance.TAIL_KEY, importance.CUT_KEY, importance.MASS_KEY]
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("sage").experiment_id])
    for key in keys:
        history = client.get_metric_history(run.info.run_id, f"train/{key}")
        assert [m.step for m in history] == [1, 2], (key, history)
        assert all(m.value == m.value for m in history), key  # not NaN
    logged = [e for e in json.loads((out / "train_log.json").read_text()) if importance.SPREAD_KEY in e]
    assert len(logged) == 2
    for e in logged:
        assert e[importance.SPREAD_KEY] >= 0 and 0 <= e[importance.CUT_KEY] <= 1
        # trl=testbed's min_p 0.01 cuts some of the chat model's mass at the sampled tokens, and never most
        assert 0.0 < e[importance.MASS_KEY] < 0.5, e
