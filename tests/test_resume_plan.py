"""``plan_resume``: what a sage-train run does with what its folder holds, over each case ``train_in`` meets:
a new folder, checkpoints (whole or cut short), a complete final/, another process count, a recorded MLflow
run, a refused resume, a shortened or re-configured run. Each folder is built by hand in tmp_path; each plan
is derived by hand from the rules in ``sage.train.resume``."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers.trainer_utils import get_last_checkpoint

from sage.config import Resume, resume_mode
from sage.run_folder import record_identity
from sage.train.resume import FINAL_FILE, ResumePlan, plan_resume, set_aside_incomplete_checkpoints


def config(resume: str | bool = "auto", max_steps: int = 4, **other):
    """The keys a plan reads (and the identity compares): 2 x 2 completions per process and step."""
    trl = {"max_steps": max_steps, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    return OmegaConf.create({"resume": resume, "seed": 1, "trl": trl, **other})


def checkpoint(out: Path, step: int, rng: tuple[str, ...] = ("rng_state.pth",), whole: bool = True) -> Path:
    """``rl/checkpoint-<step>/`` as the Trainer leaves it: its state and an RNG state per process; one that
    is not whole lacks trainer_state.json (a kill during its save)."""
    folder = out / "rl" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if whole:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for name in rng:
        with zipfile.ZipFile(folder / name, "w") as z:  # torch.save writes a zip archive
            z.writestr("data.pkl", b"")
    return folder


def final(out: Path, step: int) -> None:
    (out / "final").mkdir(parents=True)
    (out / "final" / FINAL_FILE).write_text(json.dumps({"global_step": step}))


def folder_of(cfg, tmp_path: Path) -> Path:
    """A run folder in which ``cfg`` has started (its identity recorded)."""
    out = tmp_path / "run"
    out.mkdir()
    record_identity(cfg, out)
    return out


def expected(cfg, **fields) -> ResumePlan:
    """A plan that starts fresh, updated by ``fields``."""
    fresh = {
        "resume": resume_mode(cfg.resume),
        "refusal": None,
        "checkpoint": None,
        "final_step": -1,
        "reached": -1,
        "final_done": False,
        "continue_run": False,
        "check_kept": False,
    }
    return ResumePlan(**{**fresh, **fields})


@pytest.mark.parametrize("resume", ["auto", "false"])
def test_an_empty_folder_starts_fresh(tmp_path, resume):
    cfg = config(resume)
    out = tmp_path / "run"
    out.mkdir()
    assert plan_resume(cfg, out, 1) == expected(cfg)


def test_a_new_folder_under_a_recorded_identity_starts_fresh(tmp_path):
    cfg = config()
    assert plan_resume(cfg, folder_of(cfg, tmp_path), 1) == expected(cfg)


@pytest.mark.parametrize("resume", ["auto", "true"])
def test_checkpoints_continue_from_the_last(tmp_path, resume):
    cfg = config(resume)
    out = folder_of(cfg, tmp_path)
    checkpoint(out, 1)
    last = checkpoint(out, 2)
    # reached: checkpoint-2's step; the MLflow run continues with the checkpoint, and must be kept
    assert plan_resume(cfg, out, 1) == expected(
        cfg, checkpoint=last, reached=2, continue_run=True, check_kept=True
    )


def test_steps_are_compared_as_numbers(tmp_path):
    cfg = config(max_steps=20)
    out = folder_of(cfg, tmp_path)
    checkpoint(out, 9)
    last = checkpoint(out, 10)  # "checkpoint-10" < "checkpoint-9" as text
    assert plan_resume(cfg, out, 1).checkpoint == last


def test_a_checkpoint_cut_short_is_passed_over_and_nothing_is_written(tmp_path):
    """checkpoint-3 lacks trainer_state.json, and a save was interrupted in its staging folder: the plan
    continues from checkpoint-2 and leaves every file as it was (the set-aside is train_in's)."""
    cfg = config()
    out = folder_of(cfg, tmp_path)
    whole = checkpoint(out, 2)
    checkpoint(out, 3, whole=False)
    (out / "rl" / ".tmp-checkpoint-4" / "checkpoint-4").mkdir(parents=True)
    before = {(str(p), p.stat().st_mtime_ns) for p in out.rglob("*")}
    got = plan_resume(cfg, out, 1)
    assert got == expected(cfg, checkpoint=whole, reached=2, continue_run=True, check_kept=True)
    assert {(str(p), p.stat().st_mtime_ns) for p in out.rglob("*")} == before
    # what transformers picks once the cut one is set aside, as train_in did before the plan
    set_aside_incomplete_checkpoints(out / "rl")
    assert get_last_checkpoint(str(out / "rl")) == str(got.checkpoint)


@pytest.mark.parametrize(
    ("resume", "max_steps", "saved"),
    [
        ("auto", 4, True),
        ("auto", 4, False),  # trl.save_steps beyond the run: final/ alone is the finished work
        ("false", 4, False),  # resume=false refuses checkpoints only: final/ is evaluated, in its own run
        ("auto", 6, True),  # a longer run trains on from the checkpoint
        ("auto", 6, False),  # ... or, with none, from the start, in the same MLflow run
    ],
)
def test_a_final_model_is_done_at_max_steps_and_continues_its_mlflow_run(tmp_path, resume, max_steps, saved):
    cfg = config(resume, max_steps=max_steps)
    out = folder_of(cfg, tmp_path)
    last = checkpoint(out, 4) if saved else None
    final(out, 4)
    # final_done: final/ is at trl.max_steps (4), not below it (6)
    assert plan_resume(cfg, out, 1) == expected(
        cfg,
        checkpoint=last,
        final_step=4,
        reached=4,
        final_done=max_steps == 4,
        continue_run=True,
        check_kept=True,
    )


@pytest.mark.parametrize(
    ("rng", "then", "now"),
    [(("rng_state.pth",), 1, 2), (("rng_state_0.pth", "rng_state_1.pth"), 2, 1)],
)
def test_another_process_count_is_refused(tmp_path, rng, then, now):
    cfg = config()
    out = folder_of(cfg, tmp_path)
    last = checkpoint(out, 3, rng=rng)
    # 2 x 2 completions per process and step
    assert plan_resume(cfg, out, now) == expected(
        cfg,
        refusal=(
            f"output_dir={out}: checkpoint-3 was trained on {then} process(es) ({4 * then} completions per "
            f"optimiser step), this run has {now} ({4 * now}): a resume keeps the run's batch; resume on "
            f"{then} process(es), or choose another output_dir"
        ),
        checkpoint=last,
        reached=3,
        continue_run=True,
        check_kept=True,
    )


def test_the_same_process_count_or_no_rng_state_resumes(tmp_path):
    cfg = config()
    out = folder_of(cfg, tmp_path)
    checkpoint(out, 1, rng=("rng_state_0.pth", "rng_state_1.pth"))
    assert plan_resume(cfg, out, 2).refusal is None
    checkpoint(out, 2, rng=())  # trl.save_only_model=true: no RNG state to count
    assert plan_resume(cfg, out, 3).refusal is None


def test_resume_false_with_checkpoints_is_refused_whatever_the_process_count(tmp_path):
    cfg = config("false")
    out = folder_of(cfg, tmp_path)
    last = checkpoint(out, 2)
    assert plan_resume(cfg, out, 2) == expected(
        cfg,
        refusal=(
            f"{out} already holds checkpoints; pass resume=true (or auto) to continue or choose another "
            "output_dir"
        ),
        checkpoint=last,
        reached=2,
        continue_run=True,
        check_kept=True,
    )


@pytest.mark.parametrize("resume", ["true", True])
def test_resume_true_with_nothing_to_resume_is_refused(tmp_path, resume):
    """Also where the only checkpoint is cut short: it is no checkpoint to resume from."""
    cfg = config(resume)
    out = folder_of(cfg, tmp_path)
    refusal = f"resume=true but {out / 'rl'} holds no checkpoint-*/ folder to resume from"
    got = plan_resume(cfg, out, 1)
    assert got == expected(cfg, resume=Resume.true, refusal=refusal)
    checkpoint(out, 1, whole=False)
    assert plan_resume(cfg, out, 1) == got


def test_resume_false_with_a_recorded_base_run_starts_a_new_mlflow_run(tmp_path):
    """A base row (max_steps=0) finished: its metrics.json and its MLflow run's id are in the folder.
    resume=false starts a new MLflow run (start_run closes the recorded one); auto continues it."""
    cfg = config("false", max_steps=0)
    out = folder_of(cfg, tmp_path)
    (out / "metrics.json").write_text("{}")
    (out / "mlflow_run_id").write_text("0123abcd")
    assert plan_resume(cfg, out, 1) == expected(cfg)
    auto = config("auto", max_steps=0)
    assert plan_resume(auto, out, 1) == expected(auto, continue_run=True, check_kept=True)


def test_metrics_of_a_training_run_without_its_model_check_the_run_but_start_a_new_one(tmp_path):
    """max_steps > 0 and metrics.json but no final/ nor checkpoint: the recorded run must be kept (it is
    checked), but only a checkpoint or a final/ continues it."""
    cfg = config("auto", max_steps=4)
    out = folder_of(cfg, tmp_path)
    (out / "metrics.json").write_text("{}")
    assert plan_resume(cfg, out, 1) == expected(cfg, check_kept=True)


@pytest.mark.parametrize("where", ["checkpoint", "final"])
def test_a_shorter_run_is_refused(tmp_path, where):
    cfg = config(max_steps=2)
    out = folder_of(cfg, tmp_path)
    last = checkpoint(out, 3) if where == "checkpoint" else None
    if where == "final":
        final(out, 3)
    got = plan_resume(cfg, out, 1)
    assert got.refusal == (
        f"trl.max_steps=2 is below step 3, which the model in {out} has already trained to: a run can be "
        "extended, not shortened; give trl.max_steps >= 3, or another output_dir"
    )
    assert (got.checkpoint, got.reached, got.final_done) == (last, 3, where == "final")


def test_a_folder_of_another_config_is_refused_whatever_resume_says(tmp_path):
    out = folder_of(config(seed=2), tmp_path)
    final(out, 4)
    for resume in ("auto", "false", "true"):
        cfg = config(resume)
        refusal = plan_resume(cfg, out, 1).refusal
        assert refusal.startswith(f"output_dir={out} holds a run of another config: seed=1 (the folder's: 2)")


def test_a_run_without_a_recorded_config_is_refused(tmp_path):
    cfg = config()
    out = tmp_path / "run"
    checkpoint(out, 1)
    assert plan_resume(cfg, out, 1).refusal == (
        f"output_dir={out} holds a run (rl/checkpoint-1) but neither identity.json nor config.yaml, so its "
        "config is unknown: choose another output_dir"
    )


def test_the_process_count_is_refused_before_the_config(tmp_path):
    """As sage-train refuses it before the process group, ahead of the folder's identity."""
    out = folder_of(config(seed=2), tmp_path)
    checkpoint(out, 1)
    assert plan_resume(config(), out, 2).refusal.startswith(
        f"output_dir={out}: checkpoint-1 was trained on 1"
    )


def test_the_plan_is_a_value(tmp_path):
    cfg = config()
    out = tmp_path / "run"
    out.mkdir()
    got = plan_resume(cfg, out, 1)
    with pytest.raises(AttributeError):
        got.checkpoint = out  # frozen
    assert got == plan_resume(cfg, out, 1) and not os.listdir(out)
