"""The weight-publication side of RayFleet (PublicationOps): one channel per engine, pause /
transfer / resume over the engines that are up, checksum verification.

A channel is a process group of trainer rank 0 and ONE engine incarnation's TP ranks (gloo
on CPU, NCCL on GPU), named `<run>/pub/engine-<i>/n<incarnation>/g<generation>`; the name
travels in every call on both sides. Why not one group for the fleet: a collective couples
the fates of all its members. An engine that died inside a broadcast left the survivors
waiting for bytes that would never come (gloo relays through them; NCCL's watchdog kills the
sender), so every death cost a redo of the whole transfer after a timeout. With a channel
each, a death breaks only its own channel, and each channel moves through the buckets at
its own pace (rl_async/state/sender.py): the others receive every bucket while a hung
engine's channel waits out its deadline. The publication still ends only once every
channel's outcome is known, so a hung engine delays the resume by up to its deadline; it is
then `lost` (out of routing, restarted by the supervisor, caught up later).

    form channels   for live engines without one: trainer hosts the store (an ephemeral
                    port bound once) and joins them all at once, each on its own thread; the
                    engines join; a failure loses that engine
    transfer        trainer: every bucket to every channel, each bucket within
                    publication.channel_timeout_s and each engine's whole snapshot within
                    its receive budget (rl_async/plan/publication_budget.py); engines: their
                    buckets in order under the same deadlines, the last one carries the
                    version. An engine-side failure (a dead actor, a dead SGLang server
                    behind a live actor, a receive past its deadline) loses that engine; a
                    trainer-side failure is fatal, and so is the same error from every
                    engine at once (it is not theirs)
    commit          the sent snapshot becomes the published one (catch_up sends it)

A channel is superseded only when its engine incarnation ends (lost, replaced): the trainer
destroys its end then (an NCCL communicator holds GPU memory on trainer rank 0), and the
engine's end goes with the engine's process. An engine lost outside a publication (the
thread balancer's call) closes its channel while a CPU trainer may be sending on the others:
the sender allows that (its channel fails, the others go on).
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError

from actors.fleet_relay import FleetRelay
from actors.fleet_scale import FleetScale
from actors.fleet_staging import FleetStaging, _failure_text
from rl_async.loop.publish import BucketProgress
from rl_async.plan.publication_budget import engine_receive_budget_s

# After trainer rank 0 reports a channel broken, how long to wait for the engine's own
# error (a dead actor's call fails at once; a dead server's receive may never return).
ENGINE_ERROR_GRACE_S = 2.0


class FleetPublication(FleetStaging, FleetRelay, FleetScale):
    def _init_publication(self, engines: int) -> None:
        # engine -> (publication channel name, the incarnation it was formed with)
        self.channels: dict[int, tuple[str, int]] = {}
        self._channel_generation = 0
        self._metas: list[tuple] = []            # the staged snapshot's buckets
        self._published_metas: list[tuple] = []  # the last published one's (catch_up)
        self._init_staging()
        self._init_relay()
        self._init_scale(engines)

    def _channel_name(self, i: int) -> str:
        self._channel_generation += 1
        return (f"{self.prefix}/pub/engine-{i}/n{self.incarnations.get(i, 0)}"
                f"/g{self._channel_generation}")

    def _tp(self) -> int:
        return self.cfg.cluster.gpus_per_engine if self.cfg.cluster.inference_gpus else 1

    async def _form_channels(self, engines: list[int]) -> dict[int, str]:
        """A channel for each engine in `engines` that has none for its incarnation (a
        replacement, or the start). Returns {engine: cause} for engines that failed to
        join; a failure on trainer rank 0's side alone is fatal (raised)."""
        todo = [i for i in engines
                if self.channels.get(i, (None, None))[1] != self.incarnations.get(i, 0)]
        if not todo:
            return {}
        await self._close_channels(todo)  # a predecessor's, if any
        timeout_s = self.cfg.publication.channel_timeout_s
        backend = "nccl" if self.cfg.cluster.trainer_gpus else "gloo"
        world = 1 + self._tp()
        names = {i: self._channel_name(i) for i in todo}
        trainer = self.trainers[0]
        hosts = await asyncio.gather(*(trainer.open_channel.remote(names[i], timeout_s)
                                       for i in todo))
        joins = await asyncio.gather(
            trainer.join_channels.remote([names[i] for i in todo], world),
            *(self.engines[i].init_weights_update_group.remote(
                addr, port, 1, world, names[i], backend, timeout_s)
              for i, (addr, port) in zip(todo, hosts)), return_exceptions=True)
        if isinstance(joins[0], BaseException):
            raise RuntimeError(f"trainer rank 0 could not join the publication channels of "
                               f"engines {todo}: {_failure_text(joins[0])}")
        failed = {}
        for k, i in enumerate(todo):
            engine_side, trainer_side = joins[1 + k], joins[0].get(names[i])
            if isinstance(engine_side, BaseException):  # it never joined: the trainer's
                failed[i] = f"joining its publication channel: {_failure_text(engine_side)}"
            elif trainer_side is not None:  # side waited for it in vain
                raise RuntimeError(f"trainer rank 0 could not join the publication channel "
                                   f"of engine-{i}, which joined: {trainer_side}")
            else:
                self.channels[i] = (names[i], self.incarnations.get(i, 0))
        if failed:
            await trainer.close_channels.remote([names[i] for i in failed])
        return failed

    async def _close_channels(self, engines: list[int]) -> None:
        """Destroy the trainer's end of the channels of `engines` (an NCCL communicator on
        trainer rank 0's GPU is what would leak). A channel is superseded only when its
        engine incarnation ends, so the engine's end goes with the engine's process."""
        closing = [self.channels.pop(i)[0] for i in engines if i in self.channels]
        if closing:
            await self.trainers[0].close_channels.remote(closing)

    async def stop_submissions(self) -> None:
        await self.bounded(self.producer.pause_generation.remote(), "producer.pause_generation")

    async def drain(self, timeout_s: float) -> bool:
        return await self.producer.drain_generation.remote(timeout_s)

    def live_engines(self) -> list[int]:
        """Engines not known to be down (replacements waiting for weights included), not
        those that left the fleet (actors/fleet_scale.py)."""
        return [i for i in range(len(self.engines))
                if i not in self.down and i not in self.removed]

    async def lost(self, i: int, cause: str) -> None:
        """Engine i failed a fleet call: without fault tolerance the run stops; with it,
        the engine leaves routing and the supervisor replaces it (in its own task: the
        caller may hold members_lock). Its channel is destroyed on the trainer."""
        if i in self.removed:  # it left the fleet: nothing to restart
            return
        if self.supervisor is None:
            raise RuntimeError(f"engine {self.prefix}/engine-{i} failed: {cause} "
                               f"(engine.fault_tolerance is off)")
        await self._close_channels([i])
        if i not in self.down:
            self.down.add(i)
            self.supervisor.spawn_restart(i, cause)

    async def _on_live_engines(self, call, what: str) -> None:
        """`call(engine)` on every live engine; a failure loses that engine (a dead actor,
        or a dead SGLang server behind a live one: both are engine-side). The same error
        type from every engine (two or more) is not theirs: it is raised, not blamed on
        them, which would restart them all until engine.max_restarts is spent."""
        live = self.live_engines()
        results = await asyncio.gather(*(call(self.engines[i]) for i in live),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(live) >= 2 and len({type(e) for e in errors}) == 1 \
                and not isinstance(errors[0], (RayActorError, asyncio.TimeoutError)):
            raise RuntimeError(f"{what} failed on every engine alike, which is not an engine "
                               f"fault: {_failure_text(errors[0])}") from errors[0]
        for i, r in zip(live, results):
            if isinstance(r, BaseException):
                await self.lost(i, f"{what} failed: {_failure_text(r)}")

    async def pause_engines(self, mode: str) -> None:
        await self._on_live_engines(lambda e: e.pause_generation.remote(mode), "pause")

    async def continue_engines(self) -> None:
        await self._on_live_engines(lambda e: e.continue_generation.remote(), "continue")

    async def resume_submissions(self) -> None:
        await self.bounded(self.producer.resume_generation.remote(),
                           "producer.resume_generation")

    async def snapshot(self) -> None:
        """Trainer rank 0 stages a snapshot of the weights (megatron: every rank gathers)."""
        flat = self.cfg.engine.backend == "embedded"
        bucket_bytes = self.cfg.publication.bucket_bytes
        ranks = self._collective_ranks()
        checks = self.stages_weights  # and what each engine checks before it may commit
        first = (await asyncio.gather(*(t.prepare_publication.remote(bucket_bytes, flat, checks)
                                        for t in ranks)))[0]
        if checks:
            self._metas, *fingerprints = first
            self._checks = tuple(fingerprints)
        else:
            self._metas = first

    async def send(self, version: int, progress: BucketProgress | None = None) -> int:
        """Send the staged snapshot to every live engine. Staging engines receive and verify
        it while they generate (commit() switches them); the others load it in place, the
        last bucket carrying the version. Replacements get a channel first and rejoin
        routing once they hold it."""
        async with self.members_lock:
            if self.stages_weights:
                self._pending = await self._stage_locked(version, "staged")
                return self._pending.sent
            sent = await self._send_locked(version, progress, "staged")
            await self._published(version)
        return sent

    async def _published(self, version: int) -> None:
        """The staged snapshot is now the published one: what catch-ups send."""
        await self.trainers[0].commit_publication.remote(version)
        self._published_metas, self._published_checks = self._metas, self._checks
        self.version_hint = version

    async def catch_up(self, joining: list[int] | None = None) -> None:
        """Bring replacements in now when no engine can generate (every live engine is a
        replacement waiting for weights): the next publication needs a collection, the
        collection needs an engine. `joining`: engines that join a running fleet
        (actors/fleet_scale.py), brought in at once whatever the others do. They get the
        last PUBLISHED snapshot at its version, which the next stage() cannot overwrite
        (rl_async/state/sender.py). Bounded by publication.timeout_s like a publication:
        it holds members_lock."""
        p = self.cfg.publication
        try:
            await asyncio.wait_for(self._catch_up(joining), p.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"catching up replacement engines {sorted(self.pending_up)} "
                               f"with the published weights did not finish within "
                               f"publication.timeout_s = {p.timeout_s:g} s") from None

    async def _catch_up(self, joining: list[int] | None) -> None:
        async with self.members_lock:
            serving = [i for i in self.live_engines() if i not in self.pending_up]
            only = None if joining is None else [i for i in joining if i in self.pending_up]
            if joining is None and serving or not self.pending_up or only == []:
                return
            if not self._published_metas:
                return
            if self.stages_weights:
                staged = await self._stage_locked(self.version_hint, "published", only)
                await self._commit_locked(self.version_hint, "published", staged)
            else:
                await self._send_locked(self.version_hint, None, "published", only)

    async def _with_channels(self, only: list[int] | None = None) -> list[int]:
        """The live engines (of `only`, if given), each with a channel of its incarnation
        (an engine that fails to form one is lost)."""
        live = [i for i in self.live_engines() if only is None or i in only]
        for i, cause in (await self._form_channels(live)).items():
            await self.lost(i, cause)
        return [i for i in live if i in self.channels]

    async def _send_locked(self, version: int, progress: BucketProgress | None,
                           which: str, only: list[int] | None = None) -> int:
        """In place (engines that cannot stage): every bucket to every live engine (of
        `only`)."""
        metas = self._metas if which == "staged" else self._published_metas
        self.version_hint = version
        live = await self._with_channels(only)
        sent, failed, _ = await self._transfer(live, metas, self._bucket_loads(
            version, metas, progress), which)
        for i, cause in failed.items():
            await self.lost(i, cause)
        holding = [i for i in live if i not in failed]
        if self.cfg.publication.verify_checksum:
            await self.verify_weights(holding, which)
            holding = [i for i in holding if i not in self.down]
        for i in sorted(self.pending_up & set(holding)):
            await self.producer.engine_up.remote(i, self.engines[i])
            self.pending_up.discard(i)
        return sent

    def _bucket_loads(self, version: int, metas: list[tuple],
                      progress: BucketProgress | None):
        """Engine i's side of an in-place transfer: one call per bucket, each within
        publication.channel_timeout_s; the last carries the version."""
        timeout_s = self.cfg.publication.channel_timeout_s
        flush = self.cfg.refresh.mode == "off"  # never flush while requests are retracted
        reached = [0]

        async def load(i: int, channel: str) -> None:
            for b, (bnames, dtypes, shapes, _n) in enumerate(metas):
                if progress is not None and b >= reached[0]:
                    reached[0] = b + 1
                    progress(b, len(metas))
                last = b == len(metas) - 1
                await asyncio.wait_for(self.engines[i].update_weights_from_distributed.remote(
                    bnames, dtypes, shapes, channel, version if last else None,
                    flush if last else False), timeout_s)
        return load

    async def _transfer(self, live: list[int], metas: list[tuple], receive, which: str,
                        direct: list[int] | None = None, chunk_bytes: int = 0
                        ) -> tuple[int, dict[int, str], dict[int, object]]:
        """Trainer rank 0 sends the `which` snapshot on the channels of the `direct`
        engines (default: every live one; a relay's heads otherwise, in pieces of
        `chunk_bytes`) while `receive(i, channel)` runs each live engine's side. Returns
        (bytes per engine, {engine: cause} for those that did not get the whole snapshot,
        {engine: what its receive returned} for the others)."""
        if not live:
            return 0, {}, {}
        timeout_s = self.cfg.publication.channel_timeout_s
        total_s = engine_receive_budget_s(self.cfg.publication, len(metas))
        channels = {i: self.channels[i][0] for i in live}
        names = {i: channels[i] for i in (live if direct is None else direct)}

        async def bounded(i: int):
            # The whole receive has the budget the trainer's side has, and a moment more:
            # the trainer's verdict on a slow channel comes first.
            try:
                return await asyncio.wait_for(receive(i, channels[i]),
                                              total_s + ENGINE_ERROR_GRACE_S)
            except asyncio.TimeoutError:
                raise TimeoutError(f"its whole receive ({len(metas)} buckets) did not finish "
                                   f"within its budget of {total_s:g} s") from None

        receivers = {i: asyncio.ensure_future(bounded(i)) for i in live}
        try:
            sent, trainer_failed = await self.trainers[0].send_publication.remote(
                list(names.values()), which, timeout_s, total_s,
                **({"chunk_bytes": chunk_bytes} if chunk_bytes else {}))
        except BaseException:
            for task in receivers.values():
                task.cancel()
            raise  # trainer-side: fatal, the publication fails with it
        broken = [i for i, n in names.items() if n in trainer_failed]
        if broken:  # the engine's own error says more (a dead actor answers at once), but a
            # receive on a dead server may wait forever: a moment for it, then stop waiting
            await asyncio.wait([receivers[i] for i in broken], timeout=ENGINE_ERROR_GRACE_S)
            for i in broken:
                receivers[i].cancel()
        # The others got every byte; their calls finish (bounded inside bounded()).
        await asyncio.wait(receivers.values())
        failed, results = {}, {}
        for i, task in receivers.items():
            error = task.exception() if not task.cancelled() else None
            if i in broken:
                failed[i] = (f"{_failure_text(error)}; " if error else "") + (
                    f"the weight transfer to it failed on trainer rank 0: "
                    f"{trainer_failed[names[i]]}")
            elif error is not None:
                failed[i] = f"receiving the weights failed: {_failure_text(error)}"
            else:
                results[i] = task.result()
        return sent, failed, results

    async def transfer(self, version: int) -> int:
        """snapshot + send (+ commit) with nothing paused: tests that publish by hand."""
        await self.snapshot()
        sent = await self.send(version)
        if self.stages_weights:
            await self.commit(version)
        return sent

    async def verify_weights(self, members: list[int], which: str = "staged") -> None:
        """Every engine in `members` holds the snapshot (publication.verify_checksum); each
        answers within publication.channel_timeout_s, or it is lost (a wedged engine must
        not hold members_lock forever)."""
        timeout_s = self.cfg.publication.channel_timeout_s
        want = await self.bounded(self.trainers[0].snapshot_checksum.remote(which),
                                  "trainer.snapshot_checksum")
        got = await asyncio.gather(*(asyncio.wait_for(self.engines[i].weights_checksum.remote(),
                                                      timeout_s) for i in members),
                                   return_exceptions=True)
        for i, g in zip(members, got):
            if isinstance(g, BaseException):
                await self.lost(i, f"its weights checksum: {_failure_text(g)}")
        bad = [i for i, g in zip(members, got) if isinstance(g, str) and g != want]
        if bad:
            raise RuntimeError(f"engines {bad} do not hold the trainer's weights after "
                               f"publication (checksum mismatch)")
