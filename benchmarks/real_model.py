"""``make bench``'s sections on the real 0.5B model (``benchmarks.bench`` lists them): real_rollout (its GRPO
step under rollout=hf and rollout=vllm, each backend in a process of its own: ``python -m benchmarks.bench
--real-backend``) and engine (its evaluation through vLLM against this machine's matrix-product limit)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

from benchmarks import REPO

# 8 prompts x 8 completions (trl=paper's step) of at most 32 tokens: every step also runs three passes of
# the 0.5B model over 64 sequences (old and reference log-probs, the loss with its backward), which on two
# cores take minutes, so the length is kept short; 2 steps, the first a warm-up (the figures are the second's)
# One step per backend: its rollout is the only work that differs, and TRL's log-prob passes and backward
# over 64 sequences of the 0.5B model make each step minutes long on a CPU. vLLM's engine has
# run a forward pass when it is built (it sizes its KV cache from one), so the first step is not a warm-up.
REAL_PROMPTS, REAL_GENERATIONS, REAL_TOKENS, REAL_STEPS = 8, 8, 32, 1
ENGINE_PROMPTS, ENGINE_SAMPLES, ENGINE_TOKENS = 30, 8, 128  # the block issue 46 measured: 30 problems x 8


def _others_cpu_seconds(own: list[psutil.Process]) -> float:
    """CPU seconds the machine has been busy, bar those of the processes ``own``."""
    busy = psutil.cpu_times()
    return busy.user + busy.system + getattr(busy, "nice", 0.0) - _cpu_seconds(own)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def trainer_precision() -> dict:
    """The real-model step's GRPOConfig precision keys: as ``trl=paper`` trains a paper model on the cluster
    (the frozen base in bfloat16 under bf16 autocast), here under the CPU's bfloat16 autocast
    (``sage.trl_checks.cpu_precision``) where this machine computes bfloat16; float32 where it does not
    (``real_trainer_dtype`` says which)."""
    from omegaconf import OmegaConf

    from sage.models import policy_dtype
    from sage.trl_checks import cpu_precision

    if not trainer_computes_bfloat16():
        return {"bf16": False}
    # the paper's models: a bfloat16 checkpoint whose frozen base LoRA keeps in bfloat16 (model.dtype)
    frozen = policy_dtype("bfloat16", lora=True)
    return {
        "bf16": True,
        "model_init_kwargs": {"dtype": frozen},
        **cpu_precision(OmegaConf.create({"bf16": True}), "trl"),
    }


def trainer_computes_bfloat16() -> bool:
    from sage.hardware import cpu_computes_bfloat16

    return torch.cuda.is_available() or cpu_computes_bfloat16()


def _matrix_params(arch) -> int:
    """Parameters of a Qwen2-style model's matrix products per token (attention's projections, the MLP's
    three, and the output layer): a forward pass costs 2 FLOPs per such parameter per token."""
    hidden, inner, layers = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    kv = arch.num_key_value_heads * (hidden // arch.num_attention_heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner
    return layers * per_layer + hidden * arch.vocab_size


def _gemm_limit(dtype: torch.dtype, rows: int, arch) -> float:
    """This process's matrix-product limit in ``dtype``: the best of the model's widest layer (hidden x
    intermediate) at ``rows`` rows and a square product of 2048."""
    return max(
        _gemm_flops(dtype, rows, arch.hidden_size, arch.intermediate_size),
        _gemm_flops(dtype, 2048, 2048, 2048),
    )


def _real_step_times(
    rollout: str, model: str, dataset, steps: int, tokens: int, served: dict
) -> dict[str, list[float]]:
    """Per optimiser step of one ``rollout`` ("hf" or "vllm"): the step's wall seconds, its rollout's (the
    generation, and for vllm the adapter hand-over apart), and CPU seconds per wall second during the
    rollout of this process and of the engine's processes."""
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from sage.objective.divergences import NoDivergence
    from sage.objective.guides import NoGuide
    from sage.train.trl_import import import_grpo_trainer

    import_grpo_trainer(use_vllm=rollout == "vllm")
    from sage.train.trainer import SageGRPOTrainer
    from sage.train.vllm_rollout import VllmRollout

    times: dict[str, list[float]] = {
        "step": [],
        "rollout": [],
        "handover": [],
        "cpu_per_wall": [],
        "others_cpu_per_wall": [],
        "forward": [],
        "backward": [],
        "loss_tokens": [],
        "engine_cpu_per_wall_in_loss": [],
    }
    # per step: the loss passes' seconds, the engine's CPU seconds meanwhile, and the tokens they computed
    parts = {"forward": 0.0, "backward": 0.0, "engine_cpu": 0.0, "loss_tokens": 0.0}
    available: list[int] = []  # the machine's available memory after each loss pass
    me, engine = psutil.Process(), []
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=REAL_GENERATIONS,  # one prompt's group per forward pass
            gradient_accumulation_steps=REAL_PROMPTS,  # so one step generates 8 prompts x 8 completions
            num_generations=REAL_GENERATIONS,
            max_completion_length=tokens,
            # no reference pass: it is the same work under both backends, and it is not what is compared
            beta=0.0,
            use_bias_correction_kl=False,
            learning_rate=1e-5,
            max_steps=steps,
            save_strategy="no",
            report_to="none",
            logging_steps=1,
            gradient_checkpointing=False,
            temperature=0.7,
            seed=0,
            **trainer_precision(),
        )
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
        rollout_func = None
        if rollout == "vllm":
            # as sage-train builds it under rollout=vllm (conf/rollout/vllm.yaml): its dtype and memory share
            rollout_func = VllmRollout(
                args,
                lora,
                dtype=served["dtype"],
                engine_dtype=served["engine_dtype"],
                cpu_memory_utilization=served["cpu_memory_utilization"],
            )

        class Steps(TrainerCallback):
            """Each step's wall seconds, and the CPU seconds per wall second that processes other than this
            one and its engine took meanwhile: a step that shared the cores is seen to have shared them."""

            def on_step_begin(self, args, state, control, **kwargs):
                if not hasattr(self, "started"):
                    self.started, self.others = time.perf_counter(), _others_cpu_seconds([me, *engine])

            def on_step_end(self, args, state, control, **kwargs):
                now, others = time.perf_counter(), _others_cpu_seconds([me, *engine])
                times["step"].append(now - self.started)
                passes = parts["forward"] + parts["backward"]
                times["engine_cpu_per_wall_in_loss"].append(parts["engine_cpu"] / max(passes, 1e-9))
                for part in parts:
                    if part != "engine_cpu":
                        times[part].append(parts[part])
                    parts[part] = 0.0
                times["others_cpu_per_wall"].append((others - self.others) / (now - self.started))
                self.started, self.others = now, others

        before = {c.pid for c in psutil.Process().children(recursive=True)}
        trainer = SageGRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [float(len(str(c)) % 5) for c in completions]],
            args=args,
            train_dataset=dataset,
            peft_config=lora,
            divergence=NoDivergence(),
            guide=NoGuide(),
            callbacks=[Steps()],
            rollout_func=rollout_func,
        )
        engine += [c for c in me.children(recursive=True) if c.pid not in before]  # vLLM's processes
        generate = rollout_func.__call__ if rollout == "vllm" else trainer._generate_single_turn

        def timed(*a, **kw):
            t0, cpu0, engine0 = time.perf_counter(), me.cpu_times(), _cpu_seconds(engine)
            out = generate(*a, **kw)
            wall = time.perf_counter() - t0
            cpu1 = me.cpu_times()
            cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system + _cpu_seconds(engine) - engine0
            times["rollout"].append(wall)
            times["cpu_per_wall"].append(cpu / wall)
            return out

        if rollout == "vllm":  # TRL hands the adapter over (sync_weights), then calls rollout_func
            trainer.rollout_func = timed
            sync = rollout_func.sync_weights

            def timed_sync():
                t0 = time.perf_counter()
                sync()
                times["handover"].append(time.perf_counter() - t0)

            trainer.vllm_generation = SimpleNamespace(sync_weights=timed_sync)
        else:
            trainer._generate_single_turn = timed
        # the rest of the step, split: the loss passes' forward and their backward (what both backends
        # should spend alike), and the completions' mean length (the same work needs the same lengths)
        for name, owner in (("forward", trainer), ("backward", trainer.accelerator)):
            method = getattr(owner, "compute_loss" if name == "forward" else "backward")

            def timed_part(*a, _method=method, _name=name, **kw):
                if _name == "forward":  # compute_loss(model, inputs): the rows as padded
                    inputs = a[1]
                    parts["loss_tokens"] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
                t0, engine0 = time.perf_counter(), _cpu_seconds(engine)
                try:
                    return _method(*a, **kw)
                finally:
                    parts[_name] += time.perf_counter() - t0
                    parts["engine_cpu"] += _cpu_seconds(engine) - engine0
                    available.append(psutil.virtual_memory().available)

            setattr(owner, "compute_loss" if name == "forward" else "backward", timed_part)
        try:
            trainer.train()
        finally:
            if rollout_func is not None:
                rollout_func.close()
        times["available_gib_in_loss"] = [min(available) / 2**30] if available else []
        times["completion_length"] = [
            h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
        ]
    return times


