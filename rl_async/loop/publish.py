"""Weight publication: the controller's state machine (SPEC §9, §13).

Engines that stage weights (the embedded engine) receive the next version while they keep
generating with the current one; a publication is a transaction per engine, and the engines
pause only for the switch:

    idle --> snapshotting --> transferring --> pausing --> committing --> resuming --> idle
                  |                                                            ^
                  +------------------- (any error) ----> failed (raised; the run stops)

    snapshotting: trainer rank 0 copies the weights into its publication buffers, with a
                  fingerprint per bucket and the model's digest. Once that is done
                  (`snapshotted` is set) the trainer may take its next optimizer step while
                  the rest runs: the controller overlaps the two when the lag allows it.
    transferring: prepare + transfer + verify, while every engine goes on generating: each
                  engine receives every bucket into a staging buffer, checks each bucket's
                  fingerprint and the whole model's digest against the snapshot's. An
                  engine that fails or does not verify keeps its committed version (or is
                  lost and restarted); it is never half-updated.
    pausing:      refresh.mode = off: the producer holds new requests and those in flight
                  finish under the weights they started with (`publication.drain_timeout_s`;
                  past it the rest are aborted and regenerated). mixed_policy: nothing.
    committing:   each verified engine switches to the staged weights between two of its
                  steps (mixed_policy: running requests are retracted and rebuilt under the
                  new weights, tokens keep their versions); steps after it stamp the new
                  version. This switch is `pause_seconds`.
    resuming:     the producer sends requests again.

Engines that cannot stage (SGLang 0.5.23 loads into the live weights inside its scheduler:
docs/publication.md) are paused for the whole transfer:

    idle --> snapshotting --> pausing --> transferring --> resuming --> idle

    pausing:      as above (mixed_policy: engines retract running requests).
    transferring: bucketed, flattened tensors from trainer rank 0 to every engine; the last
                  bucket sets the version.
    resuming:     engines continue; the producer sends requests again.

One transfer at a time: a second `publish` while one runs is an error, not a queue.

Deadline: the whole publication (snapshot to resume) must finish within
`publication.timeout_s`. A hung broadcast (a dead engine, a wedged NCCL communicator) fails
the run with the version, the stage and the bucket named, instead of waiting out NCCL's
watchdog (30 minutes by default).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, TypeVar

from rl_async.base import clock
T = TypeVar("T")


class PubState(enum.Enum):
    IDLE = "idle"
    SNAPSHOTTING = "snapshotting"
    PAUSING = "pausing"
    TRANSFERRING = "transferring"
    COMMITTING = "committing"
    RESUMING = "resuming"
    FAILED = "failed"


class PublicationError(RuntimeError):
    pass


class PublicationTimeout(PublicationError):
    """The publication missed its deadline; the message names the stage (and bucket)."""


# send() calls this before each bucket: (bucket index from 0, bucket count).
BucketProgress = Callable[[int, int], None]


class PublicationOps(Protocol):
    """What the state machine drives; implemented over Ray actor handles in actors/.

    `stages_weights` (an attribute; absent means False): `send` stages and verifies while
    the engines generate, and `commit` switches them to it (module docstring)."""

    async def snapshot(self) -> None: ...
    async def stop_submissions(self) -> None: ...
    async def drain(self, timeout_s: float) -> bool: ...
    async def pause_engines(self, mode: str) -> None: ...
    # Broadcast the snapshot; returns bytes sent. Calls `progress(i, n)` before bucket i of n.
    async def send(self, version: int, progress: BucketProgress) -> int: ...
    async def continue_engines(self) -> None: ...
    async def resume_submissions(self) -> None: ...
    # Staged engines only: switch the verified ones to `version`; returns the publication's
    # engine-side figures: at least {"pause_seconds", "aborted_transfers"}.
    async def commit(self, version: int) -> dict[str, float]: ...


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
    # Seconds the engines could not generate: the switch when they stage (the longest
    # engine's), the whole transfer and resume when they load in place.
    pause_seconds: float = 0.0
    # Engines that received (part of) this version and did not commit it.
    aborted_transfers: int = 0
    engine: dict[str, float] = field(default_factory=dict)  # ops.commit's other figures

    def metrics(self) -> dict[str, float]:
        return {"publish/publication_seconds": self.publication_seconds,
                "publish/pause_seconds": self.pause_seconds,
                "publish/aborted_transfers": float(self.aborted_transfers),
                **{f"publish/{k}": float(v) for k, v in self.engine.items()},
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
        self.totals = {"publications": 0, "pause_seconds": 0.0, "pause_seconds_max": 0.0,
                       "transfer_seconds": 0.0, "drain_seconds": 0.0, "aborted_transfers": 0}

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
        if getattr(ops, "stages_weights", False):
            self._enter(PubState.COMMITTING)
            await ops.commit(version)
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
        self._enter(PubState.SNAPSHOTTING)
        await ops.snapshot()
        if snapshotted is not None:
            snapshotted.set()
        snap_at = clock.now()
        if getattr(ops, "stages_weights", False):
            result = await self._staged(version, ops)
        else:
            result = await self._in_place(version, ops)
        end = clock.now()
        result.publication_seconds, result.snapshot_seconds = end - start, snap_at - start
        self._enter(PubState.IDLE)
        self._count(result)
        return result

    async def _hold(self, ops: PublicationOps) -> tuple[bool, bool, float]:
        """refresh.mode = off: hold new requests and let those in flight finish (abort the
        rest past the drain timeout). Returns (drained in time, engines paused, when the
        producer had stopped submitting)."""
        await ops.stop_submissions()
        stopped_at = clock.now()
        if await ops.drain(self.drain_timeout_s):
            return True, False, stopped_at
        await ops.pause_engines("abort")
        # The aborted replies come back promptly; wait for them so no request straddles
        # the update.
        if not await ops.drain(self.drain_timeout_s):
            raise PublicationError(
                f"engines still had requests in flight {self.drain_timeout_s}s after "
                f"abort; not updating weights under them")
        return False, True, stopped_at

    async def _staged(self, version: int, ops: PublicationOps) -> PublicationResult:
        begun = clock.now()
        self._enter(PubState.TRANSFERRING)  # engines keep generating meanwhile
        sent = await ops.send(version, self._on_bucket)
        transferred = clock.now()
        self._enter(PubState.PAUSING)
        drained, paused = True, False
        if self.refresh_mode == "off":
            drained, paused, _ = await self._hold(ops)
        held = clock.now()
        self._enter(PubState.COMMITTING)
        engine = dict(await ops.commit(version))
        committed = clock.now()
        self._enter(PubState.RESUMING)
        if paused:
            await ops.continue_engines()
        if self.refresh_mode == "off":
            await ops.resume_submissions()
        end = clock.now()
        pause = float(engine.pop("pause_seconds", 0.0))
        aborted = int(engine.pop("aborted_transfers", 0))
        engine["commit_seconds"] = committed - held
        return PublicationResult(
            version=version, publication_seconds=0.0, paused_seconds=end - transferred,
            drain_seconds=held - transferred, transfer_seconds=transferred - begun,
            drained=drained, bytes=sent, control_seconds=0.0, pause_seconds=pause,
            aborted_transfers=aborted, engine=engine)

    async def _in_place(self, version: int, ops: PublicationOps) -> PublicationResult:
        begun = clock.now()
        drained = True
        self._enter(PubState.PAUSING)
        if self.refresh_mode == "off":
            drained, _, stopped_at = await self._hold(ops)
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
        return PublicationResult(
            version=version, publication_seconds=0.0, paused_seconds=end - begun,
            drain_seconds=paused_at - begun, transfer_seconds=transferred_at - paused_at,
            drained=drained, bytes=sent, control_seconds=stopped_at - begun,
            pause_seconds=end - paused_at)

    def _count(self, result: PublicationResult) -> None:
        t = self.totals
        t["publications"] += 1
        t["pause_seconds"] += result.pause_seconds
        t["pause_seconds_max"] = max(t["pause_seconds_max"], result.pause_seconds)
        t["transfer_seconds"] += result.transfer_seconds
        t["drain_seconds"] += result.drain_seconds
        t["aborted_transfers"] += result.aborted_transfers

    def summary(self) -> dict:
        """The run summary's `publication` (SPEC §13): seconds summed over the run's
        publications (the start-up transfer of version 0 excluded)."""
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.totals.items()}
