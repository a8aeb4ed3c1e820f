"""Completed-group buffer actor: a thin shell over `rl_async.buffer.CompletedBuffer`.

Every insert, delivery, discard and eviction is reported to the prompt source's ledger,
and `put`/`get` return only after the ledger acknowledged, so a refused transition raises
in the caller instead of being lost.
"""

from __future__ import annotations

import asyncio

import ray

from actors.prompt_source import ref_of
from rl_async.buffer import CompletedBuffer
from rl_async.capacity import CapacityPlan
from rl_async.loop_monitor import LoopMonitor
from rl_async.config import RunConfig
from rl_async.queue_metrics import with_prefix
from rl_async.types import Group


@ray.remote(num_cpus=0)
class BufferActor:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, source):
        self.source = source
        self.plan = plan
        self._pending: list = []
        self.monitor = LoopMonitor()
        self.ray_calls = 0  # ledger reports sent (orchestration cost per sample)
        a = cfg.async_
        self.buffer = CompletedBuffer(
            plan.completed_buffer_groups, cfg.max_weight_staleness, order=a.buffer_order,
            overflow=a.buffer_overflow,
            on_discard=lambda g, reason: self._tell("record_buffer_discard", ref_of(g), reason),
            on_insert=lambda g: self._tell("mark_buffered", ref_of(g)),
            on_deliver=lambda gs: self._tell("mark_delivered_all", [ref_of(g) for g in gs]))

    def _tell(self, method: str, *args) -> None:
        self.ray_calls += 1
        self._pending.append(getattr(self.source, method).remote(*args))

    async def _acked(self) -> None:
        refs, self._pending = self._pending, []
        if refs:
            await asyncio.gather(*refs)

    async def put(self, group: Group) -> float:
        """Insert; returns the room left, so the producer need not stop admitting new groups
        while a put is merely in transit (only while one may be waiting for room)."""
        self.monitor.ensure_started()
        await self.buffer.put(group)
        await self._acked()
        return self.buffer.room()

    async def get(self, n_groups: int, version: int) -> list[Group]:
        groups = await self.buffer.get(n_groups, version)
        await self._acked()
        return groups

    async def set_version(self, version: int) -> None:
        self.buffer.set_version(version)
        await self._acked()  # stale evictions at the new version

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
