"""The importance-sampling correction of a vLLM rollout without TRL's extra log-prob pass
(sage/train/deferred_ratio.py): when the policy cannot move between a generation batch and its last
micro-batch, the ratio comes from the loss pass's own log-probs. Against TRL's own path (its no-grad pass over
every completion), on the same model, data and engine log-probs: the same logged ratio metrics and the same
weights after two optimiser steps, in every importance-sampling mode, with one no-grad policy pass fewer per
generation batch, and the same importance-weight figures (spread, tail, cut share, truncated mass). Also the
one-line warnings: when the first ratio starts away from 1, and at any step when the weights spread past their
bounds (sage.train.importance, on hand-computed cases).

The engine is a stand-in (no vLLM): completions drawn from a seeded generator, with "engine" log-probs equal
to the policy's own at the sampling temperature plus a seeded offset per token, so that ratios spread on both
sides of 1 and the clip bounds truncate or mask some of them."""

from __future__ import annotations

import logging

import pytest
import torch
from trl import GRPOConfig

from sage.objective.divergences import ReverseKL
from sage.objective.guides import NoGuide
from sage.testbed.task import arith_dataset
from sage.train import importance
from sage.train.callbacks import FirstRatioCheck
from sage.train.deferred_ratio import vllm_importance_ratio
from sage.train.trainer import SageGRPOTrainer

LENGTH = 10


@pytest.fixture
def model_path(small_testbed_model):
    return small_testbed_model


class StandInEngine:
    """A rollout function with an engine's interface (``attach``, ``sync_weights``): seeded completions and
    log-probs = the policy's at the trainer's temperature + a seeded offset in [-spread, spread]."""

    def __init__(self, spread: float) -> None:
        self.spread = spread
        self.calls = 0

    def attach(self, trainer):
        return self

    def sync_weights(self) -> None:
        pass

    def __call__(self, prompts, trainer) -> dict:
        prompt_ids = trainer._tokenize_prompts(prompts)[0]
        g = torch.Generator().manual_seed(1000 + self.calls)
        self.calls += 1
        vocab = trainer.model.config.vocab_size
        completions, logprobs = [], []
        for p in prompt_ids:
            c = torch.randint(4, vocab, (LENGTH,), generator=g)
            with torch.no_grad():
                logits = trainer.model(input_ids=torch.tensor([p + c.tolist()])).logits[0, len(p) - 1 : -1]
            own = torch.log_softmax(logits.float() / trainer.temperature, -1).gather(1, c[:, None])[:, 0]
            offset = (torch.rand(LENGTH, generator=g) * 2 - 1) * self.spread
            completions.append(c.tolist())
            logprobs.append((own + offset).tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}


class WithTrlPass(SageGRPOTrainer):
    """TRL's own path: its no-grad log-prob pass computes the ratio when the batch is generated."""

    def _policy_fixed_through_generation_batch(self) -> bool:
        return False


def counting(cls):
    """``cls`` counting its no-grad log-prob passes of the policy (the loss pass has gradients, the
    reference's pass another model)."""

    class Counting(cls):
        no_grad_policy_passes = 0

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if not torch.is_grad_enabled() and model is self.model:
                type(self).no_grad_policy_passes += 1
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    return Counting


def reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


def train(cls, path, tmp, mode: str, clip_min, clip_max):
    args = GRPOConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # two micro-batches per generation batch, one optimiser step
        num_generations=4,
        max_completion_length=LENGTH,
        beta=0.04,
        use_bias_correction_kl=False,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        temperature=0.7,
        min_p=0.01,
        top_p=0.9,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
        report_to="none",
        max_steps=2,
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        disable_dropout=True,
        seed=3,
    )
    trainer = counting(cls)(
        model=path,
        reward_funcs=[reward],
        args=args,
        train_dataset=arith_dataset(32, 0),
        divergence=ReverseKL(0.04),
        guide=NoGuide(),
        rollout_func=StandInEngine(spread=0.25),
    )
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    trainer.train()
    return trainer


