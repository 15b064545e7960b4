"""`make gpu-check`: what to run on a lent GPU machine (CUDA torch, no network), in two stages.

    make wheelhouse                       # here (network): the wheels sage needs there, and the testbed model
    make gpu-check                        # there: installs wheelhouse/, then both stages (exit 1: a failure)
    python3 -m launchers.gpu_check --install [--stage a|b|all] [--logs DIR]   # the same without make
    python -m launchers.gpu_check --dry-run   # any machine: the commands, each stage's config composed

a. The CUDA path without vLLM: ``sage-train`` with ``rollout=hf`` on the testbed's chat model
   (``model=tiny_chat``: LoRA SFT, merged, then LoRA RL, the paper model's path at 1M parameters), GRPO with
   the Branch guide under k3 (``experiment=grpo_branch``: ``divergence=reverse_kl``), bfloat16 weights and
   autocast, 3 optimiser steps and a tiny evaluation of the base and trained models.
b. The paper's shape: a randomly initialised Qwen2 with Qwen2.5-Math-7B's layer shapes (built on the GPU in
   bfloat16 from ``sage/train/architectures.json``; the testbed's ChatML tokenizer, whose ids the model's
   larger vocabulary contains, so sampled ids past it decode to nothing), LoRA GRPO + Branch at
   ``trl=paper``'s batch (1 completion per forward pass, 8 prompts x 8 generations per step), 64-token
   completions, 2 steps, no evaluation. Its peak GPU memory (the allocator's, in the training process) is set
   beside the memory plan's estimate for the same shape (``python -m sage.train.memory``, the longest
   prompt of the run's data): the check fails when the plan underestimates by more than :data:`TOLERANCE`.

Both stages run with ``tracking.enabled=false`` (MLflow is not carried) and the AdamW of torch (bitsandbytes'
8-bit one is not carried either). Each step prints a ``gpu check: step N`` line (its wall time and the peak
memory so far) through the ``callbacks`` node. The end is a summary block for docs/results/gpu_check.md.
A stage's output and the summary go to ``--logs`` (default: the run folder under outputs/gpu_check/).

``--install`` first installs ``wheelhouse/requirements.txt`` from ``wheelhouse/`` alone (no index, no
dependency resolution: ``python -m launchers.wheelhouse --check`` vouched for the set) into the environment
of the Python that runs it, beside the machine's own packages (CUDA torch among them), then runs the check in
a new process. Not into a folder of its own on ``PYTHONPATH`` by default: datasets fingerprints its tables
with dill, which pickles a module outside the interpreter's prefix by value (and fails on pyarrow's);
``$SAGE_GPU_SITE`` names such a folder where the environment cannot be written. This module imports nothing
but the standard library before that.
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAPER_MODEL = "Qwen/Qwen2.5-Math-7B"
# the plan may be above the measured peak by any margin (it is an upper bound); below it by at most this
TOLERANCE = 0.15
# guards against a hang; a lent machine runs one command for at most 10 minutes, so a stage that needs
# longer than its guard is run alone (--stage)
STAGE_TIMEOUT_S = {"a": 240, "build": 150, "b": 300}
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
# a small Qwen2 with the paper model's vocabulary: stage b's path on a CPU (tests/test_gpu_check.py)
SHRUNK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
STEP = re.compile(r"gpu check: step (\d+): ([\d.]+) s, peak memory ([\d.]+) GiB \(([^)]*)\)")
BATCH = re.compile(r"longest micro-batch (\d+) x \((\d+) prompt \+ (\d+) completion\)")
PLAN_TOTAL = re.compile(r"memory estimate per GPU: ([\d.]+) GiB")


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


def stage_b_shape(steps: int = 2) -> list[str]:
    """Stage b's overrides that the memory plan takes as they are (the model's shape and the batch)."""
    return [
        "model=qwen2.5-math-7b",
        *COMMON,
        "trl=paper",
        "trl.optim=adamw_torch",  # bitsandbytes is not carried
        f"trl.max_steps={steps}",
        "model.sft=null",  # its data is on the hub; the random model has nothing to learn from it
        "model.max_completion_length=64",
        "model.dtype=bfloat16",
        "trl.bf16=true",
        "eval.at_end=false",  # the peak is training's
        "eval.backend=hf",
    ]


def stage_b(out: Path, folder: Path, steps: int = 2) -> list[str]:
    """Stage b's sage-train overrides: the shape, on the random model in ``folder``."""
    return [*stage_b_shape(steps), f"model.source.repo_id={folder}", STEP_CALLBACK, f"output_dir={out}"]


