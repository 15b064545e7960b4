"""The testbed's base model: a ~1M-parameter Qwen2 trained from scratch on the teacher's worked solutions.

It stands in for the pretrained LLM of the paper so that GRPO, SAGE guides and pass@k evaluation run
offline on a CPU. The training length is tuned so that the model is a *weak but capable* base (pass@1
well below 1, pass@64 near 1), the regime where RLVR methods differ. Builds are cached by config hash:
every experiment of a sweep loads the same folder instead of retraining.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from sage import durable, paths
from sage.config import ConfigError
from sage.progress import eta_line
from sage.testbed.task import (
    DEFAULT_SLIP_RATE,
    DEFAULT_STRATEGY_PROBS,
    FORK_MARKERS,
    FORK_PRIOR,
    FORK_RULES,
    FORK_STRATEGIES,
    GRADED_RULES,
    STRATEGIES,
    WORLDS,
    make_problems,
    teacher_completion,
)
from sage.testbed.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

BUILD_FORMAT_VERSION = 2
"""Part of the cache key: bump it when the task, the teacher or the training loop changes behaviour, so
that stale cached models are never reused."""
MAX_POSITIONS = 128
"""Prompt (<= 8 tokens) plus the longest completion (~45 tokens) plus eos, with room for RL drift."""
CHAT_MAX_POSITIONS = 320
"""The chat variant's prompt carries the system prompt in ChatML turns (about 180 tokens)."""
BUILD_INFO_FILE = "testbed_build.json"


def config_hash(config: dict) -> str:
    return paths.content_key(config)


def build_tiny_model(
    *,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 4,
    train_steps: int = 450,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup_steps: int = 30,
    n_train_problems: int = 20000,
    strategy_probs: tuple[float, ...] | None = None,
    slip_rate: float = DEFAULT_SLIP_RATE,
    seed: int = 0,
    chat: bool = False,
    world: str = "graded",
    cache_dir: str | None = None,
    present_only: bool = False,
) -> str | None:
    """Path of a folder with the trained model and tokenizer (``save_pretrained`` of both), training it
    only if no build of this exact config is cached. The folder appears atomically, complete or not at
    all, so a killed build or two concurrent builds never leave a half-written model behind.

    ``chat``: the ``tiny_chat`` base, with the ChatML tokenizer. It is trained on the same bare problems
    and traces (ending in ``<|im_end|>``), never on a chat turn: like a pretrained base model it has to be
    taught the chat format by the SFT stage.

    ``world``: the teacher's world (:data:`sage.testbed.task.WORLDS`); ``graded`` is ``model=tiny``'s,
    ``arith`` the first testbed's (``model=tiny_arith``, ``tiny_sft``, ``tiny_chat``), ``fork``
    ``model=tiny_fork``'s. ``strategy_probs``: the teacher's strategy mix; None: the world's
    (:data:`~sage.testbed.task.FORK_PRIOR` in the fork world, else ``DEFAULT_STRATEGY_PROBS``).
    ``present_only``: the folder if this build is cached, else None, building nothing (as every model
    source takes it: ``sage.models.from_hub``)."""
    if world not in WORLDS:
        raise ConfigError(f"model.source.world must be one of {', '.join(WORLDS)}, got {world!r}")
    if strategy_probs is None:
        strategy_probs = FORK_PRIOR if world == "fork" else DEFAULT_STRATEGY_PROBS
    n_strategies = len(FORK_STRATEGIES if world == "fork" else STRATEGIES)
    if len(strategy_probs) != n_strategies:
        raise ConfigError(
            f"model.source.strategy_probs: world {world} has {n_strategies} strategies, "
            f"got {list(strategy_probs)}"
        )
    config = {
        "format_version": BUILD_FORMAT_VERSION,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "train_steps": train_steps,
        "batch_size": batch_size,
        "lr": lr,
        "warmup_steps": warmup_steps,
        "n_train_problems": n_train_problems,
        "strategy_probs": list(strategy_probs),
        "slip_rate": slip_rate,
        "seed": seed,
    }
    # only when set: the keys of the first builds (and so their cached models) stay what they were
    if chat:
        config["chat"] = True
    if world != "arith":  # its rules too: a change of the graded teacher is a new base model
        config["world"] = world
        config["world_rules"] = FORK_RULES if world == "fork" else GRADED_RULES
    root = Path(cache_dir) if cache_dir is not None else paths.cache_dir()
    final = root / "testbed" / config_hash(config)
    if (final / BUILD_INFO_FILE).exists():
        if not present_only:
            log.info("testbed model cached at %s", final)
        return str(final)
    if present_only:
        return None
    log.info(
        "building the testbed base model into %s, once per machine (the cache is $SAGE_CACHE_DIR, else "
        "~/.cache/sage); every later run reuses it",
        final,
    )
    # transformers writes a model's weights from rank 0 of a process group only: a build by another rank
    # would leave a folder without them. In a multi-process run the main process builds (or waits for
    # another job's build) while the others wait for it on the file system.
    build = functools.partial(_build, config)
    return str(durable.build_once(final, BUILD_INFO_FILE, build, processes="main"))


