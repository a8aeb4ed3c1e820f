"""Prompt KV kept across steps of the embedded engine, so a group's samples share one prefill.

A producer sends a group's n samples of one prompt, but the engine admits them as slots free
up: often one now, its siblings steps later. Without a cache each late sibling prefilled the
same prompt again (the SmolLM2 benchmark ran 38 prefills for 16 prompts). Here the KV of a
fresh prompt (no generated tokens yet) and its last-position logits are kept after its
prefill; a later request with the same prompt copies them instead of running the model.

Rules that keep it correct:
- Only prompts are cached, never a retracted request's prompt + output (no sibling shares it).
- KV of old weights is never reused (LESSONS miles#2782): the engine clears the cache whenever
  it retracts running requests, which every weight load does, and on `flush_cache`.
- Entries hold their own storage (clones), never a view into a live batch, and callers copy
  them out (index_select), so decoding never writes into a cached tensor.
- Bounded by tokens, least recently used first out.
- A hit returns exactly the numbers of the prefill that stored it; in batch-invariant mode
  every prefill is a batch of one, so a hit is bit-identical to prefilling the prompt again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedPrompt:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, heads, prompt_len, dim]
    logits_V: torch.Tensor  # the last prompt position's logits
    routing: torch.Tensor | None = None  # MoE: [prompt_len, layers, k] experts it was routed to

    @property
    def tokens(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0


class PrefixCache:
    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache: max_tokens = {max_tokens}; use 0 (off) or more")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: tuple[int, ...]) -> CachedPrompt | None:
        entry = self._entries.get(prompt)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(prompt)
        self.hits += 1
        return entry

    def put(self, prompt: tuple[int, ...], kv: list[tuple[torch.Tensor, torch.Tensor]],
            logits_V: torch.Tensor, routing: torch.Tensor | None = None) -> None:
        """Keep a copy of one prompt's KV ([1, heads, len(prompt), dim] per layer, no
        padding) and logits; evicts the least recently used beyond the token bound."""
        if len(prompt) > self.max_tokens or prompt in self._entries:
            return
        entry = CachedPrompt([(k.clone(), v.clone()) for k, v in kv], logits_V.clone(),
                             None if routing is None else routing.clone())
        if entry.tokens != len(prompt):
            raise ValueError(f"prefix cache: KV of {entry.tokens} positions for a prompt of "
                             f"{len(prompt)} tokens")
        self._entries[prompt] = entry
        self.tokens += len(prompt)
        while self.tokens > self.max_tokens:
            evicted, _ = self._entries.popitem(last=False)
            self.tokens -= len(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
