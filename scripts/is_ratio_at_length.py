"""The importance weights of ``rollout=vllm`` at the paper's lengths (issue 55), measured here:

    .venv/bin/python scripts/is_ratio_at_length.py [--sequences 16] [--lengths 128 512 2048]

A random Qwen2 model with a long context (4,096 positions, a 32,768-token vocabulary, its output layer
scaled so that its next-token distributions are peaked as a trained model's are, not uniform) carries a
random, non-zero LoRA adapter (rank 8 on the paper's 7 projections). The adapter is served to a bfloat16
vLLM engine through ``sage.train.vllm_rollout.VllmRollout`` (the ``rollout=vllm`` path: its engine, its
hand-over, its log-probs of the trainer's distribution), which samples completions at the paper's
sampling keys (temperature 1, min_p 0.01) of exactly each length (no stop token: the model is random). The
trainer's side is TRL's own log-prob computation (its fused output layer, ``trl.trainer.utils.
add_fused_lm_head``) on the same peft model in float32 (this machine's trainer), and in bfloat16 with bf16
autocast (the cluster's). Per length and trainer dtype it prints one row of a Markdown table:

- the standard deviation of the per-sequence log-ratio (sum over tokens of log pi_trainer - log pi_engine)
  and the 5% / 95% quantiles of the per-sequence weight exp(log-ratio);
- the share of sequences ``sequence_mask`` with its upper bound 3 (TRL's default) drops;
- the share of tokens whose ratio verl-style token-level truncation at C = 2 clips;
- the length-normalised sequence weight's spread (SD of log-ratio / length);
- the mean per-token |log-ratio|, and the sampled tokens' mean mass removed by min_p (measured as the
  trainer measures it, ``sage.train.importance.watch_truncation``).

Each length has sequences of its own (a random prompt each): the first L tokens of completions that one
engine call samples to the longest length, which with no stop token are samples of length L. The figures
come from ``sage.train.importance``, the functions the trainer logs with.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sage.train import importance  # noqa: E402

VOCAB = 32768
POSITIONS = 4096
HEAD_SCALE = 28.0  # the output layer x this: peaked next-token distributions (about 1.3 nats at T = 1)
ADAPTER_SCALE = 0.002  # lora_B's standard deviation: moves the log-probs as a trained adapter might
TEMPERATURE, MIN_P = 1.0, 0.01  # trl=paper's sampling
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(folder: Path, seed: int) -> None:
    """A random Qwen2 with a long context, saved with the testbed's chat tokenizer (vLLM needs one; the
    completions are never detokenized, so the model's larger vocabulary is sampled whole)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sage.testbed.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=POSITIONS,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(folder)
    build_tokenizer(chat=True).save_pretrained(folder)


def peft_policy(folder: Path, dtype: torch.dtype, adapter: dict | None, seed: int):
    """The base in ``dtype`` with a rank-8 LoRA adapter on the 7 projections: random and non-zero (B drawn,
    not peft's zero start) when ``adapter`` is None, else those weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                if adapter is None:
                    p.copy_(torch.randn(p.shape, generator=g) * ADAPTER_SCALE)
                else:
                    p.copy_(adapter[name])
            elif "lora_A" in name and adapter is not None:
                p.copy_(adapter[name])
    return model.eval()


class Rollouts:
    """What ``VllmRollout`` reads of a trainer: the policy, its step and sampling keys, TRL's tokenisation."""

    def __init__(self, model, length: int) -> None:
        self.model = model
        self.accelerator = SimpleNamespace(unwrap_model=lambda m: m, process_index=0)
        self.state = SimpleNamespace(global_step=0)
        self.temperature, self.top_p, self.top_k, self.min_p = TEMPERATURE, 1.0, 0, MIN_P
        self.repetition_penalty = 1.0
        self.max_completion_length = length
        self.eos_token_ids = []  # a random model's eos would end completions at random lengths

    def _tokenize_prompts(self, prompts):
        return prompts, None, False