def _real_model():
    """(the composed config of the real 0.5B model under rollout=vllm, its converted folder)."""
    from hydra import compose, initialize_config_dir

    from sage.config import register_configs
    from sage.models import from_package_gguf
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=qwen2.5-coder-0.5b-instruct", "rollout=vllm"])
    return cfg, from_package_gguf(list(cfg.model.source.packages), cfg.model.source.sha256)


def _real_backend(backend: str, steps: int, tokens: int) -> dict[str, list[float]]:
    """``_real_step_times`` of one backend on the real model and the bench's prompts (run in a process of
    its own by :func:`bench_real_rollout`)."""
    from datasets import Dataset

    from sage.data.benchmarks import math_data
    from sage.data.prompts import make_prompt

    cfg, model = _real_model()
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()]
    easy = sorted((r for r in rows if r.get("level") == 1), key=lambda r: len(r["problem"]))[:REAL_PROMPTS]
    dataset = Dataset.from_list(
        [{"prompt": make_prompt(r["problem"], True), "answer": r["answer"]} for r in easy]
    )
    r = cfg.rollout_func
    engine = {
        "dtype": str(r.dtype),
        "engine_dtype": str(r.engine_dtype),
        "cpu_memory_utilization": float(r.cpu_memory_utilization),
    }
    return _real_step_times(backend, model, dataset, steps, tokens, engine)


