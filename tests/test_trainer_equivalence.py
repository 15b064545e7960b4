"""SageGRPOTrainer against the upstream it extends: on the same model and inputs, guide=none + reverse-KL k3
equals TRL's GRPO loss (and gradient) to 1e-6 for every loss type, and divergence=none equals TRL's beta=0
loss. A shaped guide changes the loss by exactly beta * aggregate(k3 to q * pi_ref) - beta * aggregate(k3).
A micro-batch gets the same q on every pass over it; DAPO's filter decides on rewards and counts tokens
as the loss masks them."""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from sage.objective.divergences import NoDivergence, ReverseKL, SequenceKL, k3
from sage.objective.guides import BranchGuide, ForkGuide, NoGuide, RandomGuide
from sage.objective.schedules import ConstantSchedule
from sage.testbed.model import build_tiny_model
from sage.testbed.task import FORK_MARKERS, arith_dataset
from sage.train.trainer import SageGRPOTrainer, aggregate


@pytest.fixture
def model_path(small_testbed_model):
    return small_testbed_model


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def make(cls, path, tmp, beta, loss_type, iw=False, config=None, **kw):
    settings = dict(
        use_bias_correction_kl=iw,
        output_dir=str(tmp),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        beta=beta,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        report_to="none",
        max_steps=1,
        gradient_checkpointing=False,
        disable_dropout=True,
        bf16=False,
    )
    args = GRPOConfig(**{**settings, **(config or {})})
    t = cls(model=path, reward_funcs=[zero_reward], args=args, train_dataset=arith_dataset(16, 0), **kw)
    t.model.train()
    t.current_gradient_accumulation_steps = (
        2  # set by Trainer's loop; 2 makes the accumulation scaling visible
    )
    return t


def fake_inputs(trainer, seed=0):
    """A generation batch as TRL's _generate_and_score_completions returns it: random completions with
    padding, advantages of both signs, old log-probs away from the current ones so that clipping fires,
    and a reference near the policy."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = 8, 5, 12
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    completion_ids = torch.randint(4, vocab, (B, T), generator=g)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones(B, P, dtype=torch.long), completion_mask], 1),
            T,
        )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "old_per_token_logps": logps + 0.3 * torch.randn(B, T, generator=g),
        "ref_per_token_logps": logps + 0.5 * torch.randn(B, T, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def loss_and_grad(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads


def shaped_term(trainer, inputs, beta, q_of):
    """beta * aggregate(k3 to q * pi_ref) - beta * aggregate(k3 to pi_ref), by hand from one forward pass of
    ``trainer``'s model (loss type grpo, the accumulation ``make`` sets); ``q_of(logps, entropies)`` is q."""
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, ent, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, am, inputs["completion_ids"].shape[1], compute_entropy=True
        )
        mask, ref = inputs["completion_mask"], inputs["ref_per_token_logps"]
        q = q_of(logps, ent)
        kw = dict(
            max_completion_length=12,
            num_items_in_batch=None,
            grad_accum_steps=2,
            steps_per_generation=trainer.args.steps_per_generation,
            num_processes=1,
            training=True,
        )
        return beta * (
            aggregate(k3(logps, ref + q.log()), mask, "grpo", **kw)
            - aggregate(k3(logps, ref), mask, "grpo", **kw)
        )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,iw", [(0.05, False), (0.05, True), (0.0, False)])
def test_matches_trl(model_path, tmp_path, loss_type, beta, iw):
    """iw=True is TRL 1.16's default (use_bias_correction_kl); iw=False is the paper's plain k3 term."""
    trl_t = make(GRPOTrainer, model_path, tmp_path / "trl", beta, loss_type, iw=iw)
    divergence = ReverseKL(beta=beta, estimator="k3", importance_weighted=iw) if beta else NoDivergence()
    sage_t = make(
        SageGRPOTrainer,
        model_path,
        tmp_path / "sage",
        beta,
        loss_type,
        iw=iw,
        divergence=divergence,
        guide=NoGuide(),
    )
    inputs = fake_inputs(trl_t)
    l_trl, g_trl = loss_and_grad(trl_t, inputs)
    l_sage, g_sage = loss_and_grad(sage_t, inputs)
    assert abs(l_trl.item()) > 1e-4  # a non-trivial loss
    assert torch.allclose(l_sage, l_trl, atol=1e-6, rtol=0), (l_sage, l_trl)
    assert torch.allclose(g_sage, g_trl, atol=1e-6, rtol=1e-5)
    if (
        beta and not iw
    ):  # the unshaped KL we log is TRL's own "kl" metric (TRL logs it ratio-weighted when iw)
        assert sage_t._metrics["train"]["kl"][-1] == pytest.approx(
            trl_t._metrics["train"]["kl"][-1], abs=1e-6
        )


