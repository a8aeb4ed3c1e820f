"""The weight-publication side of RayFleet (PublicationOps): the publication group and its
members, pause / transfer / resume over the engines that are up, checksum verification.

Members change under fault tolerance (actors/engine_supervisor.py): an engine that is down
is left out, a replacement joins when the group is re-formed under a new name (a formed
torch.distributed group cannot take a new member), and it rejoins routing once it holds
the published version. Members are engine *incarnations*, not slots: a replacement at the
same index never joined the old group, so that group is stale too.

An engine that dies while the group forms or during a broadcast breaks the collective for
everyone. Gloo cannot abort a pending receive, so every member's group carries the deadline
publication.timeout_s / 3: the trainer's send errors at once (the socket resets), a survivor
whose bytes never came errors at that deadline, and the transfer is redone, without the dead
engine, over a new group.
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError

from actors.trainer import PUBLICATION_GROUP
from rl_async.loop.publish import BucketProgress

SEND_ATTEMPTS = 3  # a transfer is redone without engines that died during it


class FleetPublication:
    def _incarnations(self, engines: list[int]) -> list[tuple[int, int]]:
        return [(i, self.incarnations.get(i, 0)) for i in engines]

    async def _init_publication_group(self, members: list[int]) -> dict[int, str]:
        """(Re-)form the weight-publication group: trainer rank 0 and the engines in
        `members`. A restarted engine cannot join a formed group, so a change of members
        forms a new group under a new name (RayFleet.send). Returns {engine: cause} for
        engines that died meanwhile (the group is then not formed), else {}."""
        self._group_generation += 1
        name = f"{PUBLICATION_GROUP}-{self._group_generation}"
        addr, port = await self.trainers[0].address.remote()
        # Every tensor-parallel rank of an engine joins: engine i holds group ranks
        # 1 + i*tp ... (i+1)*tp; the trainer's rank 0 is the source.
        tp = self.cfg.cluster.gpus_per_engine if self.cfg.cluster.inference_gpus else 1
        world = 1 + len(members) * tp
        backend = "nccl" if self.cfg.cluster.trainer_gpus else "gloo"
        # The group's own timeout: a broadcast stuck on a peer that hangs or died errors
        # (gloo) or is aborted by NCCL's watchdog after a third of the publication deadline,
        # not after 30 min, which leaves the deadline room to redo the transfer without
        # that engine (SEND_ATTEMPTS). Engines get it too: it bounds their receives.
        timeout_s = self.cfg.publication.timeout_s / 3
        trainer, *engines = await asyncio.gather(
            self.trainers[0].init_publication_group.remote(addr, port, world, backend,
                                                           timeout_s, name),
            *(self.engines[m].init_weights_update_group.remote(addr, port, 1 + k * tp, world,
                                                               name, backend, timeout_s)
              for k, m in enumerate(members)), return_exceptions=True)
        dead = _deaths(members, engines, "while joining the weight-publication group")
        if dead:  # the others' rendezvous failed for want of it: their errors say nothing
            return dead
        _raise_first((trainer, *engines))
        self._group = (name, self._incarnations(members))
        return {}

    async def stop_submissions(self) -> None:
        await self.bounded(self.producer.pause_generation.remote(), "producer.pause_generation")

    async def drain(self, timeout_s: float) -> bool:
        return await self.producer.drain_generation.remote(timeout_s)

    def live_engines(self) -> list[int]:
        """Engines not known to be down (replacements waiting for weights included)."""
        return [i for i in range(len(self.engines)) if i not in self.down]

    async def lost(self, i: int, cause: str) -> None:
        """Engine i failed a fleet call: without fault tolerance the run stops; with it,
        the engine leaves routing and the supervisor replaces it (in its own task: the
        caller may hold members_lock)."""
        if self.supervisor is None:
            raise RuntimeError(f"engine actor {self.prefix}/engine-{i} died: {cause} "
                               f"(engine.fault_tolerance is off)")
        if i not in self.down:
            self.down.add(i)
            asyncio.ensure_future(self.supervisor.restart(i, cause))

    async def _on_live_engines(self, call) -> None:
        """`call(engine)` on every live engine; one that turns out dead is `lost`."""
        live = self.live_engines()
        results = await asyncio.gather(*(call(self.engines[i]) for i in live),
                                       return_exceptions=True)
        for i, r in zip(live, results):
            if isinstance(r, RayActorError):
                await self.lost(i, f"the actor died: {r}")
            elif isinstance(r, BaseException):
                raise r

    async def pause_engines(self, mode: str) -> None:
        await self._on_live_engines(lambda e: e.pause_generation.remote(mode))

    async def continue_engines(self) -> None:
        await self._on_live_engines(lambda e: e.continue_generation.remote())

    async def resume_submissions(self) -> None:
        await self.bounded(self.producer.resume_generation.remote(),
                           "producer.resume_generation")

    async def snapshot(self) -> None:
        """Trainer rank 0 copies the weights into its publication buckets."""
        flat = self.cfg.engine.backend == "embedded"
        bucket_bytes = self.cfg.publication.bucket_bytes
        ranks = self._collective_ranks()
        self.snapshot_pending = True  # the buckets now hold a version not yet sent
        self._metas = (await asyncio.gather(*(t.prepare_publication.remote(bucket_bytes, flat)
                                              for t in ranks)))[0]

    async def send(self, version: int, progress: BucketProgress | None = None) -> int:
        """Broadcast the snapshot bucket by bucket; the last bucket carries the version.
        Engines that are down are left out; replacements join (a new group) and rejoin
        routing once they hold this version. An engine that dies during the transfer is
        left out and the transfer is redone over a new group (the snapshot is unchanged)."""
        async with self.members_lock:
            sent = await self._send_locked(version, progress)
            self.snapshot_pending = False
        return sent

    async def catch_up(self) -> None:
        """Bring replacements in now when no engine can generate (every live engine is a
        replacement waiting for weights): the next publication needs a collection, the
        collection needs an engine. They get the last published snapshot, at its version."""
        async with self.members_lock:
            serving = [i for i in self.live_engines() if i not in self.pending_up]
            if self.pending_up and not serving and not self.snapshot_pending:
                await self._send_locked(self.version_hint, None)

    async def _send_locked(self, version: int, progress: BucketProgress | None) -> int:
        self.version_hint = version
        for _attempt in range(SEND_ATTEMPTS):
            live, dead = self.live_engines(), {}
            if self._incarnations(live) != self._group[1]:
                dead = await self._init_publication_group(live)
            if not dead:
                sent, dead = await self._broadcast(version, live, progress)
            if not dead:
                break
            for i, cause in dead.items():
                await self.lost(i, cause)
        else:
            raise RuntimeError(f"weight transfer of version {version}: engines kept dying "
                               f"during {SEND_ATTEMPTS} attempts; last: {dead}")
        if self.cfg.publication.verify_checksum:
            await self.verify_weights(live)
        for i in sorted(self.pending_up & set(live)):
            await self.producer.engine_up.remote(i, self.engines[i])
            self.pending_up.discard(i)
        return sent

    async def _broadcast(self, version: int, live: list[int],
                         progress: BucketProgress | None) -> tuple[int, dict[int, str]]:
        """One pass over the buckets; returns (bytes sent, {dead engine: cause})."""
        name, sent = self._group[0], 0
        for i, (names, dtypes, shapes, nbytes) in enumerate(self._metas):
            if progress is not None:
                progress(i, len(self._metas))
            last = i == len(self._metas) - 1
            trainer, *engines = await asyncio.gather(
                self.trainers[0].broadcast_bucket.remote(i),
                *(self.engines[m].update_weights_from_distributed.remote(
                    names, dtypes, shapes, name, version if last else None) for m in live),
                return_exceptions=True)
            dead = _deaths(live, engines, "during the weight transfer")
            if dead:  # the collective is broken for everyone: redo it without them
                return sent, dead
            _raise_first((trainer, *engines))
            sent += nbytes
        return sent, {}

    async def transfer(self, version: int) -> int:
        """snapshot + send (start-up, and tests that publish by hand)."""
        await self.snapshot()
        return await self.send(version)

    async def verify_weights(self, members: list[int]) -> None:
        want = await self.trainers[0].snapshot_checksum.remote()
        got = await asyncio.gather(*(self.engines[i].weights_checksum.remote() for i in members))
        bad = [i for i, g in zip(members, got) if g != want]
        if bad:
            raise RuntimeError(f"engines {bad} do not hold the trainer's weights after "
                               f"publication (checksum mismatch)")


def _deaths(engines: list[int], results: list, when: str) -> dict[int, str]:
    """{engine: cause} for the calls that failed because the engine's actor died. The
    others' errors (a reset socket, a receive past the group deadline) are the consequence."""
    return {i: f"the actor died {when}: {r}" for i, r in zip(engines, results)
            if isinstance(r, RayActorError)}


def _raise_first(results) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r
