"""The HF backend's sampling loop (``sample_batch``) and the forward passes it drives (``Forward``): the
compact decoder's (``CompactForward``, ``sage.eval.decode``) or transformers' own (``TransformersForward``)
for the models the compact decoder does not cover; ``pick`` draws each next token."""

from __future__ import annotations

from typing import Protocol

import torch

from sage.eval.decode import CompactDecoder, DecodeState, KVCache

COMPACT_WHEN_FINISHED = 0.25
"""Fraction of finished rows in the batch at which they are dropped (a drop moves the whole cache)."""


def pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, min_p: float = 0.0
) -> torch.Tensor:
    """Next token per row from (B, V) logits: greedy at temperature 0, else nucleus sampling (top-k off),
    keeping only tokens at least ``min_p`` times as likely as the row's most likely one (transformers'
    min-p; 0: off). Both filters act on the tempered distribution, as in transformers, and commute:
    min-p drops a tail of the sorted probabilities, which leaves the mass before every kept token."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if min_p > 0.0:  # multinomial renormalises the weights that are left
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # drop a token once the mass before it already reaches top_p (the first token always stays)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
    choice = torch.multinomial(sorted_p, 1, generator=generator)  # (B, 1)
    return order.gather(-1, choice).squeeze(1)


class Forward(Protocol):
    """A model's forward pass as the sampling loop drives it: ``prefill`` runs each distinct prompt once
    and returns next-token logits for its ``copies`` consecutive rows, ``step`` feeds one token per row,
    ``select`` keeps only some rows (ascending). Finished rows are dropped once ``drop_when_finished`` of the
    batch has finished (0: as soon as any has): a drop costs a copy of the cache, and which rows are in the
    batch decides the random stream of the next draws, so each forward keeps its own fixed policy."""

    device: torch.device
    drop_when_finished: float

    def prefill(self, prompts: list[list[int]], copies: list[int], max_new_tokens: int, pad_id: int): ...

    def step(self, ids: torch.Tensor) -> torch.Tensor: ...

    def select(self, keep: torch.Tensor) -> None: ...


class CompactForward:
    """The compact decoder with its preallocated cache, as a :class:`Forward`."""

    drop_when_finished = COMPACT_WHEN_FINISHED

    def __init__(self, decoder: CompactDecoder, cache: KVCache) -> None:
        self.decoder, self.cache, self.device = decoder, cache, decoder.device
        self.state: DecodeState | None = None

    def prefill(self, prompts, copies, max_new_tokens, pad_id):
        self.state, logits = self.decoder.prefill(prompts, copies, self.cache, max_new_tokens, pad_id)
        return logits

    def step(self, ids):
        return self.decoder.step(self.state, ids)

    def select(self, keep):
        self.state.select(keep)


class TransformersForward:
    """transformers' own forward with a DynamicCache, for models the compact decoder does not cover, as a
    :class:`Forward`. Every distinct prompt is prefilled once and its cache copied to each of its samples;
    finished rows leave the batch at once (the cache is reindexed, not copied, so there is nothing to save
    by waiting)."""

    drop_when_finished = 0.0

    def __init__(self, model) -> None:
        self.model, self.device = model, model.device

    @torch.inference_mode()
    def prefill(self, prompts, copies, max_new_tokens, pad_id):
        from transformers import DynamicCache

        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)  # (P, L)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)  # (P, L)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # (P, V)
        expand = torch.repeat_interleave(
            torch.arange(len(prompts), device=dev), torch.tensor(copies, device=dev)
        )
        self.cache.batch_select_indices(expand)
        self.mask, self.position = mask[expand], positions[expand, -1]
        # without padding no mask is needed, and attention takes its fast path (no (B, 1, 1, T) mask)
        self.padded = bool((mask == 0).any())
        return logits[expand]

    @torch.inference_mode()
    def step(self, ids):
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(ids), 1)], dim=1)
        self.position = self.position + 1
        return self.model(
            input_ids=ids[:, None],
            attention_mask=self.mask if self.padded else None,
            position_ids=self.position[:, None],
            past_key_values=self.cache,
            use_cache=True,
        ).logits[:, -1]

    def select(self, keep):
        self.cache.batch_select_indices(keep)
        self.mask, self.position = self.mask[keep], self.position[keep]


@torch.inference_mode()
def sample_batch(
    forward: Forward,
    prompts: list[list[int]],
    copies: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos: torch.Tensor,
    pad_id: int,
    generator: torch.Generator,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling loop of the HF backend, for any :class:`Forward`: (sum(copies), max_new_tokens)
    sampled ids and each sequence's length (eos included); prompt i gets copies[i] consecutive rows.
    ``min_p`` as in :func:`pick`."""
    logits = forward.prefill(prompts, copies, max_new_tokens, pad_id)
    dev = forward.device
    total = logits.shape[0]
    tokens = torch.full((total, max_new_tokens), pad_id, dtype=torch.long, device=dev)  # (B, T)
    lengths = torch.full((total,), max_new_tokens, dtype=torch.long, device=dev)  # (B,)
    rows = torch.arange(total, device=dev)  # batch row -> output row
    running = torch.ones(total, dtype=torch.bool, device=dev)  # batch row has not emitted eos yet
    eos = eos.to(dev)
    for t in range(max_new_tokens):
        nxt = pick(logits, temperature, top_p, generator, min_p)  # (b,)
        live = rows[running]
        tokens[live, t] = nxt[running]
        done = running & torch.isin(nxt, eos)
        lengths[rows[done]] = t + 1
        running &= ~done
        n_running = int(running.sum())
        if t == max_new_tokens - 1 or n_running == 0:
            break
        if n_running < len(rows) and n_running <= (1 - forward.drop_when_finished) * len(rows):
            keep = running.nonzero().squeeze(1)
            forward.select(keep)
            rows, nxt, running = rows[keep], nxt[keep], running[keep]
        logits = forward.step(nxt)
    return tokens.cpu(), lengths.cpu()
