"""The staged publication of RayFleet (engines that stage weights: the embedded engine): a
transaction per engine, with the engines generating until the switch.

    stage    (members_lock) every live engine with a channel of its incarnation: trainer
             rank 0 sends the snapshot while each engine receives it into its staging
             buffers and checks each bucket's fingerprint and the model digest
             (EngineActor.stage_weights). An engine whose channel or receive fails is lost
             (restarted, caught up later); one whose buckets do not verify keeps serving its
             committed version and gets the next publication as usual. Both count as
             aborted transfers; neither is ever half-updated.
    commit   (members_lock, after the producer's drain) each verified engine, if it is still
             the incarnation that verified, switches between two of its steps
             (EngineActor.commit_weights); a failure loses it. Then the snapshot becomes
             the published one (catch-ups send it) and replacements that committed rejoin
             routing.

`committed` records each engine's committed version: `fleet_versions()` reports the fleet's
minimum and maximum.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ray.exceptions import RayActorError

from actors.fleet_relay import relay_chunk_bytes
from rl_async.loop.faults import quote


@dataclass
class Staged:
    """One staging pass: the engines that verified (engine -> incarnation), the engines
    that received and will not commit, and the engines' figures."""
    sent: int
    verified: dict[int, int] = field(default_factory=dict)
    aborted: int = 0
    figures: dict[str, float] = field(default_factory=dict)


class FleetStaging:
    def _init_staging(self) -> None:
        self.committed: dict[int, int] = {}  # engine -> the version it committed last
        self._checks = self._published_checks = ([], "")  # (fingerprints, digest)
        # The publication's staging, awaiting its commit (a catch-up in between has its own).
        self._pending = Staged(0)

    @property
    def stages_weights(self) -> bool:
        return self.cfg.engine.backend == "embedded"

    async def _stage_locked(self, version: int, which: str, only: list[int] | None = None
                            ) -> Staged:
        """Stage `which` snapshot at `version` on every live engine (of `only`: joining
        engines) (module docstring)."""
        metas, checks = ((self._metas, self._checks) if which == "staged"
                         else (self._published_metas, self._published_checks))
        fingerprints, digest = checks
        live = await self._with_channels(only)

        async def stage(i: int, source: str, forward: str | None = None, chunk: int = 0,
                        relayed: bool = False) -> dict:
            return await self.engines[i].stage_weights.remote(
                metas, source, version, fingerprints, digest, forward, chunk, relayed)

        if self.relays() and len(live) > 1:
            sent, failed, results = await self._relay_transfer(live, metas, stage, which)
        else:  # in pieces all the same: each engine checks one while it receives the next
            chunk = relay_chunk_bytes(sum(m[3] for m in metas), len(live))
            sent, failed, results = await self._transfer(
                live, metas, lambda i, channel: stage(i, channel, None, chunk), which,
                chunk_bytes=chunk)
        for i, cause in failed.items():
            await self.lost(i, cause)
        verified = {i: self.incarnations.get(i, 0) for i, r in results.items()
                    if r["verified"]}
        for i, r in results.items():
            if not r["verified"]:
                self.fault_log.append({"engine": i, "version": version,
                                       "cause": f"weights not verified, not committed: "
                                                f"{r['error']}", "restarted": False})
        return Staged(sent, verified, len(failed) + len(results) - len(verified), {
            key: max((r[key] for r in results.values()), default=0.0)
            for key in ("receive_seconds", "load_seconds")})

    async def commit(self, version: int) -> dict[str, float]:
        """Switch the engines that verified `version` to it (PublicationOps.commit); the
        longest engine's pause, the aborted transfers and the engines' stage figures."""
        async with self.members_lock:
            staged, self._pending = self._pending, Staged(0)
            if self.cfg.publication.verify_checksum:  # it reads the staged snapshot
                pause = await self._commit_locked(version, "staged", staged)
                await self._published(version)
            else:  # trainer rank 0's side of the commit need not wait for the engines'
                pause, _ = await asyncio.gather(self._commit_locked(version, "staged", staged),
                                                self._published(version))
        return {"pause_seconds": pause, "aborted_transfers": staged.aborted,
                **staged.figures}

    async def _commit_locked(self, version: int, which: str, staged: Staged) -> float:
        """Commit the engines of `staged` still of the incarnation that verified; counts
        those that do not commit in `staged.aborted`. Returns the longest pause."""
        targets = [i for i, incarnation in staged.verified.items()
                   if i not in self.down and i not in self.removed
                   and self.incarnations.get(i, 0) == incarnation]
        staged.aborted += len(staged.verified) - len(targets)  # replaced, left since
        timeout_s = self.cfg.publication.channel_timeout_s
        results = await asyncio.gather(*(asyncio.wait_for(
            self.engines[i].commit_weights.remote(version), timeout_s) for i in targets),
            return_exceptions=True)
        pauses, committed = [], []
        for i, r in zip(targets, results):
            if isinstance(r, BaseException):
                staged.aborted += 1
                await self.lost(i, f"committing version {version} failed: {_failure_text(r)}")
            else:
                pauses.append(r["pause_seconds"])
                committed.append(i)
                self.committed[i] = version
        if self.cfg.publication.verify_checksum:
            await self.verify_weights(committed, which)
            committed = [i for i in committed if i not in self.down]
        for i in sorted(self.pending_up & set(committed)):
            await self.producer.engine_up.remote(i, self.engines[i])
            self.pending_up.discard(i)
        return max(pauses, default=0.0)

    def fleet_versions(self) -> dict[str, int]:
        """The committed versions of the engines in routing: {"min", "max"}."""
        serving = [self.committed.get(i, 0) for i in self.live_engines()
                   if i not in self.pending_up]
        return {"min": min(serving, default=0), "max": max(serving, default=0)}


def _failure_text(exc: BaseException) -> str:
    """One engine-side failure as a line of the fault log (launch/run.py's _cause, by
    contrast, digs the innermost cause out of a chain of Ray task errors)."""
    if isinstance(exc, asyncio.TimeoutError):  # builtin TimeoutError too (3.11)
        return str(exc) or "no answer within publication.channel_timeout_s"
    if isinstance(exc, RayActorError):
        return f"the actor died: {quote(str(exc), 300)}"
    return f"{type(exc).__name__}: {quote(str(exc), 300)}"
