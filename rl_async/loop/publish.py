"""Weight publication: the controller's state machine (SPEC §9).

    idle --> snapshotting --> pausing --> transferring --> resuming --> idle
                  |                                             ^
                  +---------------- (any error) ----> failed (raised; the run stops)

snapshotting: trainer rank 0 copies the weights into its publication buffers. Once that is
done (`snapshotted` is set) the trainer may take its next optimizer step while the rest of
the publication (the drain above all) runs: the controller overlaps the two when the lag
allows it.

refresh.mode = off ("no response mixes policies"):
    pausing:      the producer sends no new generation request; requests already at the
                  engines finish under the weights they started with, for at most
                  `publication.drain_timeout_s`; past it the rest are aborted (their groups are
                  regenerated from the original prompts and the aborted tokens counted).
    transferring: bucketed, flattened tensors go from trainer rank 0 to every engine over the
                  collective group; engines record the new version.
    resuming:     engines continue; the producer sends requests again.

refresh.mode = mixed_policy:
    pausing:      engines retract running requests (back to waiting, KV dropped).
    transferring: as above.
    resuming:     engines continue; retracted requests rebuild their prefix under the new
                  weights without resampling; every token keeps its version and log-prob.

One transfer at a time: a second `publish` while one runs is an error, not a queue.

Deadline: the whole publication (snapshot to resume) must finish within
`publication.timeout_s`. A hung broadcast (a dead engine, a wedged NCCL communicator) fails
the run with the version, the stage and the bucket named, instead of waiting out NCCL's
watchdog (30 minutes by default). The transfer reports its progress bucket by bucket so the
error says where it stopped.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, TypeVar

from rl_async.base import clock
T = TypeVar("T")


class PubState(enum.Enum):
    IDLE = "idle"
    SNAPSHOTTING = "snapshotting"
    PAUSING = "pausing"
    TRANSFERRING = "transferring"
    RESUMING = "resuming"
    FAILED = "failed"


class PublicationError(RuntimeError):
    pass


class PublicationTimeout(PublicationError):
    """The publication missed its deadline; the message names the stage (and bucket)."""


# send() calls this before each bucket: (bucket index from 0, bucket count).
BucketProgress = Callable[[int, int], None]


class PublicationOps(Protocol):
    """What the state machine drives; implemented over Ray actor handles in actors/."""

    async def snapshot(self) -> None: ...
    async def stop_submissions(self) -> None: ...
    async def drain(self, timeout_s: float) -> bool: ...
    async def pause_engines(self, mode: str) -> None: ...
    # Broadcast the snapshot; returns bytes sent. Calls `progress(i, n)` before bucket i of n.
    async def send(self, version: int, progress: BucketProgress) -> int: ...
    async def continue_engines(self) -> None: ...
    async def resume_submissions(self) -> None: ...


@dataclass
class PublicationResult:
    version: int
    publication_seconds: float
    paused_seconds: float
    drain_seconds: float
    transfer_seconds: float
    drained: bool
    bytes: int
    snapshot_seconds: float = 0.0
    # The first control call (stop submissions, or the retracting pause): one actor round
    # trip, which each of the publication's control calls costs (the simulator's calibration).
    control_seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"publish/publication_seconds": self.publication_seconds,
                "publish/paused_seconds": self.paused_seconds,
                "publish/drain_seconds": self.drain_seconds,
                "publish/transfer_seconds": self.transfer_seconds,
                "publish/drain_timed_out": float(not self.drained),
                "publish/snapshot_seconds": self.snapshot_seconds,
                "publish/control_seconds": self.control_seconds,
                "publish/bytes": float(self.bytes)}


class Publisher:
    def __init__(self, refresh_mode: str, drain_timeout_s: float, timeout_s: float | None = None):
        if refresh_mode not in ("off", "mixed_policy"):
            raise ValueError(f"refresh.mode = {refresh_mode!r}: allowed are 'off', 'mixed_policy'")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"publication.timeout_s = {timeout_s!r}: must be > 0")
        self.refresh_mode = refresh_mode
        self.drain_timeout_s = drain_timeout_s
        self.timeout_s = timeout_s
        self.state = PubState.IDLE
        self.history: list[PubState] = []
        self._bucket: tuple[int, int] | None = None  # (index, count) of the bucket in flight

    def _enter(self, state: PubState) -> None:
        self.state = state
        self.history.append(state)
        self._bucket = None

    def _on_bucket(self, index: int, count: int) -> None:
        self._bucket = (index, count)

    def _where(self) -> str:
        where = f"stage {self.state.value}"
        if self._bucket is not None:
            where += f" (bucket {self._bucket[0] + 1}/{self._bucket[1]})"
        return where

    async def publish(self, version: int, ops: PublicationOps,
                      snapshotted: asyncio.Event | None = None) -> PublicationResult:
        """Run one publication under the deadline; a miss raises PublicationTimeout."""
        return await self._guarded(version, self._publish(version, ops, snapshotted))

    async def transfer(self, version: int, ops: PublicationOps) -> int:
        """Snapshot and send only, under the same deadline: the start-up publication of
        version 0, when nothing is generating yet (no pause, drain or resume)."""
        return await self._guarded(version, self._transfer(version, ops))

    async def _transfer(self, version: int, ops: PublicationOps) -> int:
        self._enter(PubState.SNAPSHOTTING)
        await ops.snapshot()
        self._enter(PubState.TRANSFERRING)
        sent = await ops.send(version, self._on_bucket)
        self._enter(PubState.IDLE)
        return sent

    async def _guarded(self, version: int, work: Awaitable[T]) -> T:
        if self.state is not PubState.IDLE:
            if inspect.iscoroutine(work):
                work.close()
            raise PublicationError(f"publication of version {version} requested while the "
                                   f"previous one is {self.state.value}: one transfer at a time")
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await work
        except TimeoutError as exc:
            where = self._where()
            self._enter(PubState.FAILED)
            if not deadline.expired():
                raise  # an op's own timeout, not the publication deadline
            raise PublicationTimeout(
                f"publication of version {version} timed out after {self.timeout_s:g} s in "
                f"{where}; an engine or the collective group is hung (raise "
                f"publication.timeout_s only if transfers are legitimately that slow)") from exc
        except BaseException:
            self._enter(PubState.FAILED)
            raise

    async def _publish(self, version: int, ops: PublicationOps,
                       snapshotted: asyncio.Event | None) -> PublicationResult:
        start = clock.now()
        drained = True
        self._enter(PubState.SNAPSHOTTING)
        await ops.snapshot()
        if snapshotted is not None:
            snapshotted.set()
        snap_at = clock.now()
        self._enter(PubState.PAUSING)
        if self.refresh_mode == "off":
            await ops.stop_submissions()
            stopped_at = clock.now()
            drained = await ops.drain(self.drain_timeout_s)
            if not drained:
                await ops.pause_engines("abort")
                # The aborted replies come back promptly; wait for them so no request
                # straddles the update.
                if not await ops.drain(self.drain_timeout_s):
                    raise PublicationError(
                        f"engines still had requests in flight {self.drain_timeout_s}s after "
                        f"abort; not updating weights under them")
        else:
            await ops.pause_engines("retract")
            stopped_at = clock.now()
        paused_at = clock.now()
        self._enter(PubState.TRANSFERRING)
        sent = await ops.send(version, self._on_bucket)
        transferred_at = clock.now()
        self._enter(PubState.RESUMING)
        await ops.continue_engines()
        await ops.resume_submissions()
        end = clock.now()
        self._enter(PubState.IDLE)
        return PublicationResult(
            version=version, publication_seconds=end - start, paused_seconds=end - snap_at,
            drain_seconds=paused_at - snap_at, transfer_seconds=transferred_at - paused_at,
            drained=drained, bytes=sent, snapshot_seconds=snap_at - start,
            control_seconds=stopped_at - snap_at)
