"""`make gpu-check`: what to run on a lent GPU machine (CUDA torch, no network), in two stages.

    make wheelhouse                       # here (network): the wheels sage needs there, and the testbed model
    make gpu-check                        # there: installs wheelhouse/, then both stages (exit 1: a failure)
    python3 -m launchers.gpu_check --install [--stage a|b|all] [--logs DIR]   # the same without make
    python -m launchers.gpu_check --dry-run   # any machine: the configs composed, stage b's pass on a CPU

a. The CUDA path without vLLM: ``sage-train`` with ``rollout=hf`` on the testbed's chat model
   (``model=tiny_chat``: LoRA SFT, merged, then LoRA RL, the paper model's path at 1M parameters), GRPO with
   the Branch guide under k3 (``experiment=grpo_branch``: ``divergence=reverse_kl``), bfloat16 weights and
   autocast, 3 optimiser steps and a tiny evaluation of the base and trained models.
b. The paper's shape, teacher-forced: a randomly initialised Qwen2 with Qwen2.5-Math-7B's layer shapes (built
   on the GPU in bfloat16 from ``sage/train/architectures.json``), made as sage-train makes the policy from
   ``model=qwen2.5-math-7b trl=paper`` (its LoRA adapter, TRL's fused LM head, gradient checkpointing), and
   one forward and backward of the preset's micro-batch (``trl.per_device_train_batch_size``: 1 sequence)
   of :data:`PROMPT_TOKENS` prompt and 2,048 completion tokens given, not generated, scored as TRL's loss
   pass scores them. Its working set (the allocator's peak during the pass less what was allocated before
   it) is set beside the memory plan's terms for one micro-batch, activations + logits
   (``sage.train.memory.estimate`` for the same shape): the check fails when the plan underestimates by more
   than :data:`TOLERANCE`. The dry run runs this pass on the CPU on a shrunk shape (``SHRUNK``).

Stage a runs with ``tracking.enabled=false`` (MLflow is not carried) and the AdamW of torch (bitsandbytes'
8-bit one is not carried either); each of its steps prints a ``gpu check: step N`` line (its wall time and
the peak memory so far) through the ``callbacks`` node. The end is a summary block for
docs/results/gpu_check.md. A stage's output and the summary go to ``--logs`` (default: the run folder under
outputs/gpu_check/).

``--install`` first installs ``wheelhouse/requirements.txt`` from ``wheelhouse/`` alone (no index, no
dependency resolution: ``python -m launchers.wheelhouse --check`` vouched for the set) into the environment
of the Python that runs it, beside the machine's own packages (CUDA torch among them), then runs the check in
a new process. Not into a folder of its own on ``PYTHONPATH`` by default: datasets fingerprints its tables
with dill, which pickles a module outside the interpreter's prefix by value (and fails on pyarrow's);
``$SAGE_GPU_SITE`` names such a folder where the environment cannot be written. This module imports nothing
but the standard library before that.

One job in one file (over 600 lines): the check, from the launcher to the passes it starts in its own
processes (``step_report`` by stage a's callback target, ``teacher_forced`` by ``--teacher-forced``), shares
stage b's shape (``stage_b_shape``, ``SHRUNK``, ``PROMPT_TOKENS``) between both sides, and a lent machine
runs it as one module before anything else is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAPER_MODEL = "Qwen/Qwen2.5-Math-7B"
# the plan may be above the measured peak by any margin (it is an upper bound); below it by at most this
TOLERANCE = 0.15
# guards against a hang; a lent machine runs one command for at most 10 minutes, so a stage that needs
# longer than its guard is run alone (--stage)
STAGE_TIMEOUT_S = {"a": 240, "b": 300}
# the longest prompt stage b's pass takes: the memory plan's default (python -m sage.train.plan's
# prompt_tokens), an assumption about the paper's data, since TRL does not truncate prompts
PROMPT_TOKENS = 1024
# the callbacks entry that prints a line per optimiser step (step_report below)
STEP_CALLBACK = "+callbacks.gpu_check._target_=launchers.gpu_check.step_report"
COMMON = [
    "experiment=grpo_branch",  # GRPO + Branch, k3 (divergence=reverse_kl)
    "rollout=hf",
    "tracking.enabled=false",
    "trl.save_strategy=no",
]
TINY_EVAL = [
    "eval.n_samples=8",
    "eval.ks=[1,8]",
    "eval.limit=16",
    "eval.seeds=[0]",
    "eval.perplexity_cap=0",
]
# a small Qwen2: stage b's pass on a CPU at the paper's lengths (the dry run, which tests/test_gpu_check.py
# runs). Its vocabulary is small too: the paper's 152,064 make the LM head's 2,048 x 152,064 log-softmax the
# whole of the pass's time and memory on a CPU, and the path through the fused head is the same.
SHRUNK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
}
STEP = re.compile(r"gpu check: step (\d+): ([\d.]+) s, peak memory ([\d.]+) GiB \(([^)]*)\)")
BATCH = re.compile(r"longest micro-batch (\d+) x \((\d+) prompt \+ (\d+) completion\)")
TEACHER_FORCED = re.compile(r"^teacher forced: (\{.*\})$", re.M)


def stage_a(out: Path, cpu: bool = False) -> list[str]:
    """Stage a's sage-train overrides; ``cpu``: the same path on a CPU, in float32, 1 step of 2 prompts and a
    smaller evaluation."""
    precision = (
        ["model.dtype=float32", "trl.bf16=false", "model.sft.args.bf16=false", "trl.max_steps=1"]
        + ["trl.per_device_train_batch_size=16", "eval.limit=4"]
        if cpu
        else ["model.dtype=bfloat16", "trl.bf16=true", "model.sft.args.bf16=true", "trl.max_steps=3"]
    )
    return [
        "model=tiny_chat",
        *COMMON,
        "model.sft.data.n=32",  # the SFT stage runs; its size is not what is checked
        "model.sft.args.num_train_epochs=1",
        *TINY_EVAL,
        *precision,
        STEP_CALLBACK,
        f"output_dir={out}",
    ]


def stage_b_shape() -> list[str]:
    """Stage b's sage-train overrides: the paper model's config at ``trl=paper`` (its micro-batch, its LoRA,
    its gradient checkpointing, bfloat16) and its 2,048-token completions (``model.max_completion_length``'s
    default). The teacher-forced pass reads its shape from this config composed, and plans the same config
    with the memory plan's own terms."""
    return [
        "model=qwen2.5-math-7b",
        *COMMON,
        "trl=paper",
        "trl.optim=adamw_torch",  # bitsandbytes is not carried
        "model.sft=null",  # its data is on the hub; the random model has nothing to learn from it
        "model.dtype=bfloat16",
        "trl.bf16=true",
        "eval.at_end=false",
    ]


