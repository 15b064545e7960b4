"""Where the anchor acts, by token entropy (sage/objective/buckets.py): the buckets and their statistics on
hand-computed cases, and the trainer logging them under ``anchor_buckets/`` at every logging step."""

from __future__ import annotations

import math

import pytest
import torch
from trl import GRPOConfig

from sage.objective.buckets import QUINTILES, bucket_masks, bucket_stats
from sage.objective.divergences import ReverseKL
from sage.objective.guides import BranchGuide
from sage.testbed.task import arith_dataset
from sage.train.trainer import SageGRPOTrainer

# ten valid tokens with entropies 0.1 .. 1.0 and two padded ones (entropy 9: must not count anywhere)
ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def test_quintiles_hold_two_tokens_each_and_padding_is_in_none():
    """Quantile edges of 0.1..1.0 (linear interpolation) at 0.28, 0.46, 0.64, 0.82: two tokens per
    quintile; the padded 9.0s are in no bucket, not even above 1.2."""
    masks = bucket_masks(ENTROPIES, MASK)
    flat = ENTROPIES.flatten()
    for i, name in enumerate(QUINTILES):
        chosen = sorted(round(v, 1) for v in flat[masks[name].flatten()].tolist())
        assert chosen == [round(0.1 * (2 * i + 1), 1), round(0.1 * (2 * i + 2), 1)], (name, chosen)
    assert not masks["above_1.2"].any()
    assert sum(int(m.sum()) for n, m in masks.items() if n in QUINTILES) == 10


def test_an_entropy_at_an_edge_goes_to_the_lower_bucket():
    ent = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 2.0]])  # edges 1.0 x 3 and 1.0: the 1.0s go to q1
    masks = bucket_masks(ent, torch.ones_like(ent))
    assert masks["q1"].sum() == 5 and masks["q5"].sum() == 1 and masks["above_1.2"].sum() == 1


def test_bucket_statistics_by_hand():
    """q is 2 on the two highest-entropy tokens, 1 elsewhere; the anchor's value 0.5 there and 0.1 elsewhere;
    the anchor's gradient signal 0.3 against a policy-gradient signal of 0.1 on q5 (share 0.75), 0 against
    0.1 elsewhere; one q1 token clipped; advantages +1 on the first completion, -1 on the second."""
    high = ENTROPIES >= 0.9
    q = torch.where(high, 2.0, 1.0)
    anchor = torch.where(high, 0.5, 0.1)
    anchor_grad = torch.where(high, -0.3, 0.0)
    pg = torch.full_like(q, 0.1)
    clipped = torch.zeros_like(q, dtype=torch.bool)
    clipped[0, 0] = True
    stats = bucket_stats(
        ENTROPIES,
        MASK,
        q=q,
        anchor=anchor,
        anchor_grad=anchor_grad,
        pg_grad=pg,
        clipped=clipped,
        advantages=torch.tensor([1.0, -1.0]),
    )
    assert stats["q5/share"] == pytest.approx(0.2) and stats["q5/q"] == 2.0 and stats["q1/q"] == 1.0
    assert stats["q5/anchor"] == pytest.approx(0.5) and stats["q3/anchor"] == pytest.approx(0.1)
    assert stats["q5/anchor_grad_share"] == pytest.approx(0.75) and stats["q2/anchor_grad_share"] == 0.0
    assert stats["q1/clipped"] == 0.5 and stats["q2/clipped"] == 0.0
    # q3 holds 0.5 (first completion) and 0.6 (first): +1; q4 holds 0.7 and 0.8 (second): -1
    assert stats["q3/advantage"] == 1.0 and stats["q4/advantage"] == -1.0
    assert stats["above_1.2/share"] == 0.0 and math.isnan(stats["above_1.2/q"])  # empty: no mean
    no_anchor = bucket_stats(
        ENTROPIES,
        MASK,
        q=q,
        anchor=None,
        anchor_grad=None,
        pg_grad=pg,
        clipped=clipped,
        advantages=torch.tensor([1.0, -1.0]),
    )
    assert no_anchor["q5/anchor"] == 0.0 and no_anchor["q5/anchor_grad_share"] == 0.0


def zero_reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


@pytest.mark.slow
def test_the_trainer_logs_every_bucket_at_every_logging_step(tmp_path, small_testbed_model):
    """Two steps of SageGRPOTrainer with the Branch guide under k3: each logged step holds the quintiles'
    shares (summing to 1), their q and the anchor's gradient share in [0, 1]; the policy moved off the
    reference after the first step, so the anchor pulls somewhere at the second."""
    path = small_testbed_model
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=10,
        beta=0.05,
        use_bias_correction_kl=False,
        learning_rate=5e-2,
        report_to="none",
        max_steps=2,
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        bf16=False,
        disable_dropout=True,
        seed=2,
    )
    trainer = SageGRPOTrainer(
        model=path,
        reward_funcs=[zero_reward],
        args=args,
        train_dataset=arith_dataset(32, 0),
        divergence=ReverseKL(0.05),
        guide=BranchGuide(ratio=0.5, threshold=0.0),
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "anchor_buckets/q1/share" in e]
    assert len(logged) == 2
    for entry in logged:
        assert sum(entry[f"anchor_buckets/{n}/share"] for n in QUINTILES) == pytest.approx(1.0, abs=1e-6)
        for n in QUINTILES:
            assert 0.0 <= entry[f"anchor_buckets/{n}/anchor_grad_share"] <= 1.0
            assert entry[f"anchor_buckets/{n}/q"] >= 1.0  # Branch only strengthens
    assert max(logged[1][f"anchor_buckets/{n}/anchor_grad_share"] for n in QUINTILES) > 0
    # the run's step x bucket figure, drawn from the same log
    from sage.train.figures import BUCKETS, anchor_buckets_figure, bucket_grid

    steps, rows = bucket_grid(trainer.state.log_history, "q")
    assert steps == [1, 2] and len(rows) == len(BUCKETS)
    assert rows[0] == [e["anchor_buckets/q1/q"] for e in logged]
    png = anchor_buckets_figure(trainer.state.log_history, tmp_path / "anchor_buckets.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert anchor_buckets_figure([{"loss": 1.0, "step": 1}], tmp_path / "none.png") is None