KEYS = [
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    importance.SPREAD_KEY,
    importance.TAIL_KEY,
    importance.CUT_KEY,
    importance.MASS_KEY,
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,clip_min,clip_max",
    [
        ("sequence_mask", None, 3.0),  # TRL's default mode and upper bound
        ("sequence_truncate", 0.5, 1.5),
        ("token_mask", 0.85, 1.15),
        ("token_truncate", 0.9, 1.1),
    ],
)
def test_the_loss_pass_ratio_equals_trls_pass_with_one_pass_fewer(
    model_path, tmp_path, caplog, mode, clip_min, clip_max
):
    with caplog.at_level(logging.WARNING, logger="sage.train.deferred_ratio"):
        ours = train(SageGRPOTrainer, model_path, tmp_path / "ours", mode, clip_min, clip_max)
    warned = [r.getMessage() for r in caplog.records if "the importance weights" in r.getMessage()]
    theirs = train(WithTrlPass, model_path, tmp_path / "theirs", mode, clip_min, clip_max)
    logged = [[e for e in t.state.log_history if KEYS[1] in e] for t in (ours, theirs)]
    assert len(logged[0]) == len(logged[1]) == 2
    # a step warns in one line exactly when its figures pass a bound: token_mask's [0.85, 1.15] cuts the
    # tokens whose offset exceeds about 0.15 in [-0.25, 0.25], some 40% of them
    over = [
        step
        for step, e in enumerate(logged[0], start=1)
        if e[importance.SPREAD_KEY] > importance.SPREAD_BOUND or e[importance.CUT_KEY] > importance.CUT_BOUND
    ]
    assert [int(line.split(":")[0].removeprefix("step ")) for line in warned] == over, warned
    if mode == "token_mask":
        assert over == [1, 2] and all("token_mask masked" in line for line in warned), warned
    for a, b in zip(*logged, strict=True):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    spread = [e[KEYS[2]] - e[KEYS[0]] for e in logged[1]]
    assert min(spread) > 0.05, "the stand-in's ratios do not spread: the comparison is void"
    # offsets uniform in [-0.25, 0.25] over 10 tokens: per-sequence log-ratios of SD 0.25 / sqrt(3) * sqrt(10)
    assert all(0.2 < e[importance.SPREAD_KEY] < 0.8 for e in logged[0]), logged[0]
    # min_p 0.01 and top_p 0.9 at temperature 0.7 cut some mass of the tiny model's next-token distributions
    assert all(0.0 < e[importance.MASS_KEY] < 0.5 for e in logged[0]), logged[0]
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    start = build_state(model_path)
    assert any(not torch.equal(p, start[n]) for n, p in ours.model.named_parameters()), "nothing trained"
    # TRL's path: one no-grad pass of the policy per generation batch (2 steps), ours none
    assert type(theirs).no_grad_policy_passes - type(ours).no_grad_policy_passes == 2


def build_state(path) -> dict:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())