def teacher_forced_command(shrink: bool = False) -> list[str]:
    """Stage b's process: the random model built on the device, one teacher-forced forward and backward."""
    return [sys.executable, "-m", "launchers.gpu_check", "--teacher-forced"] + (
        ["--shrink"] if shrink else []
    )


def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "sage.train", *overrides]


def shown(command: list[str]) -> str:
    """A command as it would be typed (``python`` for this interpreter)."""
    words = ["python" if w == sys.executable else w for w in command]
    return " ".join(f"'{w}'" if any(c in w for c in " []$") else w for w in words)


# ---------------------------------------------------------------- inside the training process


def step_report():
    """The ``callbacks`` entry of stage a: a TrainerCallback printing, per optimiser step, its wall time
    and this process's peak memory so far (the CUDA allocator's peak, else the peak RSS)."""
    import torch
    from transformers import TrainerCallback

    from sage.train.callbacks import peak_memory

    class StepReport(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.started:  # the step's first micro-batch, which generates its completions
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():  # the step's kernels are queued, not done, when the call returns
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.started
            self.started = 0.0
            gib, what = peak_memory()
            print(f"gpu check: step {state.global_step}: {wall:.2f} s, peak memory {gib:.2f} GiB ({what})")
            sys.stdout.flush()

    return StepReport()


def teacher_forced(shrink: bool = False) -> dict:
    """Stage b's pass, in this process: a Qwen2 with the paper model's shapes (``SHRUNK`` ones with
    ``shrink``) and random weights built on the device (on a GPU in the dtype sage-train loads the policy in,
    no copy on the way; on a CPU in float32), made as sage-train's trainer makes it from stage b's config (its
    LoRA adapter, TRL's fused LM head, gradient checkpointing), then one forward and backward of a micro-batch
    of ``trl.per_device_train_batch_size`` sequences of PROMPT_TOKENS random prompt tokens and
    ``model.max_completion_length`` completion tokens, teacher-forced (the completion is given, not
    generated), scored as TRL's loss pass scores it (the completion tokens' log-probabilities, under bfloat16
    autocast with ``trl.bf16``). Returns the shape, the allocator's memory before the pass (``resident``) and
    its peak during it (CUDA only), and the memory plan's terms for the same shape and dtype."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config
    from trl.trainer.utils import add_fused_lm_head

    from sage.config import register_configs
    from sage.models import lora_config
    from sage.paths import CONF_DIR
    from sage.train.memory import ARCH_FILE, GIB, Architecture, batch_of, estimate, training_dtype

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=stage_b_shape())
    shapes = dict(json.loads(ARCH_FILE.read_text())["models"][PAPER_MODEL])
    if shrink:
        shapes.update(SHRUNK)
    arch = Architecture.from_config(shapes)
    batch = batch_of(cfg, PROMPT_TOKENS, 1)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = training_dtype(cfg) if cuda else "float32"
    t = cfg.trl
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shapes), dtype=getattr(torch, dtype))
    model = get_peft_model(model, lora_config(cfg))
    # as GRPOTrainer does: the log-probabilities of the scored tokens, in tiles, without the full logits
    add_fused_lm_head(
        model.get_base_model(),
        temperature=float(t.temperature),
        cast_lm_head_to_fp32=bool(t.cast_lm_head_to_fp32),
        outputs=("log_probs", "entropy"),
    )
    if t.gradient_checkpointing:  # as transformers' Trainer and TRL enable it for a peft model
        kwargs = (
            OmegaConf.to_container(t.gradient_checkpointing_kwargs)
            if t.gradient_checkpointing_kwargs
            else None
        )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.enable_input_require_grads()
    model.train()
    length = batch.prompt_tokens + batch.completion_tokens
    ids = torch.randint(0, arch.vocab_size, (batch.micro, length), device=device)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, : batch.prompt_tokens] = -100  # only the completion is scored, as TRL's labels say
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() / GIB if cuda else None
    started = time.perf_counter()
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cuda and bool(t.bf16)):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    logps = out.log_probs[:, -batch.completion_tokens :]
    (-logps.mean()).backward()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.requires_grad]
    lora = (int(cfg.model.lora.r), list(cfg.model.lora.target_modules))
    planned = estimate(
        arch,
        batch,
        lora=lora,
        beta=float(cfg.divergence.beta),
        optim=str(t.optim),
        gradient_checkpointing=bool(t.gradient_checkpointing),
        vllm_fraction=0.0,  # no engine in this pass
        gpu_gib=0.0,
        dtype=dtype,
    )
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "parameters": model.get_base_model().num_parameters(),
        "vocabulary": arch.vocab_size,
        "dtype": dtype,
        "micro": batch.micro,
        "prompt_tokens": batch.prompt_tokens,
        "completion_tokens": batch.completion_tokens,
        "gradient_checkpointing": bool(t.gradient_checkpointing),
        "scored": int(torch.isfinite(logps).sum()),
        "adapter_gradients": sum(int(g is not None and bool(g.abs().sum() > 0)) for g in grads),
        "adapter_tensors": len(grads),
        "wall_s": round(wall, 3),
        "resident_gib": resident,
        "peak_gib": peak,
        "planned": {k: planned[k] for k in ("weights", "trainable_state", "activations", "logits")},
    }


def describe_pass(result: dict) -> list[str]:
    """The pass's lines: what ran, and the plan's training terms for it."""
    shape = (
        f"{result['micro']} x ({result['prompt_tokens']} prompt + {result['completion_tokens']} completion) "
        "tokens"
    )
    planned = result["planned"]
    return [
        f"pass: {result['parameters']:,} parameters (vocabulary {result['vocabulary']}), "
        f"{result['dtype']}, on {result['device']}: one teacher-forced forward and backward over {shape}, "
        f"gradient checkpointing {'on' if result['gradient_checkpointing'] else 'off'}, "
        f"{result['scored']} completion log-probabilities, {result['adapter_gradients']} of "
        f"{result['adapter_tensors']} adapter tensors with a gradient, {result['wall_s']:.1f} s",
        "plan: "
        + ", ".join(f"{k} {v:.3f}" for k, v in planned.items())
        + " GiB (sage.train.memory.estimate, "
        "the same shape and dtype)",
    ]


def pass_verdict(result: dict) -> tuple[bool, list[str]]:
    """Whether the plan's working set of a micro-batch (activations + logits) held for the measured one (the
    peak during the pass less what was allocated before it, within TOLERANCE), and the lines saying so;
    the resident memory beside the plan's weights and adapter."""
    planned = result["planned"]
    held, verdict = memory_verdict(
        result["peak_gib"] - result["resident_gib"], planned["activations"] + planned["logits"]
    )
    return held, [
        f"working set (peak during the pass less before it) against the plan's activations + logits: "
        f"{verdict}",
        f"resident before the pass: {result['resident_gib']:.2f} GiB (plan: weights "
        f"{planned['weights']:.2f} + the adapter, without its gradient and moments)",
    ]