def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "sage.train", *overrides]


def plan_command(shape: list[str], prompt_tokens: int, gpu_gib: float) -> list[str]:
    """The memory plan of stage b's shape. The architecture is the stored copy of the paper model's
    config.json, which the random model is built from."""
    return [
        sys.executable,
        "-m",
        "sage.train.memory",
        *shape,
        f"prompt_tokens={prompt_tokens}",
        f"gpu_gib={gpu_gib:g}",
    ]


def build_command(folder: Path, shrink: bool = False) -> list[str]:
    return [sys.executable, "-m", "launchers.gpu_check", "--build-random-model", str(folder)] + (
        ["--shrink"] if shrink else []
    )


def shown(command: list[str]) -> str:
    """A command as it would be typed (``python`` for this interpreter)."""
    words = ["python" if w == sys.executable else w for w in command]
    return " ".join(f"'{w}'" if any(c in w for c in " []$") else w for w in words)


# ---------------------------------------------------------------- inside the training process


def step_report():
    """The ``callbacks`` entry of both stages: a TrainerCallback printing, per optimiser step, its wall time
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


def build_random_model(folder: Path, shrink: bool = False) -> None:
    """A Qwen2 with the paper model's shapes (``SHRUNK`` ones with ``shrink``) and random weights into
    ``folder``, with the testbed's ChatML tokenizer: built on the GPU in bfloat16 where there is one (no
    float32 copy on the way), else on the CPU in float32."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sage.testbed.tokenizer import build_tokenizer
    from sage.train.memory import ARCH_FILE

    shapes = dict(json.loads(ARCH_FILE.read_text())["models"][PAPER_MODEL])
    if shrink:
        shapes.update(SHRUNK)
    tokenizer = build_tokenizer(chat=True)
    if len(tokenizer) > shapes["vocab_size"]:
        raise ValueError(
            f"the tokenizer's {len(tokenizer)} ids do not fit a vocabulary of {shapes['vocab_size']}"
        )
    ids = {f"{t}_token_id": getattr(tokenizer, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    config = Qwen2Config(**shapes, **ids)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for key, value in ids.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"random model: {model.num_parameters() / 1e9:.2f}B parameters ({PAPER_MODEL}'s shapes"
        f"{', shrunk' if shrink else ''}, vocabulary {shapes['vocab_size']}), {dtype}, built and saved in "
        f"{time.perf_counter() - started:.0f} s on {where.replace(' ', '_')}"
    )


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
    """Whether the plan held (the measured peak at most TOLERANCE above it), and the line saying so."""
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


def run_stage_b(
    root: Path, logs: Path, env: dict[str, str], model_dir: Path | None
) -> tuple[Stage, bool | None]:
    """Stage b, and whether the plan held (the measured peak at most TOLERANCE above the estimate; None:
    nothing to compare)."""
    stage = Stage(
        "b", "random Qwen2.5-Math-7B shapes, LoRA GRPO + Branch (k3), trl=paper batch, 64 tokens, 2 steps"
    )
    folder = Path(tempfile.mkdtemp(prefix="sage-gpu-check-7b-", dir=model_dir))
    held = None
    try:
        rc, text, _ = run_logged(build_command(folder), logs / "b_build.log", STAGE_TIMEOUT_S["build"], env)
        if rc != 0:
            stage.notes.append(f"building the random model failed (exit {rc})")
            print(failure(text))
            return stage, held
        stage.notes.append(next((line for line in text.splitlines() if line.startswith("random model:")), ""))
        rc, text, stage.wall_s = run_logged(
            train_command(stage_b(root / "b", folder)), logs / "b.log", STAGE_TIMEOUT_S["b"], env
        )
        stage.steps = parse_steps(text)
        batch = BATCH.search(text)
        stage.ok = rc == 0 and len(stage.steps) == 2 and batch is not None
        if not stage.ok:
            stage.notes.append(
                f"exit {rc}{' (timed out)' if rc == 124 else ''}; {len(stage.steps)} step lines"
            )
            print(failure(text))
            return stage, held
        prompt_tokens = int(batch.group(2))
        stage.notes.append(batch.group(0))
        plan = plan_command(stage_b_shape(), prompt_tokens, gpu_gib())
        print(f"$ {shown(plan)}", flush=True)
        r = subprocess.run(plan, capture_output=True, text=True, env=env, cwd=REPO)
        (logs / "b_plan.txt").write_text(r.stdout + r.stderr)
        print(r.stdout.rstrip())
        estimate = PLAN_TOTAL.search(r.stdout)
        if estimate is None:
            stage.ok = False
            stage.notes.append(f"the plan printed no estimate (exit {r.returncode}): {failure(r.stderr, 5)}")
            return stage, held
        held, verdict = memory_verdict(stage.peak, float(estimate.group(1)))
        stage.notes.append(verdict)
        stage.notes += [line for line in r.stdout.splitlines() if PLAN_TOTAL.search(line)]
        return stage, held
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # tens of GB of random weights


def gpu_gib() -> float:
    """The GPU's memory in GiB (nvidia-smi), 80 if it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return round(float(out.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 80.0


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
    """Each stage's commands, and its config composed and validated as sage-train would (no model, no
    training): a misspelt override fails here, on any machine."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_method

    from sage.config import register_configs, validate
    from sage.paths import CONF_DIR

    folder = Path("/tmp/sage-gpu-check-7b-XXXX")  # made by the build command on the GPU machine
    stages = {
        "a": [("train", train_command(stage_a(root / "a")))],
        "b": [
            ("build", build_command(folder)),
            ("train", train_command(stage_b(root / "b", folder))),
            ("plan", plan_command(stage_b_shape(), prompt_tokens_of_b(), 139.8)),
        ],
    }
    register_configs()
    get_method("launchers.gpu_check.step_report")  # the callbacks entry resolves
    failed = False
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for name, commands in stages.items():
            print(f"stage {name}:")
            for what, command in commands:
                print(f"  {what}: {shown(command)}")
                if what != "train":
                    continue
                try:
                    cfg = compose(config_name="train", overrides=command[3:], return_hydra_config=True)
                    validate(cfg)
                except Exception as e:  # sage's ConfigError, and Hydra's errors of many types
                    print(f"  composition FAILED: {type(e).__name__}: {e}")
                    failed = True
                    continue
                print(f"  composed: {composed_facts(cfg)}")
    if failed:
        return 1
    print("stage b's memory plan (prompt tokens: the longest prompt of its data, as sage-train measures it):")
    r = subprocess.run(stages["b"][2][1], capture_output=True, text=True)
    print("\n".join(f"  {line}" for line in (r.stdout + r.stderr).strip().splitlines()))
    return 0 if r.returncode == 0 and PLAN_TOTAL.search(r.stdout) else 1


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