def test_the_ratio_rule_by_hand():
    """vllm_importance_ratio on a hand-computed case: token modes keep the (B, T) ratio, sequence modes sum
    the masked log-differences; truncation clamps, masking zeroes; a NaN engine log-prob counts as ratio 1."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    sampling = torch.tensor([[-1.5, -1.5, float("nan")], [-0.5, -0.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    e = torch.exp
    token = vllm_importance_ratio(logps, sampling, mask, "token_truncate", None, 10.0)
    torch.testing.assert_close(
        token, torch.stack([e(torch.tensor([0.5, -0.5, 0.0])), e(torch.tensor([0.0, -0.3, 0.0]))])
    )
    seq = vllm_importance_ratio(logps, sampling, mask, "sequence_truncate", 0.0, None)
    torch.testing.assert_close(seq, e(torch.tensor([[0.0], [-0.3]])))
    masked = vllm_importance_ratio(logps, sampling, mask, "token_mask", 0.6, 1.5)
    torch.testing.assert_close(masked[0], torch.tensor([0.0, e(torch.tensor(-0.5)).item(), 1.0]))
    clamped = vllm_importance_ratio(logps, sampling, mask, "sequence_truncate", 0.8, 1.0)
    torch.testing.assert_close(clamped, torch.tensor([[1.0], [0.8]]))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        vllm_importance_ratio(logps, sampling, mask, "tokens", None, None)


@pytest.mark.parametrize("ratio,warned", [(0.834, True), (1.12, True), (0.97, False), (1.04, False)])
def test_a_first_ratio_away_from_one_is_one_warning_line(caplog, ratio, warned):
    check = FirstRatioCheck()
    with caplog.at_level(logging.WARNING, logger="sage.train.callbacks"):
        check.on_log(None, None, None, logs={"loss": 0.1})  # a log without the ratio: nothing checked
        check.on_log(None, None, None, logs={"sampling/importance_sampling_ratio/mean": ratio})
        check.on_log(None, None, None, logs={"sampling/importance_sampling_ratio/mean": 0.5})  # later: not
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert f"{ratio:.3f}" in lines[0] and "\n" not in lines[0]


def test_the_weight_figures_by_hand():
    """weight_sums / weight_figures on a hand-computed batch. Per-sequence log-ratios (masked sums of
    logps - sampling, a NaN engine log-prob adding 0): [0.5 + 0.5 + 0, 0 - 0.3, (no token), -0.9 + 0 + 0]
    = [1.0, -0.3, -0.9], the empty sequence left out. Mean -0.0667, E[x^2] = 1.9 / 3 = 0.63333, variance
    0.63333 - 0.00444 = 0.62889, SD 0.79303; |x| > log 2 for 1.0 and -0.9: tail 2/3."""
    logps = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -0.8, -0.5], [-1.0, -1.0, -1.0], [-2.0, -1.0, -1.0]])
    sampling = torch.tensor(
        [[-1.5, -1.5, float("nan")], [-0.5, -0.5, -9.0], [0.0, 0.0, 0.0], [-1.1, -1.0, -1.0]]
    )
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(
        importance.sequence_log_ratios(logps, sampling, mask), torch.tensor([1.0, -0.3, 0.0, -0.9])
    )

    def figures(mode, clip_min, clip_max):
        return importance.weight_figures(
            importance.weight_sums(logps, sampling, mask, mode, clip_min, clip_max)
        )

    f = figures("sequence_mask", None, 3.0)  # log 3 = 1.0986: no sequence above
    assert f[importance.SPREAD_KEY] == pytest.approx(0.79303, abs=1e-5)
    assert f[importance.TAIL_KEY] == pytest.approx(2 / 3)
    assert f[importance.CUT_KEY] == 0.0
    # a lower bound 0.5 (log -0.693) cuts the sequence at -0.9: 1 of 3
    assert figures("sequence_truncate", 0.5, 3.0)[importance.CUT_KEY] == pytest.approx(1 / 3)
    # token level, bounds [0.85, 1.15] (logs -0.163, 0.140): of the 8 tokens that count (the NaN one at 0),
    # 0.5, 0.5, -0.3 and -0.9 are outside
    assert figures("token_mask", 0.85, 1.15)[importance.CUT_KEY] == pytest.approx(0.5)
    # micro-batches add up: the two halves' sums give the whole batch's figures
    halves = sum(
        importance.weight_sums(logps[i], sampling[i], mask[i], "sequence_mask", None, 3.0)
        for i in (slice(0, 2), slice(2, 4))
    )
    assert importance.weight_figures(halves) == pytest.approx(f)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance.weight_sums(logps, sampling, mask, "tokens", None, None)


@pytest.mark.parametrize(
    "spread,cut,mode,named",
    [
        (0.79, 0.0, "sequence_mask", ["standard deviation is 0.790 (bound 0.5)"]),
        (0.2, 0.08, "sequence_mask", ["sequence_mask masked 8.0% of the sequences (bound 5%)"]),
        (0.6, 0.3, "token_truncate", ["0.600", "token_truncate clipped 30.0% of the tokens"]),
        (0.5, 0.05, "sequence_mask", None),  # at the bounds: no warning
        (0.1, 0.0, "sequence_mask", None),
    ],
)
def test_weights_past_their_bounds_are_one_warning_line_at_any_step(spread, cut, mode, named):
    figures = {importance.SPREAD_KEY: spread, importance.TAIL_KEY: 0.0, importance.CUT_KEY: cut}
    line = importance.weight_warning(figures, mode, step=37)
    if named is None:
        assert line is None
        return
    assert line.startswith("step 37: ") and "\n" not in line
    for part in named:
        assert part in line, line


def test_the_computed_figures_of_a_spread_batch_warn():
    """From tensors to the line: log-ratios of +-0.8 per sequence (SD 0.8) under sequence_mask cap 2 (log
    0.693): every sequence is masked, both bounds are passed."""
    logps = torch.zeros(4, 2)
    sampling = torch.tensor([[-0.4, -0.4], [0.4, 0.4], [-0.4, -0.4], [0.4, 0.4]])
    sums = importance.weight_sums(logps, sampling, torch.ones(4, 2), "sequence_mask", None, 2.0)
    figures = importance.weight_figures(sums)
    assert figures[importance.SPREAD_KEY] == pytest.approx(0.8)
    assert figures[importance.CUT_KEY] == pytest.approx(0.5)  # the two at +0.8 > log 2
    line = importance.weight_warning(figures, "sequence_mask", step=1)
    assert "0.800" in line and "50.0% of the sequences" in line


def test_the_truncated_mass_by_hand():
    """Probabilities [0.5, 0.3, 0.15, 0.04, 0.01] (logits their logs). min_p 0.1 keeps p >= 0.05: removes
    0.05; min_p 0.01 (threshold 0.005) removes nothing; top_k 2 removes 0.2; top_p 0.7 keeps 0.5 and 0.3
    (the mass before 0.15 is 0.8 >= 0.7): removes 0.2; top_p 0.9 keeps 0.15 too (0.8 < 0.9): removes 0.05.
    min_p 0.4 (threshold 0.2) then top_p 0.6 on the renormalised [0.625, 0.375]: keeps 0.5 only, removes
    0.5. Nothing set: 0."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01]])
    logits = probs.log() + 3.0  # any shift: the softmax is the same
    for keys, removed in [
        ((0.1, 1.0, 0), 0.05),
        ((0.01, 1.0, 0), 0.0),
        ((0.0, 1.0, 2), 0.2),
        ((0.0, 0.7, 0), 0.2),
        ((0.0, 0.9, None), 0.05),
        ((0.4, 0.6, 0), 0.5),
        ((None, None, None), 0.0),
    ]:
        mass = importance.truncation_mass(logits, *keys)
        assert mass.shape == (1,)
        assert mass.item() == pytest.approx(removed, abs=1e-6), keys
        assert importance.truncation_active(*keys) == (removed > 0 or keys[0] == 0.01)