# ---------------------------------------------------------------- the launcher


@dataclass
class Stage:
    name: str
    what: str
    ok: bool = False
    wall_s: float = 0.0
    steps: list[tuple[int, float, float, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float | None:
        return max((s[2] for s in self.steps), default=None)


def run_logged(command: list[str], log: Path, timeout: int, env: dict[str, str]) -> tuple[int, str, float]:
    """(exit status, output, wall seconds) of ``command``, its output also written to ``log``; 124 when it
    ran past ``timeout``."""
    print(f"$ {shown(command)}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        try:
            run = subprocess.run(
                command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=REPO
            )
            rc = run.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - started
    return rc, log.read_text(errors="replace"), wall


def failure(text: str, lines: int = 60) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def parse_steps(text: str) -> list[tuple[int, float, float, str]]:
    return [(int(s), float(w), float(m), what) for s, w, m, what in STEP.findall(text)]


def eval_table(text: str) -> list[str]:
    """The evaluation's pass@k table, the last lines starting with ``|`` before the ``run outputs`` line."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("run outputs:")), len(lines))
    table: list[str] = []
    for line in reversed(lines[:end]):
        if line.startswith("|"):
            table.insert(0, line)
        elif line.strip() or table:
            break
    return table


def memory_verdict(peak: float, planned: float) -> tuple[bool, str]:
    """Whether the plan held (the measured figure at most TOLERANCE above it), and the line saying so."""
    over = peak / planned - 1
    held = over <= TOLERANCE
    verdict = "within" if held else "UNDERESTIMATED: beyond"
    return held, (
        f"memory: peak {peak:.2f} GiB measured, {planned:.2f} GiB planned ({over:+.1%} against the plan; "
        f"{verdict} the +{TOLERANCE:.0%} tolerance)"
    )


def run_stage_a(root: Path, logs: Path, env: dict[str, str]) -> Stage:
    stage = Stage(
        "a", "tiny_chat: LoRA SFT then LoRA GRPO + Branch (k3), bf16, rollout=hf, 3 steps, tiny eval"
    )
    seed_testbed_cache()
    rc, text, stage.wall_s = run_logged(
        train_command(stage_a(root / "a")), logs / "a.log", STAGE_TIMEOUT_S["a"], env
    )
    stage.steps = parse_steps(text)
    stage.ok = rc == 0 and len(stage.steps) == 3
    stage.notes += [m.group(0) for m in BATCH.finditer(text)][:1] + eval_table(text)
    if not stage.ok:
        stage.notes.append(f"exit {rc}{' (timed out)' if rc == 124 else ''}; {len(stage.steps)} step lines")
        print(failure(text))
    return stage


def run_stage_b(logs: Path, env: dict[str, str]) -> tuple[Stage, bool | None]:
    """Stage b, and whether the plan held (the measured working set at most TOLERANCE above the plan's
    activations + logits; None: nothing to compare)."""
    stage = Stage(
        "b",
        f"random Qwen2.5-Math-7B shapes, trl=paper micro-batch, {PROMPT_TOKENS} + 2048 tokens teacher-forced",
    )
    rc, text, stage.wall_s = run_logged(teacher_forced_command(), logs / "b.log", STAGE_TIMEOUT_S["b"], env)
    found = TEACHER_FORCED.search(text)
    if rc != 0 or found is None:
        stage.notes.append(f"exit {rc}{' (timed out)' if rc == 124 else ''}; no result line")
        print(failure(text))
        return stage, None
    result = json.loads(found.group(1))
    stage.steps = [(1, result["wall_s"], result["peak_gib"], "cuda:0 allocated")]
    held, lines = pass_verdict(result)
    stage.ok = result["adapter_gradients"] > 0
    stage.notes += describe_pass(result) + lines
    print("\n".join(stage.notes))
    return stage, held


def machine() -> str:
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpu = "no nvidia-smi"
    packages = ", ".join(f"{n} {version(n)}" for n in ("torch", "transformers", "peft", "accelerate", "trl"))
    return f"{gpu or 'no GPU seen'}; Python {platform.python_version()}; {packages}"


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return r.stdout.strip() or "unknown"


def seed_testbed_cache() -> None:
    """The testbed models ``make wheelhouse`` carried (``wheelhouse/testbed/``) into the model cache, so
    stage a does not train its base model again."""
    from sage.paths import cache_dir

    for built in sorted((REPO / "wheelhouse" / "testbed").glob("*")):
        target = cache_dir() / "testbed" / built.name
        if built.is_dir() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(built, target)
            print(f"testbed model {built.name}: copied from wheelhouse/testbed into {target.parent}")


def summary(stages: list[Stage], plan_held: bool | None) -> list[str]:
    """The block for docs/results/gpu_check.md."""
    lines = [
        f"### {time.strftime('%Y-%m-%d')}, commit {commit()}",
        "",
        f"Machine: {machine()}.",
        "",
        "| stage | what | result | wall | per step (s) | peak GPU memory |",
        "|---|---|---|---|---|---|",
    ]
    for s in stages:
        per_step = ", ".join(f"{w:.1f}" for _, w, _, _ in s.steps) or "-"
        peak = f"{s.peak:.2f} GiB ({s.steps[-1][3]})" if s.steps else "-"
        result = "ok" if s.ok else "FAILED"
        lines.append(f"| {s.name} | {s.what} | {result} | {s.wall_s:.0f} s | {per_step} | {peak} |")
    for s in stages:
        lines += ["", f"Stage {s.name}:", *[f"    {n}" for n in s.notes if n]]
    if plan_held is not None:
        lines += [
            "",
            f"The memory plan {'held' if plan_held else 'did NOT hold'} (tolerance +{TOLERANCE:.0%}).",
        ]
    return lines


# what every stage imports, tried once before any stage starts
IMPORTS = "import datasets, hydra, math_verify, omegaconf, optuna, pebble, peft, torch, transformers, trl"
IMPORTS += "; import sage.train.main"


def install_and_rerun(wheelhouse: Path, argv: list[str]) -> int:
    """``wheelhouse/requirements.txt`` into this Python's environment, or into the folder ``$SAGE_GPU_SITE``
    (no index, no dependency resolution), then this check again in a new process (with that folder first on
    its PYTHONPATH)."""
    site = os.environ.get("SAGE_GPU_SITE")
    pins = wheelhouse / "requirements.txt"
    if not pins.is_file():
        print(f"gpu check: {pins} is missing: `make wheelhouse` (with network) makes it; carry wheelhouse/")
        return 2
    for built in sorted((wheelhouse / "testbed").glob("*")):
        print(f"gpu check: carried testbed model {built.name}")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--find-links",
        str(wheelhouse),
        "-r",
        str(pins),
    ] + (["--upgrade", "--target", site] if site else [])
    print(f"$ {shown(command)}", flush=True)
    if subprocess.run(command).returncode != 0:
        return 2
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "launchers.gpu_check", *argv], env=env, cwd=REPO).returncode


def without_install(argv: list[str]) -> list[str]:
    """``argv`` less ``--install`` and its folder, if one was given."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--install":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        elif not a.startswith("--install="):
            out.append(a)
    return out


def dry_run(root: Path) -> int:
    """Each stage's commands and its config composed and validated as sage-train would (a misspelt override
    fails here, on any machine), then stage b's pass itself on this machine's CPU: the paper's micro-batch
    and 2,048 completion tokens through the shrunk model (``SHRUNK``: 2 layers, hidden size 64, the paper
    model's vocabulary), in float32."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_method

    from sage.config import register_configs, validate
    from sage.paths import CONF_DIR

    stages = {
        "a": [("train", train_command(stage_a(root / "a")), stage_a(root / "a"))],
        "b": [("pass", teacher_forced_command(), stage_b_shape())],
    }
    register_configs()
    get_method("launchers.gpu_check.step_report")  # the callbacks entry resolves
    failed = False
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for name, commands in stages.items():
            print(f"stage {name}:")
            for what, command, overrides in commands:
                print(f"  {what}: {shown(command)}")
                try:
                    cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
                    validate(cfg)
                except Exception as e:  # sage's ConfigError, and Hydra's errors of many types
                    print(f"  composition FAILED: {type(e).__name__}: {e}")
                    failed = True
                    continue
                print(f"  composed: {composed_facts(cfg)}")
    if failed:
        return 1
    print(f"stage b's pass on this CPU, shrunk ({shown(teacher_forced_command(shrink=True))}):")
    r = subprocess.run(teacher_forced_command(shrink=True), capture_output=True, text=True, cwd=REPO)
    found = TEACHER_FORCED.search(r.stdout)
    if r.returncode != 0 or found is None:
        print(f"  FAILED (exit {r.returncode}):\n{failure(r.stdout + r.stderr, 20)}")
        return 1
    result = json.loads(found.group(1))
    print("\n".join(f"  {line}" for line in describe_pass(result)))
    return 0 if result["adapter_gradients"] > 0 else 1


def composed_facts(cfg) -> str:
    """What a composed stage config says about the check's own points, read back from the config."""
    t, m = cfg.trl, cfg.model
    lora = f"LoRA r={m.lora.get('r', 8)}" if m.lora is not None else "full fine-tuning"
    source = m.source.get("repo_id") or m.source._target_.rsplit(".", 1)[-1]
    return (
        f"model {source} ({m.dtype}, {lora}, chat={m.chat}, SFT {'on' if m.sft is not None else 'off'}); "
        f"divergence {cfg.divergence._target_.rsplit('.', 1)[-1]} beta {cfg.divergence.beta}; guide "
        f"{cfg.guide._target_.rsplit('.', 1)[-1]}; trl bf16={t.bf16} optim={t.optim} max_steps={t.max_steps} "
        f"per_device_train_batch_size={t.per_device_train_batch_size} "
        f"gradient_accumulation_steps={t.get('gradient_accumulation_steps', 1)}; completions "
        f"{m.max_completion_length} tokens; rollout={'vllm' if t.get('use_vllm') else 'hf'}; "
        f"evaluation {'at end, ' + str(cfg.eval.n_samples) + ' samples' if cfg.eval.at_end else 'off'}; "
        f"tracking {'on' if cfg.tracking.enabled else 'off'}; callbacks {list(cfg.callbacks)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, compose the configs")
    parser.add_argument("--stage", choices=["a", "b", "all"], default="all")
    parser.add_argument("--out", type=Path, help="the runs' folder (default outputs/gpu_check/<time>)")
    parser.add_argument("--logs", type=Path, help="each stage's output and the summary (default: --out)")
    parser.add_argument(
        "--install",
        nargs="?",
        const=REPO / "wheelhouse",
        type=Path,
        metavar="WHEELHOUSE",
        help="first install the wheelhouse (default wheelhouse/) into $SAGE_GPU_SITE and run with it",
    )
    parser.add_argument("--teacher-forced", action="store_true", help=argparse.SUPPRESS)  # stage b's process
    parser.add_argument("--shrink", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.install:
        return install_and_rerun(args.install, without_install(argv))
    if args.teacher_forced:
        print("teacher forced: " + json.dumps(teacher_forced(shrink=args.shrink)), flush=True)
        return 0
    root = (args.out or REPO / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    if args.dry_run:
        return dry_run(root)
    missing = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, cwd=REPO)
    if missing.returncode != 0:
        print(f"gpu check: sage's packages do not import ({failure(missing.stderr, 3)}); run with --install")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu check: no CUDA device here (python -m launchers.gpu_check --dry-run composes the stages)")
        return 2
    logs = (args.logs or root).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    print(f"gpu check: {machine()}", flush=True)
    stages, plan_held = [], None
    if args.stage in ("a", "all"):
        stages.append(run_stage_a(root, logs, env))
    if args.stage in ("b", "all"):
        stage, plan_held = run_stage_b(logs, env)
        stages.append(stage)
    lines = summary(stages, plan_held)
    (logs / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(["", "----- summary (docs/results/gpu_check.md, Runs) -----", *lines]))
    return 0 if all(s.ok for s in stages) and plan_held is not False else 1


if __name__ == "__main__":
    sys.exit(main())
