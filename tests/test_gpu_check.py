"""`make wheelhouse` and `make gpu-check` (launchers/wheelhouse.py, launchers/gpu_check.py) as far as a CPU
goes: the wheelhouse is built from PyPI within its size and complete for the GPU machine's image; the
check's dry run prints both stages, composes their configs and runs stage b's teacher-forced pass at the
paper's 2,048 completion tokens on a shrunk model on the CPU; stage a's path runs on a CPU in float32; the
summary and the memory verdict are read off a run's lines as the check reads them."""

import os
import sys
from pathlib import Path

import prefork
import pytest

from launchers import gpu_check, wheelhouse

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the wheelhouse


def fake_index(packages: dict[str, tuple[str, list[str]]]):
    return lambda name: packages.get(wheelhouse.canonicalize_name(name))


def test_the_closure_carries_what_the_image_lacks_and_checks_known_versions():
    index = fake_index(
        {
            "sage-rlvr": (
                "0.1.0",
                ["trl==1.16.0", "torch<2.15,>=2.6", "mlflow==3.17.2", "math-verify[x]==0.9"],
            ),
            "trl": ("1.16.0", ["datasets>=3", "accelerate>=1.4", "transformers>=9; python_version < '3'"]),
            "datasets": ("5.2.0", ["dill<0.4.2", "numpy>=1.17"]),
            "dill": ("0.4.1", []),
            "math-verify": ("0.9", ["latex2sympy2-extended==1.11.0; extra == 'x'", "never; extra == 'y'"]),
            "latex2sympy2-extended": ("1.11.0", ["antlr4-python3-runtime<=4.13.2,>=4.9.3"]),
            "antlr4-python3-runtime": ("4.9.3", []),
        }
    )
    carried, problems = wheelhouse.walk(index, ("3.12",))
    assert problems == []
    # mlflow is left out with its own requirements; torch, accelerate and numpy are the image's; a marker
    # that is false on the machine and an extra nobody asked for bring nothing
    assert set(carried) == {
        "sage-rlvr",
        "trl",
        "datasets",
        "dill",
        "math-verify",
        "latex2sympy2-extended",
        "antlr4-python3-runtime",
    }
    # the image's torch is known (2.11.0): a requirement it does not meet is a problem, named
    index = fake_index({"sage-rlvr": ("0.1.0", ["torch>=2.12", "dill>=1"]), "dill": ("0.4.1", [])})
    _, problems = wheelhouse.walk(index, ("3.12",))
    assert problems == [
        "sage-rlvr requires torch>=2.12, the image has torch 2.11.0",
        "sage-rlvr requires dill>=1, the carried dill is 0.4.1",
    ]
    # peft is on the image, but carried: sage pins it exactly
    index = fake_index({"sage-rlvr": ("0.1.0", ["peft==0.21.2"]), "peft": ("0.21.2", [])})
    assert set(wheelhouse.walk(index, ("3.12",))[0]) == {"sage-rlvr", "peft"}
    _, problems = wheelhouse.walk(fake_index({"sage-rlvr": ("0.1.0", ["pebble>=5"])}), ("3.12",))
    assert problems == ["pebble (required by sage-rlvr): not available to carry"]