def _build(config: dict, folder: Path) -> None:
    """Train the model of ``config`` into ``folder``; the build info is written last."""
    start = time.perf_counter()
    model, tokenizer, final_loss = _train(config)
    model.save_pretrained(folder)
    if not (folder / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no model into {folder} (not rank 0 of a process group?)")
    tokenizer.save_pretrained(folder)
    info = {"config": config, "final_loss": final_loss, "build_seconds": time.perf_counter() - start}
    (folder / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2))
    log.info("testbed model built")


def make_model(config: dict, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """Untrained Qwen2 sized by ``config``; the special-token ids live in both the model config and the
    generation config so that ``generate`` and TRL stop on eos and pad correctly."""
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_heads"],
        num_key_value_heads=config["num_heads"],
        max_position_embeddings=CHAT_MAX_POSITIONS if config.get("chat") else MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model = Qwen2ForCausalLM(model_config)
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.bos_token_id = tokenizer.bos_token_id
    return model


def lr_factor(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine from 1 to ``floor``; training stops exactly at the end of the cosine
    because accuracy is very sensitive to where on the schedule the model is taken."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _teacher_examples(
    config: dict, tokenizer: PreTrainedTokenizerFast, rng: random.Random
) -> list[tuple[list[int], int]]:
    """(token ids, index of the first completion token) for every training example: problems drawn from
    a fixed train pool, each with a fresh teacher trace, so the model sees the strategy mix as data."""
    problems = make_problems("train", config["n_train_problems"], config["seed"])
    examples = []
    for _ in range(config["train_steps"] * config["batch_size"]):
        p = rng.choice(problems)
        completion, _ = teacher_completion(
            p["a"],
            p["b"],
            p["c"],
            rng,
            tuple(config["strategy_probs"]),
            config["slip_rate"],
            config.get("world", "arith"),
        )
        prompt_ids = tokenizer(p["problem"], add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids + completion_ids + [tokenizer.eos_token_id], len(prompt_ids)))
    return examples


def _collate(
    batch: list[tuple[list[int], int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs with labels only on completion tokens (and eos): the prompt is given, the
    model must learn to answer it, not to generate problems."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (ids, completion_start) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, completion_start : len(ids)] = torch.tensor(ids[completion_start:])
    return input_ids, attention, labels


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Use the machine's cores for the build without changing the caller's thread setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(config: dict) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, float]:
    rng = random.Random(config["seed"])
    torch.manual_seed(config["seed"])
    markers = tuple(FORK_MARKERS.values()) if config.get("world") == "fork" else ()
    tokenizer = build_tokenizer(chat=config.get("chat", False), markers=markers)
    model = make_model(config, tokenizer)
    log.info("training testbed model: %d params, config %s", model.num_parameters(), config)
    examples = _teacher_examples(config, tokenizer, rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config["warmup_steps"], config["train_steps"])
    )
    size = config["batch_size"]
    loss_value = float("nan")
    model.train()
    start = time.monotonic()
    with _torch_threads(os.cpu_count() or 1):
        for step in range(config["train_steps"]):
            input_ids, attention, labels = _collate(
                examples[step * size : (step + 1) * size], tokenizer.pad_token_id
            )
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = loss.item()
            if step % 50 == 0 or step == config["train_steps"] - 1:
                done = eta_line(
                    "testbed model build", step + 1, config["train_steps"], time.monotonic() - start
                )
                log.info("%s (loss %.4f, lr %.2e)", done, loss_value, schedule.get_last_lr()[0])
    model.eval()
    return model, tokenizer, loss_value
