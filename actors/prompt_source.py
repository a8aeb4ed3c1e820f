"""Prompt source actor: the task's prompts and the retry ledger, one owner per prompt.

A plain (non-async) actor on purpose: Ray runs a sync actor's calls from one caller in the
order they were sent, so the buffer's insert -> deliver/discard reports reach the ledger in
the order they happened. Group references passed here carry no tokens (`ref_of`).
"""

from __future__ import annotations

import ray

from rl_async.plan.config import RunConfig
from rl_async.loop.ledger import PromptLedger
from rl_async.loop.monitor import CpuMeter
from rl_async.algo.tasks import (PromptSource, build_prompts, load_tokenizer, model_vocab_size,
                                 stream_digest)
from rl_async.base.types import Group


def ref_of(group: Group) -> Group:
    """What the ledger needs of a group attempt: its id and attempt, not its tokens."""
    return Group(group_id=group.group_id, samples=[], attempt=group.attempt)


@ray.remote(num_cpus=0)
class PromptSourceActor:
    def __init__(self, cfg: RunConfig):
        vocab = model_vocab_size(cfg.model)
        # Text rows go through its chat template, with the task's chat settings.
        tok = load_tokenizer(cfg.model, cfg.task.chat_template, cfg.task.chat_template_kwargs)
        seed = cfg.run.seed
        self.source = PromptSource(build_prompts(cfg.task, vocab, "train", tok, seed), seed)
        self.eval_prompts = build_prompts(cfg.task, vocab, "eval", tok, seed)[
            : cfg.task.num_eval_prompts]
        self.digest = stream_digest(self.source.prompts)  # checkpoints keep it (resume)
        self.meter = CpuMeter()
        n = cfg.rollout.n_samples_per_prompt
        self.ledger = PromptLedger(lambda cursor: self.source.group(cursor, n),
                                   cfg.async_.max_retries, cfg.async_.unused_samples_handler)

    def next_group(self) -> Group:
        group = self.ledger.next_group()
        if group is None:  # the built-in and JSONL sources cycle; this is a bug if it happens
            raise RuntimeError("the prompt source is exhausted")
        return group

    def next_groups(self, n: int) -> list[Group]:
        """`n` groups in one call (the producer opens several at once)."""
        return [self.next_group() for _ in range(n)]

    def stream_digest(self) -> str:
        return self.digest

    def get_eval_prompts(self):
        return self.eval_prompts

    # The buffer's reports, sent in order as one call per acknowledgement (actors/buffer.py).
    BUFFER_REPORTS = frozenset({"mark_buffered", "mark_delivered_all", "record_buffer_discard"})

    def apply(self, ops: list[tuple[str, tuple]]) -> None:
        for method, args in ops:
            if method not in self.BUFFER_REPORTS:
                raise ValueError(f"apply: {method!r} is not a buffer report "
                                 f"({sorted(self.BUFFER_REPORTS)})")
            getattr(self, method)(*args)

    def mark_buffered(self, ref: Group) -> None:
        self.ledger.mark_buffered(ref)

    def mark_delivered_all(self, refs: list[Group]) -> None:
        self.ledger.mark_delivered_all(refs)

    def record_buffer_discard(self, ref: Group, reason: str) -> None:
        self.ledger.record_buffer_discard(ref, reason)

    def mark_aborted(self, ref: Group, reason: str) -> None:
        self.ledger.mark_aborted(ref, reason)

    def mark_filtered(self, ref: Group, reason: str) -> None:
        self.ledger.mark_filtered(ref, reason)

    def mark_failed(self, ref: Group, error: str) -> None:
        self.ledger.mark_failed(ref, error)

    def counts(self) -> dict[str, int]:
        return self.ledger.counts()

    def busy(self) -> dict[str, float]:
        return self.meter.metrics("prompt_source")

    def failures(self) -> list[dict]:
        return self.ledger.failures()

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict(state)