@pytest.mark.slow  # downloads from PyPI
def test_the_wheelhouse_is_built_within_its_size_and_resolves_offline(tmp_path):
    out = tmp_path / "wheelhouse"
    r = prefork.run(
        [sys.executable, "-m", "launchers.wheelhouse", "--out", str(out), "--no-testbed"],
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "check: complete" in r.stdout
    assert wheelhouse.size_mib(out) <= wheelhouse.MAX_MIB
    pinned = {line.split("==")[0] for line in (out / "requirements.txt").read_text().split()}
    for needed in ("trl", "hydra-core", "omegaconf", "antlr4-python3-runtime", "math-verify", "datasets"):
        assert needed in pinned, pinned
    for needed in (
        "latex2sympy2-extended",
        "optuna",
        "sqlalchemy",
        "alembic",
        "submitit",
        "pebble",
        "sage-rlvr",
    ):
        assert needed in pinned, pinned
    for image_or_left_out in ("torch", "transformers", "accelerate", "mlflow", "numpy", "vllm"):
        assert image_or_left_out not in pinned
    # --check finds what a wheelhouse lacks: a missing wheel, and a second version of one
    (out / "dill-0.4.1-py3-none-any.whl").unlink()
    problems = wheelhouse.check(out, ("3.12",))
    assert any(p.startswith("dill (required by") and p.endswith("not available to carry") for p in problems)
    assert any("dill==0.4.1" in p for p in problems), problems  # pip's own dry run cannot find it


# ---------------------------------------------------------------- the check, read


RUN = """\
training grpo_branch (...) on model=qwen2.5-math-7b: 2 steps, seed 0
batch: 1 completions per forward pass x 64 accumulation steps x 1 processes = 64 completions (8 prompts x 8 \
generations) per optimiser step; longest micro-batch 1 x (180 prompt + 64 completion) = 244 tokens; 64 \
completions generated at a time
gpu check: step 1: 21.40 s, peak memory 16.10 GiB (cuda:0 allocated)
gpu check: step 2: 14.02 s, peak memory 16.25 GiB (cuda:0 allocated)

| model | dataset | pass@1 | pass@8 |
|---|---|---|---|
| base | arith_heldout | 0.000 | 0.000 |
| trained | arith_heldout | 0.062 | 0.250 |

run outputs: /x
"""


def test_the_run_lines_are_read_into_steps_batch_table_and_verdict():
    steps = gpu_check.parse_steps(RUN)
    assert steps == [(1, 21.4, 16.1, "cuda:0 allocated"), (2, 14.02, 16.25, "cuda:0 allocated")]
    assert gpu_check.BATCH.search(RUN).group(2) == "180"
    assert gpu_check.eval_table(RUN) == RUN.split("\n\n")[1].splitlines()
    held, line = gpu_check.memory_verdict(16.25, 14.7)
    assert held and "+10.5% against the plan; within the +15% tolerance" in line
    held, line = gpu_check.memory_verdict(17.0, 14.7)
    assert not held and "UNDERESTIMATED" in line
    assert gpu_check.memory_verdict(10.0, 14.7)[0]  # an upper bound may be far above
    stage = gpu_check.Stage("a", "the CUDA path", ok=True, wall_s=95.0, steps=steps, notes=[line])
    lines = gpu_check.summary([stage], plan_held=False)
    assert "| a | the CUDA path | ok | 95 s | 21.4, 14.0 | 16.25 GiB (cuda:0 allocated) |" in lines
    assert lines[-1] == "The memory plan did NOT hold (tolerance +15%)."


BATCH_A = (
    "batch: 64 completions per forward pass x 1 accumulation steps x 1 processes = 64 completions (8 "
    "prompts x 8 generations) per optimiser step; longest micro-batch 64 x (180 prompt + 64 completion) = "
    "15616 tokens\n"
)


# stage b's result line on a GPU: 4.40 GiB of working set (18.70 at the peak less 14.30 before the pass)
# against the plan's 1.00 + 2.00
PASS = {
    "device": "NVIDIA H200",
    "parameters": 7_615_616_512,
    "vocabulary": 152064,
    "dtype": "bfloat16",
    "micro": 1,
    "prompt_tokens": 1024,
    "completion_tokens": 2048,
    "gradient_checkpointing": True,
    "scored": 2048,
    "adapter_gradients": 196,
    "adapter_tensors": 392,
    "wall_s": 2.5,
    "resident_gib": 14.30,
    "peak_gib": 18.70,
    "planned": {"weights": 14.18, "trainable_state": 0.19, "activations": 1.00, "logits": 2.00},
}


def test_the_pass_is_set_beside_the_plans_working_set():
    held, lines = gpu_check.pass_verdict(PASS)
    assert not held
    assert lines[0] == (
        "working set (peak during the pass less before it) against the plan's activations + logits: memory: "
        "peak 4.40 GiB measured, 3.00 GiB planned (+46.7% against the plan; UNDERESTIMATED: beyond the +15% "
        "tolerance)"
    )
    assert lines[1].startswith("resident before the pass: 14.30 GiB (plan: weights 14.18 + the adapter")
    held, _ = gpu_check.pass_verdict({**PASS, "peak_gib": 17.0})  # 2.70 of 3.00: within
    assert held
    described = gpu_check.describe_pass(PASS)
    assert (
        "one teacher-forced forward and backward over 1 x (1024 prompt + 2048 completion) tokens"
        in described[0]
    )
    assert described[1] == (
        "plan: weights 14.180, trainable_state 0.190, activations 1.000, logits 2.000 GiB "
        "(sage.train.memory.estimate, the same shape and dtype)"
    )


def test_a_gpu_run_is_read_into_its_summary_and_fails_on_an_underestimate(tmp_path, monkeypatch, capsys):
    """main() as on a GPU, each stage's process replaced by its canned output."""
    import json

    import torch

    runs = {
        "a.log": BATCH_A
        + "".join(
            f"gpu check: step {i}: 0.50 s, peak memory 0.21 GiB (cuda:0 allocated)\n" for i in (1, 2, 3)
        )
        + RUN.split("\n\n", 1)[1],
        "b.log": "some start-up log\nteacher forced: " + json.dumps(PASS) + "\n",
    }
    ran = []

    def run_logged(command, log, timeout, env):
        ran.append(command)
        return 0, runs[log.name], 12.0

    monkeypatch.setattr(gpu_check, "run_logged", run_logged)
    monkeypatch.setattr(gpu_check, "IMPORTS", "pass")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    assert gpu_check.main(["--out", str(tmp_path / "runs")]) == 1
    assert [c[2:4] for c in ran] == [
        ["sage.train", "model=tiny_chat"],
        ["launchers.gpu_check", "--teacher-forced"],
    ]
    summary = (tmp_path / "runs" / "summary.md").read_text()
    assert (
        "| a | tiny_chat: " in summary
        and "| ok | 12 s | 0.5, 0.5, 0.5 | 0.21 GiB (cuda:0 allocated) |" in summary
    )
    assert "| trained | arith_heldout | 0.062 | 0.250 |" in summary
    assert (
        "| b | random Qwen2.5-Math-7B shapes, trl=paper micro-batch, 1024 + 2048 tokens teacher-forced | ok |"
        in summary
    )
    assert "peak 4.40 GiB measured, 3.00 GiB planned (+46.7% against the plan; UNDERESTIMATED" in summary
    assert "The memory plan did NOT hold (tolerance +15%)." in summary
    assert "----- summary (docs/results/gpu_check.md, Runs) -----" in capsys.readouterr().out


def test_the_dry_run_prints_both_stages_and_runs_stage_b_at_2048_tokens(tmp_path, capsys):
    """Both stages' configs composed, and stage b's pass run on this CPU: one forward and backward over the
    paper's micro-batch (1 sequence, trl=paper's per-device batch) of 1,024 prompt and 2,048 completion
    tokens, every completion token scored and the adapter given a gradient."""
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    a, b = out.split("stage b:")
    assert "train: python -m sage.train model=tiny_chat experiment=grpo_branch rollout=hf" in a
    assert f"output_dir={tmp_path / 'a'}" in a
    for fact in (
        "bfloat16, LoRA r=8",
        "divergence ReverseKL",
        "guide BranchGuide",
        "trl bf16=True",
        "max_steps=3",
    ):
        assert fact in a, a
    assert "rollout=hf; evaluation at end, 8 samples; tracking off; callbacks ['gpu_check']" in a
    assert "pass: python -m launchers.gpu_check --teacher-forced" in b
    for fact in (
        "LoRA r=8",
        "SFT off",
        "per_device_train_batch_size=1 gradient_accumulation_steps=64",
        "completions 2048 tokens",
        "evaluation off; tracking off",
    ):
        assert fact in b, b
    ran = b.split(
        "stage b's pass on this CPU, shrunk (python -m launchers.gpu_check --teacher-forced --shrink):"
    )[1]
    assert (
        "(vocabulary 4096), float32, on cpu: one teacher-forced forward and backward over 1 x (1024 prompt + "
        "2048 completion) tokens, gradient checkpointing on, 2048 completion log-probabilities, " in ran
    ), ran
    # peft's B matrices start at zero: the A matrices' gradients are zero at the first pass, the B ones not
    assert "14 of 28 adapter tensors with a gradient" in ran, ran
    assert "plan: weights " in ran and "(sage.train.memory.estimate, the same shape and dtype)" in ran


def test_the_dry_run_fails_on_a_misspelt_override(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "TINY_EVAL", [*gpu_check.TINY_EVAL, "eval.n_sample=8"])
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert "composition FAILED" in capsys.readouterr().out


# ---------------------------------------------------------------- stage a's path on a CPU


def sage_train(overrides: list[str]):
    return prefork.run(
        [sys.executable, "-m", "sage.train", *overrides],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=900,
        cwd=REPO,
    )


@pytest.mark.slow
def test_stage_a_runs_on_a_cpu_in_float32(tmp_path):
    r = sage_train(gpu_check.stage_a(tmp_path / "a", cpu=True))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    steps = gpu_check.parse_steps(r.stdout)
    assert [s[0] for s in steps] == [1] and steps[0][3] == "process RSS"
    assert [line.split(" | ")[0] for line in gpu_check.eval_table(r.stdout)[2:]] == ["| base", "| trained"]