def test_branch_guide_shifts_loss_by_the_shaped_term(model_path, tmp_path):
    beta = 0.05
    guide = BranchGuide(ratio=0.3, threshold=0.5)  # a low threshold so that the random model's tokens fire
    plain = make(
        SageGRPOTrainer, model_path, tmp_path / "a", beta, "grpo", divergence=ReverseKL(beta), guide=NoGuide()
    )
    shaped = make(
        SageGRPOTrainer, model_path, tmp_path / "b", beta, "grpo", divergence=ReverseKL(beta), guide=guide
    )
    inputs = fake_inputs(plain, seed=1)
    l_plain, _ = loss_and_grad(plain, inputs)
    l_shaped, _ = loss_and_grad(shaped, inputs)
    # Recompute the expected difference by hand from one forward pass.
    mask, ref = inputs["completion_mask"], inputs["ref_per_token_logps"]
    diff = shaped_term(
        plain,
        inputs,
        beta,
        lambda logps, ent: guide(logps=logps, ref_logps=ref, entropies=ent, mask=mask, step=0),
    )
    active = shaped._metrics["train"]["guide/active_frac"][-1]
    assert active > 0.05
    assert abs(diff.item()) > 1e-5
    assert (l_shaped - l_plain).item() == pytest.approx(diff.item(), abs=1e-6)
    # KL to the unshaped reference is identical whichever guide is used: it is the comparable metric
    assert shaped._metrics["train"]["kl"][-1] == pytest.approx(plain._metrics["train"]["kl"][-1], abs=1e-7)
    assert shaped._metrics["train"]["divergence"][-1] != pytest.approx(
        plain._metrics["train"]["divergence"][-1], abs=1e-6
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_anchor_adds_the_sequence_kl_of_the_shaped_anchor(model_path, tmp_path, loss_type):
    """divergence=sequence_kl: TRL's policy-gradient loss (beta 0) plus beta times each completion's
    sequence_kl(log pi, log pi_ref + log q), weighted as the loss type weighs the completion's
    policy-gradient term and scaled for accumulation: under grpo the mean over completions of
    sequence_kl / |y|, under dapo the sum of sequence_kl over the batch's tokens. Beta is per token."""
    beta = 0.05
    guide = BranchGuide(ratio=0.3, threshold=0.5)
    none = make(
        SageGRPOTrainer, model_path, tmp_path / "a", 0.0, loss_type, divergence=NoDivergence(), guide=guide
    )
    seq = make(
        SageGRPOTrainer, model_path, tmp_path / "b", beta, loss_type, divergence=SequenceKL(beta), guide=guide
    )
    inputs = fake_inputs(none, seed=2)
    l_none, g_none = loss_and_grad(none, inputs)
    l_seq, g_seq = loss_and_grad(seq, inputs)
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, ent, _ = none._get_per_token_logps_and_entropies(none.model, ids, am, 12, compute_entropy=True)
        mask, ref = inputs["completion_mask"], inputs["ref_per_token_logps"]
        q = guide(logps=logps, ref_logps=ref, entropies=ent, mask=mask, step=0)
        per_sequence = ((logps - ref - q.log()) * mask).sum(-1)  # log pi(y) - log m(y)
        lengths = mask.sum(-1)
    assert (q != 1).any() and lengths.min() < lengths.max()
    # current_gradient_accumulation_steps = 2; dapo's normaliser is the generation batch's tokens times
    # accumulation / steps_per_generation, as TRL's
    if loss_type == "grpo":
        expected = beta * (per_sequence / lengths).mean() / 2
    else:
        expected = (
            beta * per_sequence.sum() / (inputs["num_items_in_batch"] * 2 / seq.args.steps_per_generation)
        )
    assert abs(expected.item()) > 1e-4
    assert (l_seq - l_none).item() == pytest.approx(expected.item(), abs=1e-6)
    # the old rule (each completion's whole term, averaged over completions) is another number
    assert (l_seq - l_none).item() != pytest.approx((beta * per_sequence.mean() / 2).item(), abs=1e-4)
    assert not torch.allclose(g_seq, g_none)  # the anchor has a gradient
    # logged: the anchor per token (its completions' log-ratios over their tokens), before beta
    per_token = per_sequence.sum() / lengths.sum()
    assert seq._metrics["train"]["divergence"][-1] == pytest.approx(per_token.item(), abs=1e-5)


def test_informative_groups():
    from sage.train.trainer import informative_groups, total_rewards

    nan = float("nan")
    rewards = torch.tensor(
        [
            [0.7, 0.7, 0.7, 0.7],  # equal rewards: no variance
            [1.0, 0.0, 0.0, 0.0],  # mixed
            [1.0, nan, 1.0, nan],  # the scored ones are equal: no variance
            [1.0, nan, nan, nan],  # one scored completion: no variance
            [nan, nan, nan, nan],  # nothing scored
            [0.0, nan, 1.0, 0.0],  # mixed among the scored
        ]
    ).flatten()
    assert informative_groups(rewards, 4).tolist() == ([False] * 4 + [True] * 4 + [False] * 12 + [True] * 4)
    with pytest.raises(ValueError, match="whole groups"):
        informative_groups(rewards[:6], 4)
    # the weighted sum over reward functions, NaN only where no function scored the completion
    per_func = torch.tensor([[1.0, 2.0], [nan, 2.0], [nan, nan]])
    total = total_rewards(per_func, torch.tensor([0.5, 2.0]))
    assert total[:2].tolist() == [4.5, 4.0] and total[2].isnan()


def scored_batch(trainer, monkeypatch, rewards, completion_length=4, tool_mask=None):
    """TRL's own _generate_and_score_completions on constructed completions (each ``completion_length``
    tokens, ``tool_mask`` on each if given) and constructed rewards: only _generate and the reward call
    are replaced, so advantages, masks and the token count are TRL's."""
    n = len(rewards)
    completions = [[5 + (i + j) % 20 for j in range(completion_length)] for i in range(n)]
    tool_masks = None if tool_mask is None else [list(tool_mask) for _ in range(n)]

    def generate(self, prompts):
        return [[4, 5, 6]] * n, completions, tool_masks, ["c"] * n, None, {}, None, None

    per_func = torch.tensor(rewards, dtype=torch.float32).unsqueeze(1)  # (N, 1): one reward function
    monkeypatch.setattr(GRPOTrainer, "_generate", generate)
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", lambda self, *args: per_func.clone())
    return trainer._generate_and_score_completions([{"prompt": "1+1="}] * n)


def dapo_trainer(model_path, tmp, **config):
    return make(
        SageGRPOTrainer,
        model_path,
        tmp,
        0.0,
        "dapo",
        divergence=NoDivergence(),
        guide=NoGuide(),
        filter_zero_variance_groups=True,
        config={"per_device_train_batch_size": 16, "num_generations": 8, **config},
    )


def test_dapo_filter_drops_an_equal_reward_group_whose_advantages_are_not_zero(
    model_path, tmp_path, monkeypatch
):
    """Eight equal partial-credit rewards: TRL's group mean of them can round off the value, so their
    advantages are (r - mean) / (0 + 1e-4), small but nonzero. The value is chosen among common ones by
    measuring that rounding with the group mean TRL computes."""
    group = 8
    mixed = [1.0, 0.0] * 4

    def rounds(v):
        rewards = torch.tensor([v] * group + mixed)
        return bool(torch.nanmean(rewards.view(-1, group), dim=1)[0] != v)

    value = next(v for v in [i / 10 for i in range(1, 10)] + [1 / 3, 2 / 3, 1 / 7] if rounds(v))
    t = dapo_trainer(model_path, tmp_path)
    out = scored_batch(t, monkeypatch, [value] * group + mixed)
    assert torch.all(out["advantages"][:group] != 0)  # the case: "advantages == 0" would keep this group
    assert out["completion_mask"][:group].sum() == 0
    assert torch.equal(
        out["completion_mask"][group:], torch.ones(group, 4, dtype=out["completion_mask"].dtype)
    )
    assert out["num_items_in_batch"] == group * 4
    assert t._metrics["train"]["frac_groups_filtered"][-1] == 0.5


def test_dapo_filter_keeps_unequal_reward_groups_whose_advantages_are_all_zero(
    model_path, tmp_path, monkeypatch
):
    """scale_rewards=batch divides by the batch's reward std; a reward scale whose square overflows float32
    makes it infinite, so every advantage is exactly 0 although both groups' rewards differ."""
    t = dapo_trainer(model_path, tmp_path, scale_rewards="batch")
    out = scored_batch(t, monkeypatch, [1.0, 0.0] * 4 + [2e19, -2e19] * 4)
    assert torch.all(out["advantages"] == 0)  # the case: "advantages == 0" would drop both groups
    assert out["completion_mask"].sum() == 16 * 4
    assert out["num_items_in_batch"] == 16 * 4
    assert t._metrics["train"]["frac_groups_filtered"][-1] == 0.0


def test_dapo_filter_counts_tokens_under_the_tool_mask(model_path, tmp_path, monkeypatch):
    """Tool-result tokens (tool_mask 0) are not in the loss, so not in its token count either: 4 tokens per
    completion of which 2 are the model's, 8 completions kept -> 16 tokens (the completion mask alone: 32)."""
    t = dapo_trainer(model_path, tmp_path)
    out = scored_batch(t, monkeypatch, [1.0] * 8 + [1.0, 0.0] * 4, tool_mask=[1, 0, 0, 1])
    assert out["completion_mask"].sum() == 8 * 4
    assert out["num_items_in_batch"] == 8 * 2


class RecordingGuide:
    """A guide that records each q it returns and the optimiser step of the call."""

    def __init__(self, guide, trainer_ref):
        self.guide, self.trainer_ref, self.calls = guide, trainer_ref, []

    def __call__(self, **kwargs):
        q = self.guide(**kwargs)
        self.calls.append((self.trainer_ref[0].state.global_step, q))
        return q

    def params(self, step):
        return self.guide.params(step)


def test_a_micro_batch_gets_the_same_q_on_every_pass(model_path, tmp_path):
    """num_iterations=2, two micro-batches per generation batch (steps_per_generation=2), one optimiser step
    per micro-batch: steps 0-3 train on micro-batches 0, 1, 0, 1 of the first generation batch, steps 4-5
    on those of the second. Each pass over a micro-batch draws the same random-guide noise."""
    guide = RandomGuide(schedule=ConstantSchedule(), eps_start=0.5, q_min=1e-3, q_max=10.0, seed=0)
    ref = []
    recording = RecordingGuide(guide, ref)
    t = make(
        SageGRPOTrainer,
        model_path,
        tmp_path,
        0.0,
        "grpo",
        divergence=NoDivergence(),
        guide=recording,
        config={
            "per_device_train_batch_size": 4,
            "steps_per_generation": 2,
            "num_iterations": 2,
            "max_steps": 6,
            "save_strategy": "no",
        },
    )
    ref.append(t)
    t.train()
    steps = [step for step, _ in recording.calls]
    q = [q for _, q in recording.calls]
    assert steps == [0, 1, 2, 3, 4, 5]
    assert torch.equal(q[0], q[2]) and torch.equal(q[1], q[3])  # the second pass over each micro-batch
    assert not torch.equal(q[0], q[1])  # the other micro-batch
    assert q[4].shape != q[0].shape or not torch.equal(q[4], q[0])  # the next generation batch


def test_zero_variance_groups_are_masked_out_of_the_loss(model_path, tmp_path, monkeypatch):
    """With the filter, a batch whose first group has zero variance gives exactly the loss of the other
    group alone (DAPO token-level aggregation: the filtered tokens leave the normaliser too)."""
    t = make(
        SageGRPOTrainer,
        model_path,
        tmp_path / "f",
        0.0,
        "dapo",
        divergence=NoDivergence(),
        guide=NoGuide(),
        filter_zero_variance_groups=True,
    )
    t.num_generations = 4
    inputs = fake_inputs(t, seed=3)
    inputs["advantages"][:4] = 0.0
    rewards = torch.tensor([[0.5]] * 4 + [[1.0], [0.0], [0.0], [1.0]])  # (8, 1): group 1 has zero variance

    def generate_and_score(self, _):
        self._rewards_per_func = rewards  # what SageGRPOTrainer._calculate_rewards keeps
        return dict(inputs)

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", generate_and_score)
    filtered = t._generate_and_score_completions(None)
    assert filtered["completion_mask"][:4].sum() == 0
    assert torch.equal(filtered["completion_mask"][4:], inputs["completion_mask"][4:])
    assert filtered["num_items_in_batch"] == inputs["completion_mask"][4:].sum()
    assert t._metrics["train"]["frac_groups_filtered"][-1] == 0.5
    half = {k: (v[4:] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in inputs.items()}
    half["num_items_in_batch"] = half["completion_mask"].sum()
    l_filtered, _ = loss_and_grad(t, filtered)
    l_half, _ = loss_and_grad(t, half)
    assert l_filtered.item() == pytest.approx(l_half.item(), rel=1e-6)


@pytest.fixture(scope="module")
def fork_model_path(tmp_path_factory):
    """A (barely trained) model of the fork world: its vocabulary has the strategy markers."""
    return build_tiny_model(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        train_steps=3,
        n_train_problems=64,
        world="fork",
        cache_dir=str(tmp_path_factory.mktemp("fork_cache")),
    )


def test_the_fork_guide_shapes_the_anchor_at_the_marker_tokens_and_the_trainer_logs_q_there(
    fork_model_path, model_path, tmp_path
):
    """Markers written into chosen completion positions (one past a completion's end, which the mask
    drops): the loss moves by beta times the shaped k3 term with q = 1.4 exactly there, and the trainer logs
    q and the guide's active share at those tokens; a model without markers logs none and the fork guide
    refuses it."""
    beta = 0.05

    def with_markers(path, folder: str, guide):
        """A trainer told the fork world's markers, as sage-train tells it."""
        return make(
            SageGRPOTrainer,
            path,
            tmp_path / folder,
            beta,
            "grpo",
            divergence=ReverseKL(beta),
            guide=guide,
            fork_markers=FORK_MARKERS.values(),
        )

    plain = with_markers(fork_model_path, "a", NoGuide())
    fork = with_markers(fork_model_path, "b", ForkGuide())
    inputs = fake_inputs(plain, seed=2)
    markers = plain.processing_class.convert_tokens_to_ids(list(FORK_MARKERS.values()))
    ids, mask = inputs["completion_ids"], inputs["completion_mask"]
    ids[ids >= min(markers)] = 4  # no marker drawn at random
    ids[0, 1], ids[1, 1], ids[2, 0] = markers[0], markers[5], markers[2]
    mask[3, 8:] = 0  # row 3 ends after 8 tokens, and a marker stands in its padding
    inputs["num_items_in_batch"] = mask.sum()
    ids[3, 8] = markers[1]  # padding: not a token of the completion
    at_fork = torch.zeros_like(mask, dtype=torch.bool)
    at_fork[0, 1] = at_fork[1, 1] = at_fork[2, 0] = True
    l_plain, _ = loss_and_grad(plain, inputs)
    l_fork, _ = loss_and_grad(fork, inputs)
    diff = shaped_term(plain, inputs, beta, lambda logps, ent: torch.where(at_fork, 1.4, 1.0))
    assert abs(diff.item()) > 1e-6
    assert (l_fork - l_plain).item() == pytest.approx(diff.item(), abs=1e-7)
    logged = fork._metrics["train"]
    assert logged["guide/q_fork"][-1] == pytest.approx(1.4) and logged["guide/active_frac_fork"][-1] == 1.0
    assert logged["guide/active_frac"][-1] == pytest.approx(3 / mask.sum().item())
    assert plain._metrics["train"]["guide/q_fork"][-1] == 1.0  # the plain anchor at the same tokens
    # a model of another world: no markers in its vocabulary, nothing logged at forks, the fork guide refuses
    other = with_markers(model_path, "c", NoGuide())
    loss_and_grad(other, fake_inputs(other, seed=2))
    assert "guide/q_fork" not in other._metrics["train"]
    refusing = with_markers(model_path, "d", ForkGuide())
    with pytest.raises(ValueError, match="model=tiny_fork"):
        loss_and_grad(refusing, fake_inputs(refusing, seed=2))
