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
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Protocol


class PubState(enum.Enum):
    IDLE = "idle"
    SNAPSHOTTING = "snapshotting"
    PAUSING = "pausing"
    TRANSFERRING = "transferring"
    RESUMING = "resuming"
    FAILED = "failed"


class PublicationError(RuntimeError):
    pass


class PublicationOps(Protocol):
    """What the state machine drives; implemented over Ray actor handles in actors/."""

    async def snapshot(self) -> None: ...
    async def stop_submissions(self) -> None: ...
    async def drain(self, timeout_s: float) -> bool: ...
    async def pause_engines(self, mode: str) -> None: ...
    async def send(self, version: int) -> int: ...  # the snapshot; returns bytes sent
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

    def metrics(self) -> dict[str, float]:
        return {"publish/publication_seconds": self.publication_seconds,
                "publish/paused_seconds": self.paused_seconds,
                "publish/drain_seconds": self.drain_seconds,
                "publish/transfer_seconds": self.transfer_seconds,
                "publish/drain_timed_out": float(not self.drained),
                "publish/bytes": float(self.bytes)}


class Publisher:
    def __init__(self, refresh_mode: str, drain_timeout_s: float):
        if refresh_mode not in ("off", "mixed_policy"):
            raise ValueError(f"refresh.mode = {refresh_mode!r}: allowed are 'off', 'mixed_policy'")
        self.refresh_mode = refresh_mode
        self.drain_timeout_s = drain_timeout_s
        self.state = PubState.IDLE
        self.history: list[PubState] = []

    def _enter(self, state: PubState) -> None:
        self.state = state
        self.history.append(state)

    async def publish(self, version: int, ops: PublicationOps,
                      snapshotted: asyncio.Event | None = None) -> PublicationResult:
        if self.state is not PubState.IDLE:
            raise PublicationError(f"publication of version {version} requested while the "
                                   f"previous one is {self.state.value}: one transfer at a time")
        start = time.monotonic()
        drained = True
        try:
            self._enter(PubState.SNAPSHOTTING)
            await ops.snapshot()
            if snapshotted is not None:
                snapshotted.set()
            snap_at = time.monotonic()
            self._enter(PubState.PAUSING)
            if self.refresh_mode == "off":
                await ops.stop_submissions()
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
            paused_at = time.monotonic()
            self._enter(PubState.TRANSFERRING)
            sent = await ops.send(version)
            transferred_at = time.monotonic()
            self._enter(PubState.RESUMING)
            await ops.continue_engines()
            await ops.resume_submissions()
        except BaseException:
            self._enter(PubState.FAILED)
            raise
        end = time.monotonic()
        self._enter(PubState.IDLE)
        return PublicationResult(
            version=version, publication_seconds=end - start, paused_seconds=end - snap_at,
            drain_seconds=paused_at - snap_at, transfer_seconds=transferred_at - paused_at,
            drained=drained, bytes=sent)
