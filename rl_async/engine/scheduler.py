"""Request state and admission for the embedded engine (pure Python, no torch forward here).

A request moves  waiting -> running -> finished  and, under `retract` (or a weight update, or
a flush while frozen), back  running -> waiting (front of the queue, order kept) with its KV
dropped. Its output so far survives a retraction: when re-admitted, the whole prefix (prompt +
tokens generated so far) is prefilled under the current weights and generation continues
from there without resampling anything (a "refresh"; the old tokens keep their versions and
log-probs).

Admission is FIFO: the head of the queue is admitted while fewer than `max_running` requests
run and its reservation fits the token budget. A request reserves `prompt + max_new_tokens`
tokens, so running requests can always finish without preemption; a request whose reservation
alone exceeds the budget is refused at `generate` time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

import torch

from rl_async.engine.base import GenerateOutput, SamplingParams


@dataclass(eq=False)
class Request:
    """One generate call: its inputs, its output so far and the future its caller awaits."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    future: asyncio.Future
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    refreshes: int = 0
    finish_reason: str | None = None
    # Tokens in the last prefill that built this request's KV (batch-invariant mode: rows
    # with the same tokens AND the same prefill length hold bit-identical KV).
    prefill_len: int = 0
    # MoE routing replay: [positions, layers, k] expert ids of every token fed so far, in
    # pieces (a prefill's, then one per decode step); empty when the engine does not record.
    routing: list[torch.Tensor] = field(default_factory=list)

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def prefix(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def record(self, token: int, logprob: float, version: int) -> bool:
        """Append one sampled token; returns True (and sets finish_reason) when finished."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.token_versions.append(version)
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def to_output(self) -> GenerateOutput:
        return GenerateOutput(
            request_id=self.rid,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            token_versions=list(self.token_versions),
            finish_reason=self.finish_reason or "abort",
            prompt_len=len(self.prompt_ids),
            refreshes=self.refreshes,
            routed_experts=self.routed_experts(),
        )

    def routed_experts(self):
        if not self.routing:
            return None
        from rl_async.state.moe_routing import pack_routed

        ids = torch.cat(self.routing)
        # every fed token: the prefix, less the last sampled token (never fed)
        return pack_routed(ids[:self.num_tokens - 1])


class Scheduler:
    """The waiting queue and the admission rule (limits: running requests, reserved tokens)."""

    def __init__(self, max_running: int, max_total_tokens: int):
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.waiting: deque[Request] = deque()

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def requeue_front(self, requests: list[Request]) -> None:
        """Retracted requests go back to the FRONT, in their original order."""
        self.waiting.extendleft(reversed(requests))

    def remove_waiting(self, rid: str) -> Request | None:
        for request in self.waiting:
            if request.rid == rid:
                self.waiting.remove(request)
                return request
        return None

    def pop_admissible(self, running: list[Request]) -> list[Request]:
        """Pop the FIFO head while a slot is free and its reservation fits the budget."""
        slots = self.max_running - len(running)
        budget = self.max_total_tokens - sum(r.reserved_tokens for r in running)
        admitted: list[Request] = []
        while self.waiting and slots > 0 and self.waiting[0].reserved_tokens <= budget:
            request = self.waiting.popleft()
            admitted.append(request)
            slots -= 1
            budget -= request.reserved_tokens
        return admitted
