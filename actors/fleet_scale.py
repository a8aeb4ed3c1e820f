"""An elastic fleet (`rl-async scale --run NAME --engines N`, ControllerActor.scale): engines
join and leave a running run.

    join    a bundle for it (a bundle an engine that left freed, else a placement group of
            its own, waited for in the background for at most `placement_timeout_s`: an
            engine the cluster cannot place yet never holds the run up, and past the
            deadline it is given up and counted `unplaced`), the actor, a channel; then,
            under members_lock, the newest published version staged, verified and committed
            on it alone (a catch-up), and only then does it enter routing. The producer
            budget and the generation gate grow with it.
    leave   out of routing at once; its requests finish for up to
            publication.drain_timeout_s, the rest are aborted and their groups go back to
            the ledger (regenerated, counted aborted); then its channel and relay links are
            destroyed, the actor stopped, its bundle freed for the next engine that joins,
            and the producer's limits shrink (permits are taken back as work returns them).
            The engines with the highest indices leave first.

Engine indices are never reused: a left engine stays in `removed`, out of everything that
iterates the fleet (routing, publication, the supervisor's probes).
"""

from __future__ import annotations

import asyncio
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_async.plan.capacity import limits_for_engines

PLACEMENT_WAIT_S = 120.0  # default deadline for an added engine's placement


class FleetScale:
    def _init_scale(self, engines: int) -> None:
        self.removed: set[int] = set()
        self.bundles: dict[int, tuple] = {}  # engine -> (placement group, bundle), if not the start's
        self._free_bundles: list[tuple] = []
        self._own_pgs: dict[int, object] = {}  # engine -> a placement group of its own
        self._joining: set[asyncio.Task] = set()
        self.scale_counts = {"engines_added": 0, "engines_removed": 0,
                             "engines_max": engines, "engines_unplaced": 0}

    def members(self) -> list[int]:
        """The engines of the fleet (up, down or restarting), not those that left."""
        return [i for i in range(len(self.engines)) if i not in self.removed]

    def fleet_summary(self) -> dict:
        """The run summary's `fleet` (SPEC §13)."""
        return {**self.scale_counts, "engines_final": len(self.members())}

    def _bundle_of(self, i: int) -> tuple:
        return self.bundles.get(i, (self.engine_pg, i))

    async def scale(self, engines: int, placement_timeout_s: float = PLACEMENT_WAIT_S) -> dict:
        """Grow or shrink the fleet to `engines` members. Joins go on in the background
        (each within placement_timeout_s for its bundle); leaves are done on return."""
        if engines < 1:
            raise ValueError(f"--engines {engines}: a run needs at least one engine")
        members = self.members()
        target = engines - len(self._joining)
        leaving = sorted(members, reverse=True)[:max(0, len(members) - engines)]
        for i in leaving:
            await self._leave(i)
        for _ in range(max(0, target - len(members))):
            task = asyncio.ensure_future(self._join(placement_timeout_s))
            self._joining.add(task)
            task.add_done_callback(self._joining.discard)
        return {"engines": len(self.members()), "joining": len(self._joining),
                "left": leaving, **self.fleet_summary()}

    async def _resize_producer(self) -> None:
        producer, http = limits_for_engines(self.cfg, self.plan, len(self.members()))
        await self.bounded(self.producer.set_limits.remote(producer, http),
                           "producer.set_limits")

    async def _join(self, placement_timeout_s: float) -> None:
        bundle = await self._place(placement_timeout_s)
        if bundle is None:
            self.scale_counts["engines_unplaced"] += 1
            return
        async with self.members_lock:
            i = len(self.engines)
            self.bundles[i] = bundle
            actor = self.start_engine(i)
            self.engines.append(actor)
            self.down.add(i)  # like a replacement: out of publications until started
            await self.bounded(self.producer.engine_add.remote(i, actor), "producer.engine_add")
        try:
            await asyncio.wait_for(actor.start.remote(), self.engine_start_timeout_s)
            async with self.members_lock:
                self.down.discard(i)
                self.pending_up.add(i)
            await self._resize_producer()
            await self.catch_up([i])  # the newest published version, then routing
        except Exception as exc:  # noqa: BLE001 -- an engine that fails to join is lost
            cause = f"joining the fleet failed: {type(exc).__name__}: {exc}"
            if self.supervisor is None:  # no restarts: it leaves instead of failing the run
                self.removed.add(i)
                self.pending_up.discard(i)
                self.down.discard(i)
                ray.kill(actor, no_restart=True)
                print(f"[rl-async] scale: engine-{i} {cause}; not added", flush=True)
                return
            self.down.discard(i)  # so that lost() hands it to the supervisor
            await self.lost(i, cause)
        counts = self.scale_counts
        counts["engines_added"] += 1
        counts["engines_max"] = max(counts["engines_max"], len(self.members()))

    async def _place(self, timeout_s: float) -> tuple | None:
        """A bundle for a new engine: a freed one, else a placement group of its own within
        `timeout_s` (awaited, so the run goes on meanwhile); None when none came."""
        if self._free_bundles:
            return self._free_bundles.pop()
        c = self.cfg.cluster
        gpu = c.inference_gpus > 0
        pg = placement_group([{"CPU": c.engine_cpus,
                               **({"GPU": c.gpus_per_engine} if gpu else {})}])
        try:
            await asyncio.wait_for(pg.ready(), timeout_s)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            print(f"[rl-async] scale: no room for another engine within {timeout_s:g} s "
                  f"(cluster resources: {ray.available_resources()}); not added", flush=True)
            return None
        self.pgs.append(pg)
        return (pg, 0)

    async def _leave(self, i: int) -> None:
        """Engine i leaves the fleet (module docstring)."""
        self.removed.add(i)  # first: the supervisor must not replace it as it goes
        drained = await self.bounded(self.producer.engine_leave.remote(
            i, self.cfg.publication.drain_timeout_s), "producer.engine_leave",
            self.cfg.publication.drain_timeout_s + 60)
        async with self.members_lock:
            self.down.discard(i)
            self.pending_up.discard(i)
            await self._close_channels([i])
            await self._close_links([pair for pair in self.links if i in pair])
        engine = self.engines[i]
        try:
            await asyncio.wait_for(engine.shutdown.remote(), 30)
        except Exception:  # noqa: BLE001 -- it is killed next either way
            pass
        ray.kill(engine, no_restart=True)
        self._free_bundles.append(self._bundle_of(i))
        self.scale_counts["engines_removed"] += 1
        await self._resize_producer()
        print(f"[rl-async] scale: engine-{i} left the fleet ("
              f"{'drained' if drained else 'its last requests aborted and regenerated'}) at "
              f"{time.strftime('%H:%M:%S')}", flush=True)