def bench_real_rollout(steps: int = REAL_STEPS, tokens: int = REAL_TOKENS) -> dict[str, float | str]:
    """The real 0.5B model's GRPO step with each rollout backend, each in a fresh process of its own (so
    that neither inherits the other's allocator, threads or imports), on the same prompts (the shortest
    level-1 MATH-500 problems), group size, length and seed; medians over the steps. ``rest`` is the step
    without its rollout and hand-over: the scoring, the loss passes' forward and backward (printed apart,
    with the engine's CPU seconds per wall second meanwhile) and the optimiser. It is the same work for
    both: under rollout=vllm the importance-sampling correction's ratio comes from the training forward
    (one generation batch per optimiser step), not from TRL's extra log-prob pass over the rollouts
    (sage.train.deferred_ratio). The trainer computes as ``trl=paper`` does (:func:`trainer_precision`); its
    loss passes' rate counts 2 FLOPs per matrix parameter per token they compute (the rows as padded), for the
    backward as for the forward (the input gradients through the frozen base; the LoRA factors' own are a
    small fraction), beside the matrix-product limit this process measures in the trainer's dtype."""
    from transformers import AutoConfig

    bf16 = trainer_computes_bfloat16()
    arch = AutoConfig.from_pretrained(_real_model()[1])
    dtype = torch.bfloat16 if bf16 else torch.float32
    limit = _gemm_limit(dtype, 1024, arch)
    out: dict[str, float | str] = {
        "real_rollout_shape": f"{REAL_PROMPTS} prompts x {REAL_GENERATIONS} completions x <= {tokens} tokens",
        "real_trainer_dtype": "bfloat16 (bf16 autocast, the frozen base in bfloat16)"
        if bf16
        else "float32 (this machine has no bfloat16 arithmetic)",
        "real_trainer_gemm_limit_gflops": round(limit / 1e9, 1),
    }
    medians = {}
    for backend in ("hf", "vllm"):
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.bench",
                    "--real-backend",
                    backend,
                    "--real-out",
                    result.name,
                    "--real-steps",
                    str(steps),
                    "--real-tokens",
                    str(tokens),
                ],
                check=True,
                cwd=REPO,
            )
            times = json.loads(Path(result.name).read_text())
        m = {k: statistics.median(v) for k, v in times.items() if v}
        m.setdefault("handover", 0.0)
        rest = m["step"] - m["rollout"] - m["handover"]
        medians[backend] = m
        out[f"real_step_seconds_{backend}"] = round(m["step"], 1)
        out[f"real_rollout_seconds_{backend}"] = round(m["rollout"], 1)
        out[f"real_rest_seconds_{backend}"] = round(rest, 1)
        out[f"real_loss_forward_seconds_{backend}"] = round(m["forward"], 1)
        out[f"real_loss_backward_seconds_{backend}"] = round(m["backward"], 1)
        flops = 2 * _matrix_params(arch) * m["loss_tokens"]
        for part in ("forward", "backward"):
            out[f"real_loss_{part}_gflops_{backend}"] = round(flops / m[part] / 1e9, 1)
            out[f"real_loss_{part}_over_gemm_limit_{backend}"] = round(flops / m[part] / limit, 2)
        out[f"real_completion_mean_length_{backend}"] = round(m["completion_length"], 1)
        out[f"real_available_gib_in_loss_{backend}"] = round(m["available_gib_in_loss"], 1)
        out[f"real_rollout_cpu_per_wall_{backend}"] = round(m["cpu_per_wall"], 2)
        out[f"real_step_others_cpu_per_wall_{backend}"] = round(m["others_cpu_per_wall"], 2)
    out["real_engine_cpu_per_wall_in_loss_vllm"] = round(medians["vllm"]["engine_cpu_per_wall_in_loss"], 2)
    out["real_handover_seconds_vllm"] = round(medians["vllm"]["handover"], 3)
    out["real_rollout_hf_over_vllm"] = round(medians["hf"]["rollout"] / medians["vllm"]["rollout"], 2)
    out["real_step_hf_over_vllm"] = round(medians["hf"]["step"] / medians["vllm"]["step"], 2)
    out["cores"] = len(os.sched_getaffinity(0))
    return out


