"""Smoke runs of the real entry point (`python -m sage.train`) on a shrunken testbed, in a tmp dir: the
parameters change, metrics are logged, a checkpoint is written, and `resume=true` continues from it: with
the schedule of the longer run, evaluations logged once, and exactly as an uninterrupted run would."""

import json
import os
import sys
from pathlib import Path

import prefork
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

# The real testbed base model (built once into the shared cache: a smaller one never earns a reward, so
# nothing would be learnt), and a few small RL steps.
SHRINK = [
    "trl.per_device_train_batch_size=16",
    "trl.num_generations=4",
    "trl.save_steps=2",
    "eval.n_samples=4",
    "eval.ks=[1,4]",
    "eval.limit=6",
]


def sage_train(tmp_path, *overrides, check=True):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = prefork.run(
        [sys.executable, "-m", "sage.train", *SHRINK, *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_train_checkpoint_resume(tmp_path):
    out = tmp_path / "run"
    linear = ["trl.lr_scheduler_type=linear", "trl.warmup_steps=0"]  # the learning rates are hand-computed
    r = sage_train(
        tmp_path, "trl.max_steps=2", f"output_dir={out}", "guide=branch", "guide.threshold=0.5", *linear
    )
    # a table of base vs trained model is printed, and where the outputs are
    assert "| base | arith_heldout |" in r.stdout and "| trained | arith_heldout |" in r.stdout
    assert f"run outputs: {out}" in r.stdout
    # it said what it trains before anything else, and how far each evaluation got, with the time left
    assert r.stdout.splitlines()[0].startswith(
        "training grpo_branch (algorithm=grpo, divergence=reverse_kl, guide=branch, beta="
    )
    assert "eval arith_heldout: 24/24 completions, " in r.stdout and "±" not in r.stdout  # one eval seed
    assert (out / "rl" / "checkpoint-2").is_dir()
    log = json.loads((out / "train_log.json").read_text())
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    for key in (
        "reward",
        "reward_std",
        "kl",
        "divergence",
        "entropy",
        "grad_norm",
        "guide/q_mean",
        "guide/q_max",
        "guide/active_frac",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "step_time",
    ):
        assert key in steps[0], key
    assert any(e["guide/active_frac"] > 0 for e in steps)  # the guide fired at threshold 0.5
    final = weights(out / "final")
    ckpt = weights(out / "rl" / "checkpoint-2")
    assert all(torch.equal(final[k], ckpt[k]) for k in final)
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        0.0 <= metrics["pass_at_1/trained/arith_heldout"] <= metrics["pass_at_4/trained/arith_heldout"] <= 1.0
    )

    # a second run of the same config into the folder without resume=true refuses to overwrite what is
    # recorded; another config is refused whatever resume says (tests/test_result_identity.py)
    same = (f"output_dir={out}", "guide=branch", "guide.threshold=0.5", *linear)
    r = sage_train(tmp_path, "trl.max_steps=4", *same, check=False)
    assert r.returncode == 2 and "pass resume=true" in r.stderr
    r = sage_train(tmp_path, "trl.max_steps=4", f"output_dir={out}", check=False)
    assert r.returncode == 2 and "holds a run of another config" in r.stderr

    # resume=true continues from checkpoint-2 up to step 4
    r = sage_train(
        tmp_path,
        "trl.max_steps=4",
        f"output_dir={out}",
        "resume=true",
        "guide=branch",
        "guide.threshold=0.5",
        *linear,
    )
    log = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4]
    # trl.max_steps is the total length: steps 3-4 follow a 4-step run's linear schedule, lr * (4 - i) / 4
    # at step i + 1, after the 2-step run's lr * (2 - i) / 2 (not the finished schedule's 0)
    rates = [e["learning_rate"] for e in log if "loss" in e]
    assert rates == pytest.approx([1e-4, 1e-4 / 2, 1e-4 * 2 / 4, 1e-4 / 4], rel=1e-6)
    assert (out / "rl" / "checkpoint-4").is_dir()
    resumed = weights(out / "final")
    assert any(not torch.equal(resumed[k], final[k]) for k in final)
    check_mlflow_record(out)

    # a requeued job finding final/ complete at trl.max_steps skips RL: same model, no new step logged
    saved = (out / "final" / "model.safetensors").stat().st_mtime_ns
    again = ("trl.max_steps=4", f"output_dir={out}", "resume=auto", "guide=branch", "guide.threshold=0.5")
    r = sage_train(tmp_path, *again, *linear)  # the same command
    assert "is complete at step 4: RL is not run again" in r.stdout + r.stderr
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == saved
    log = json.loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4]
    check_evaluations_logged_once(out)  # its evaluation of the same models added nothing


