"""Completed-group buffer actor: a thin shell over `rl_async.loop.buffer.CompletedBuffer`.

Every insert, delivery, discard and eviction is reported to the prompt source's ledger,
and `put_many`/`get` return only after the ledger acknowledged, so a refused transition
raises in the caller instead of being lost. Reports are queued in the order they happen and
sent as ONE `apply` call per acknowledgement (the prompt source is a sync actor: one caller's
calls run in the order sent), not one actor call per group.
"""

from __future__ import annotations

import ray

from actors.prompt_source import ref_of
from rl_async.loop.buffer import CompletedBuffer, buffer_options
from rl_async.plan.capacity import CapacityPlan
from rl_async.loop.monitor import LoopMonitor
from rl_async.plan.config import RunConfig
from rl_async.observe.queue_metrics import with_prefix
from rl_async.base.types import Group


@ray.remote(num_cpus=0)
class BufferActor:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, source):
        self.source = source
        self.plan = plan
        self._ops: list[tuple[str, tuple]] = []  # ledger reports not sent yet, in order
        self._last_ack = None  # the latest apply call sent (later calls finish later)
        self.monitor = LoopMonitor()
        self.ray_calls = 0  # ledger reports sent (orchestration cost per sample)
        self.buffer = CompletedBuffer(
            plan.completed_buffer_groups, cfg.max_weight_staleness, **buffer_options(cfg, plan),
            on_discard=lambda g, reason: self._tell("record_buffer_discard", ref_of(g), reason),
            on_insert=lambda g: self._tell("mark_buffered", ref_of(g)),
            on_deliver=lambda gs: self._tell("mark_delivered_all", [ref_of(g) for g in gs]))

    def _tell(self, method: str, *args) -> None:
        self._ops.append((method, args))

    async def _acked(self) -> None:
        """Send the queued reports as one call and wait for it. With none queued, wait for
        the latest call sent: a concurrent put/get may have sent this caller's reports."""
        if self._ops:
            ops, self._ops = self._ops, []
            self.ray_calls += 1
            self._last_ack = self.source.apply.remote(ops)
        if self._last_ack is not None:
            await self._last_ack

    async def put_many(self, groups: list[Group]):
        """The groups a producer finished in one tick, inserted in order in one call and
        streamed back as lists of (index, room left) once the ledger acknowledged them. A
        group that must wait for room first releases the ones already in, so their producer
        permits are not held behind it (SPEC §4 stays per group)."""
        self.monitor.ensure_started()
        done: list[int] = []
        try:
            for i, group in enumerate(groups):
                if done and self.buffer.room() < 1:
                    await self._acked()
                    yield [(j, self.buffer.room()) for j in done]
                    done = []
                await self.buffer.put(group)
                done.append(i)
        finally:
            if done:  # inserted before an error too: acknowledged, then the error
                await self._acked()
        if done:
            yield [(j, self.buffer.room()) for j in done]

    async def get(self, n_groups: int, version: int) -> list[Group]:
        groups = await self.buffer.get(n_groups, version)
        await self._acked()
        return groups

    async def set_version(self, version: int | None, engine_version: int | None = None
                          ) -> None:
        self.buffer.set_version(version, engine_version)
        await self._acked()  # stale evictions at the new version

    async def admit(self, n_groups: int) -> int:
        """Staleness bound tickets for the producer (rl_async/loop/admission.py)."""
        return await self.buffer.admit(n_groups)

    def release(self, n_groups: int) -> None:
        self.buffer.release(n_groups)

    def admission(self) -> dict:
        return self.buffer.admission.bound.to_dict() if self.buffer.admission else {}

    def reserve(self, n_groups: int) -> None:
        """Lifecycle drains: room for the groups the producer owns (0 = release)."""
        if self.buffer.reserved:
            self.buffer.release_reserve()
        if n_groups:
            self.buffer.reserve(n_groups)

    def size(self) -> int:
        return len(self.buffer)

    def metrics(self) -> dict[str, float]:
        return {**with_prefix(self.buffer.metrics()), **self.monitor.metrics("buffer"),
                "buffer/ray_calls": float(self.ray_calls)}