def _gemm_flops(dtype: torch.dtype, rows: int, inner: int, cols: int, repeats: int = 7) -> float:
    """Median FLOP/s of ``(rows x inner) @ (inner x cols)`` in ``dtype`` on this process's threads."""
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
    for _ in range(2):  # the first products pay for the kernels' selection and the pages' first touch
        a @ b
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - t0)
    return 2 * rows * inner * cols / statistics.median(seconds)


def bench_engine(prompts: int = ENGINE_PROMPTS, samples: int = ENGINE_SAMPLES) -> dict[str, float | str]:
    """The real 0.5B model's evaluation through vLLM's engine in the dtype it serves in here
    (``model.engine_dtype=auto``: bfloat16 on a CPU with bfloat16 arithmetic), beside this machine's
    matrix-product limit in that dtype; run eager, then compiled (``eval.vllm_compile``, which a real model's
    evaluation gets by default), one engine after the other. The limit is the best of two products timed in
    this process on its cores: the model's widest layer (896 x 4864) at the decode batch's rows, and a
    square one of 2048. The evaluation's rate counts every token the engine computes (each prompt's prefill
    once, since vLLM shares a prompt's cache among its samples, and every sampled token) at 2 x the model's
    matrix parameters in FLOPs per token; ``engine_over_gemm_limit`` is that rate over the limit, for the
    engine as sage-eval builds it, and ``engine_start_seconds`` its build, compilation and first block."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from sage.config import register_configs
    from sage.data.benchmarks import math_data
    from sage.eval.checkpoint import Checkpoint
    from sage.eval.sampling import SamplingSettings, VllmSampler, compiles, tokenize_prompts
    from sage.hardware import engine_dtype
    from sage.models import from_package_gguf
    from sage.paths import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=qwen2.5-coder-0.5b-instruct", "eval.backend=vllm"])
    dtype = engine_dtype(str(cfg.model.engine_dtype), str(cfg.model.dtype))
    path = from_package_gguf(list(cfg.model.source.packages), cfg.model.source.sha256)
    arch = AutoConfig.from_pretrained(path)
    matrix_params = _matrix_params(arch)
    limit = _gemm_limit(getattr(torch, dtype), prompts * samples, arch)
    rows = [json.loads(line) for line in Path(math_data("math500.jsonl")).read_text().splitlines()][:prompts]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenize_prompts(tokenizer, rows, chat=True)
    checkpoint = Checkpoint.resolve(path)
    default = compiles(checkpoint, cfg.eval.vllm_compile)
    out: dict[str, float | str] = {
        "engine_dtype": dtype,
        "engine_shape": f"{prompts} MATH-500 prompts x {samples} samples x <= {ENGINE_TOKENS} tokens",
        "engine_compiled_by_default": default,
        "gemm_limit_gflops": round(limit / 1e9, 1),
    }
    for compiled in (False, True):
        started = time.perf_counter()
        eval_cfg = OmegaConf.merge(cfg.eval, {"vllm_compile": compiled})
        sampler = VllmSampler(checkpoint, dtype, eval_cfg)  # as sage-eval builds it
        try:
            settings = SamplingSettings(samples, 1.0, 1.0, ENGINE_TOKENS, chat=True, seed=0)
            sampler.sample(ids[:2], SamplingSettings(2, 1.0, 1.0, 8, chat=True, seed=0))  # one-off costs
            start_seconds = time.perf_counter() - started
            t0 = time.perf_counter()
            sampled = sampler.sample(ids, settings).n_tokens  # every sampled token, the end token included
            wall = time.perf_counter() - t0
        finally:
            sampler.close()
        achieved = 2 * matrix_params * (sum(len(x) for x in ids) + sampled) / wall
        way = "" if compiled == default else "_eager" if not compiled else "_compiled"
        out |= {
            f"engine{way}_start_seconds": round(start_seconds, 1),
            f"engine{way}_sampled_tokens_per_second": round(sampled / wall, 1),
            f"engine{way}_gflops": round(achieved / 1e9, 1),
            f"engine{way}_over_gemm_limit": round(achieved / limit, 2),
        }
    return out | {"cores": len(os.sched_getaffinity(0))}