def check_mlflow_record(out):
    """The resumed run continued the SAME MLflow run, with every step once and the eval numbers of
    metrics.json."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()  # the session's private store (tests/conftest.py)
    run_id = (out / "mlflow_run_id").read_text()
    run = client.get_run(run_id)
    runs = client.search_runs([run.info.experiment_id], filter_string=f"tags.output_dir = '{out}'")
    assert [r.info.run_id for r in runs] == [run_id]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["algorithm"], tags["divergence"], tags["guide"], tags["model"], tags["seed"]) == (
        "grpo",
        "reverse_kl",
        "branch",
        "tiny",
        "0",
    )
    assert len(tags["git_commit"]) in (40, len("not-a-git-checkout"))
    assert run.data.params["guide.threshold"] == "0.5" and run.data.params["trl.max_steps"] == "2"
    assert tags["resumed.trl.max_steps"] == "4" and tags["resumed.resume"] == "True"
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert steps == [1, 2, 3, 4]
    for key in ("train/kl", "train/divergence", "train/guide/active_frac", "train/grad_norm", "train/reward"):
        assert len(client.get_metric_history(run_id, key)) == 4, key
    metrics = json.loads((out / "metrics.json").read_text())
    assert run.data.metrics["pass_at_1/trained/arith_heldout"] == pytest.approx(
        metrics["pass_at_1/trained/arith_heldout"]
    )
    curve = client.get_metric_history(run_id, "pass_at_k_curve/trained/arith_heldout")
    assert sorted({m.step for m in curve}) == [1, 2, 3, 4]
    check_evaluations_logged_once(out)


def check_evaluations_logged_once(out):
    """Each evaluation is logged once, at the step of the model it evaluates: the base model at 0 (its
    re-evaluation by the resumed run is not logged again), the trained model at 2 and, extended, at 4."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    run_id = (out / "mlflow_run_id").read_text()
    run = client.get_run(run_id)
    base_curve = client.get_metric_history(run_id, "pass_at_k_curve/base/arith_heldout")
    assert sorted(m.step for m in base_curve) == [1, 2, 3, 4]
    # the evaluation's figures: <figure>/<base|trained|periodic>/<dataset> (sage.metrics.metric_name)
    evals = {k: k.split("/")[-2] for k in run.data.metrics if k.endswith("/arith_heldout")}
    evals = {k: label for k, label in evals.items() if not k.startswith("pass_at_k_curve/")}
    assert "pass_at_1/base/arith_heldout" in evals and set(evals.values()) == {"base", "trained"}
    for key, label in evals.items():
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert len(steps) == len(set(steps)), (key, steps)
        if label == "base":
            assert steps == [0], (key, steps)
        if key.startswith("pass_at_"):
            assert steps == ([0] if label == "base" else [2, 4]), (key, steps)
    artifacts = {a.path for a in client.list_artifacts(run_id, "eval/trained")}
    assert "eval/trained/trained_arith_heldout_correct.npz" in artifacts


def test_a_resumed_run_equals_an_uninterrupted_one_with_the_random_guide(tmp_path):
    """The random guide's noise is a function of the step, not of how many draws came before: a run stopped
    at step 2 and resumed to 4 trains exactly as a run straight to 4. The learning rate and the guide's
    hyperparameters are constant, so the 2-step run's steps are the 4-step run's."""
    same = [
        "guide=random",
        "guide.eps_start=0.5",
        "schedule=constant",
        "trl.lr_scheduler_type=constant",
        "trl.warmup_steps=0",
        "eval.at_end=false",
    ]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    sage_train(tmp_path, *same, "trl.max_steps=4", f"output_dir={straight}")
    sage_train(tmp_path, *same, "trl.max_steps=2", f"output_dir={stopped}")
    sage_train(tmp_path, *same, "trl.max_steps=4", f"output_dir={stopped}", "resume=true")

    def steps(out):
        log = json.loads((out / "train_log.json").read_text())
        return [{k: v for k, v in e.items() if k != "step_time"} for e in log if "loss" in e]

    a, b = steps(straight), steps(stopped)
    assert [e["step"] for e in a] == [e["step"] for e in b] == [1, 2, 3, 4]
    assert all(e["guide/active_frac"] > 0 for e in a)  # the guide shaped every step
    assert a == b  # every logged figure of every step, exactly
    final_a, final_b = weights(straight / "final"), weights(stopped / "final")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_parameters_change_from_the_base_model(tmp_path):
    out = tmp_path / "run"
    # no weight decay and no warm-up: any change is the policy gradient's (and the divergence's) doing
    sage_train(
        tmp_path,
        "trl.max_steps=2",
        "trl.weight_decay=0",
        "trl.warmup_steps=0",
        f"output_dir={out}",
        "eval.at_end=false",
        "divergence=forward_kl",
    )
    log = json.loads((out / "train_log.json").read_text())
    assert any(e.get("reward_std", 0) > 0 for e in log)  # some groups had a learning signal
    from sage.testbed.model import build_tiny_model

    base, final = weights(Path(build_tiny_model())), weights(out / "final")
    changed = [k for k in final if not torch.equal(base[k], final[k])]
    assert len(changed) >= len(final) // 2, changed