def trainer_logps(model, prompts, completions, dtype, masses: list | None):
    """TRL's log-probs of ``completions`` (after ``prompts``) at the sampling temperature: its fused output
    layer, under bf16 autocast for a bfloat16 trainer, one sequence at a time."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([p + c])
        labels = ids.clone()
        labels[:, : len(p)] = -100
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        hook = None
        if masses is not None:
            base = model.get_base_model()
            hook = importance.watch_truncation(base, len(c), TEMPERATURE, MIN_P, 1.0, 0, masses)
        with torch.no_grad(), autocast:
            logps = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs[0, -len(c) :]
        if hook is not None:
            hook.remove()
        out.append(logps.float())
    return torch.stack(out)  # (N, L): every completion has the same length


def row(length: int, dtype: str, logps, sampling, masses) -> dict:
    mask = torch.ones_like(logps)
    figures = importance.weight_figures(
        importance.weight_sums(logps, sampling, mask, "sequence_mask", None, 3.0)
    )
    token = importance.weight_figures(
        importance.weight_sums(logps, sampling, mask, "token_truncate", None, 2.0)
    )
    x = importance.sequence_log_ratios(logps, sampling, mask).double()
    weights = torch.exp(x)
    return {
        "length": length,
        "trainer": dtype,
        "sd": figures[importance.SPREAD_KEY],
        "q05": torch.quantile(weights, 0.05).item(),
        "q95": torch.quantile(weights, 0.95).item(),
        "masked": figures[importance.CUT_KEY],
        "token_c2": token[importance.CUT_KEY],
        "sd_norm": statistics.pstdev((x / length).tolist()),
        "per_token": (logps - sampling).abs().mean().item(),
        "mass": torch.cat(masses).mean().item() if masses else float("nan"),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16, help="completions per length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from peft import LoraConfig
    from trl import GRPOConfig
    from trl.trainer.utils import add_fused_lm_head

    from sage.train.vllm_rollout import VllmRollout

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sage-is-length-") as tmp:
        folder = Path(tmp) / "base"
        build_model(folder, args.seed)
        policy = peft_policy(folder, torch.float32, None, args.seed)
        policy.name_or_path = str(folder)
        adapter = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
        grpo = GRPOConfig(
            output_dir=tmp,
            report_to="none",
            bf16=False,
            seed=args.seed,
            generation_kwargs={"ignore_eos": True, "detokenize": False},
        )
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
        engine = VllmRollout(
            grpo, lora, dtype="float32", cpu_memory_utilization=0.15, engine_dtype="bfloat16"
        )
        trainers = {"float32": policy, "bfloat16": peft_policy(folder, torch.bfloat16, adapter, args.seed)}
        for model in trainers.values():
            add_fused_lm_head(model.get_base_model(), temperature=TEMPERATURE, outputs=("log_probs",))
        g = torch.Generator().manual_seed(args.seed)
        rows = []
        try:
            longest = max(args.lengths)
            rollouts = Rollouts(policy, longest)
            engine.attach(rollouts)  # serves the adapter: a version folder, add_lora
            n = args.sequences * len(args.lengths)
            prompts = [torch.randint(0, VOCAB, (16,), generator=g).tolist() for _ in range(n)]
            out = engine(prompts, rollouts)
            took = time.perf_counter() - started
            print(f"{n} completions of {longest} tokens at {took:.0f} s", file=sys.stderr, flush=True)
            assert all(len(c) == longest for c in out["completion_ids"]), (
                "a completion ended before its length"
            )
            entropy = -torch.tensor(out["logprobs"]).mean().item()  # how peaked the random model is
            for i, length in enumerate(args.lengths):
                group = slice(i * args.sequences, (i + 1) * args.sequences)
                completions = [c[:length] for c in out["completion_ids"][group]]
                sampling = torch.tensor([lp[:length] for lp in out["logprobs"][group]])
                for name, model in trainers.items():
                    masses = [] if name == "float32" else None
                    logps = trainer_logps(model, prompts[group], completions, getattr(torch, name), masses)
                    rows.append(row(length, name, logps, sampling, masses))
                took = time.perf_counter() - started
                print(f"length {length} done at {took:.0f} s", file=sys.stderr, flush=True)
        finally:
            engine.close()
        with torch.no_grad():  # the adapter is not zero: how far it moves the policy's log-probs
            ids = torch.tensor([prompts[0] + completions[0][:128]])
            moved = policy(input_ids=ids).logits.log_softmax(-1)
            with policy.disable_adapter():
                base = policy(input_ids=ids).logits.log_softmax(-1)
            shift = (moved - base).abs().mean().item()

    print(
        f"random Qwen2 (hidden 256, 4 layers, vocabulary {VOCAB}, {POSITIONS} positions), LoRA r=8 on 7 "
        f"projections (mean |log-prob change| from the base {shift:.3f}), bf16 vLLM engine, temperature "
        f"{TEMPERATURE:g}, min_p {MIN_P:g}; {args.sequences} sequences per length; mean sampled-token "
        f"surprisal {entropy:.2f} nats; {time.perf_counter() - started:.0f} s\n"
    )
    print(
        "| length | trainer | SD log-ratio | weight 5% | weight 95% | seq_mask cap 3 masked "
        "| token C=2 clipped "
        "| SD log-ratio / length | mean abs token log-ratio | truncated mass |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mass = "" if math.isnan(r["mass"]) else f"{r['mass']:.4f}"
        print(
            f"| {r['length']} | {r['trainer']} | {r['sd']:.3f} | {r['q05']:.3f} | {r['q95']:.3f} | "
            f"{100 * r['masked']:.1f}% | {100 * r['token_c2']:.2f}% | {r['sd_norm']:.5f} | "
            f"{r['per_token']:.4f} | {mass} |"
        )


if __name__ == "__main__":
    main()