def prompt_tokens_of_b() -> int:
    """The longest prompt of stage b's data in the random model's tokenizer, rendered as TRL renders it: what
    sage-train prints as the batch's longest micro-batch (``sage.train.main.longest_prompt``, an entry
    point's, which a launcher does not import; tests/test_gpu_check.py compares the two)."""
    from hydra import compose, initialize_config_dir

    from sage.config import instantiate_node, register_configs
    from sage.paths import CONF_DIR
    from sage.testbed.tokenizer import build_tokenizer

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=stage_b_shape())
    prompts = instantiate_node(cfg.data, chat=cfg.model.chat)["prompt"]
    tokenizer = build_tokenizer(chat=True)
    if prompts and isinstance(prompts[0], list):  # chat messages, through the chat template
        prompts = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts
        ]
        return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    return max((len(ids) for ids in tokenizer(list(prompts))["input_ids"]), default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, compose the configs")
    parser.add_argument("--stage", choices=["a", "b", "all"], default="all")
    parser.add_argument("--out", type=Path, help="the runs' folder (default outputs/gpu_check/<time>)")
    parser.add_argument("--logs", type=Path, help="each stage's output and the summary (default: --out)")
    parser.add_argument(
        "--model-dir", type=Path, help="where stage b's random model is written (default /tmp)"
    )
    parser.add_argument(
        "--install",
        nargs="?",
        const=REPO / "wheelhouse",
        type=Path,
        metavar="WHEELHOUSE",
        help="first install the wheelhouse (default wheelhouse/) into $SAGE_GPU_SITE and run with it",
    )
    parser.add_argument("--build-random-model", type=Path, metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument("--shrink", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.install:
        return install_and_rerun(args.install, without_install(argv))
    if args.build_random_model:
        build_random_model(args.build_random_model, shrink=args.shrink)
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
        stage, plan_held = run_stage_b(root, logs, env, args.model_dir)
        stages.append(stage)
    lines = summary(stages, plan_held)
    (logs / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(["", "----- summary (docs/results/gpu_check.md, Runs) -----", *lines]))
    return 0 if all(s.ok for s in stages) and plan_held is not False else 1


if __name__ == "__main__":
    sys.exit(main())
