"""Engine health and restart (engine.fault_tolerance): the fleet's supervisor task.

    every engine.health_check_interval_s, for every engine in the fleet:
      probe = engine.health()  within engine.health_check_timeout_s
        dead actor | no answer | requests without decode progress past the timeout
          -> out of routing now (producer.engine_down); its requests fail over to aborts and
             their groups are regenerated (the ledger counts them aborted)
          -> EngineRestarts.record: past engine.max_restarts the run stops (producer.fail),
             naming the engine and its causes
          -> kill it (an SGLang server dies with its actor's process group), start a
             replacement in the same placement-group bundle
          -> the next publication re-forms the weight group with it and sends it the
             current weights; only then does it rejoin routing (RayFleet.send). When no
             other engine can generate (all were lost), it gets the last published weights
             at once (RayFleet.catch_up): the next publication would need a collection.

Each restart runs in a task of its own (spawn_restart): a lost node's engines come back
concurrently, and the probe loop goes on probing the others while they start.

An engine that fails during a publication (its actor, or the SGLang server behind it, in a
pause, a transfer or a continue) is `lost` the same way; the others' transfers are not
affected: each engine has its own publication channel (actors/fleet_publication.py). A
replacement is a new incarnation of its slot and gets a channel of its own.

A restart that cannot complete (the replacement does not start, its catch-up fails) stops
the run naming the engine and both causes: an error in this task must not vanish.
"""

from __future__ import annotations

import asyncio
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rl_async.loop.faults import EngineRestarts, RunStopped, quote

NAME_FREE_TIMEOUT_S = 60


class EngineSupervisor:
    def __init__(self, fleet) -> None:
        self.fleet = fleet
        e = fleet.cfg.engine
        self.interval_s, self.timeout_s = e.health_check_interval_s, e.health_check_timeout_s
        self.restarts = EngineRestarts(e.max_restarts)
        self.fatal: RunStopped | None = None
        self._task: asyncio.Task | None = None
        self._restarting: set[int] = set()  # the probe and a failed call may both see it
        self._again: dict[int, str] = {}  # lost again while restarting: the cause
        self._tasks: set[asyncio.Task] = set()  # restarts in flight, one task per engine

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._tasks:
            task.cancel()

    def spawn_restart(self, i: int, cause: str) -> None:
        """Replace engine i in a task of its own: restarts of several engines (a lost node)
        run concurrently, and the probe loop keeps probing the others meanwhile. A
        replacement lost while its own restart is still running (it died in its catch-up)
        is replaced again once that restart ends."""
        if i in self._restarting:
            self._again[i] = cause
            return
        task = asyncio.ensure_future(self.restart(i, cause))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _loop(self) -> None:
        while self.fatal is None:
            await asyncio.sleep(self.interval_s)
            fleet = self.fleet
            watched = [i for i in range(len(fleet.engines))
                       if i not in fleet.down and i not in fleet.removed]
            causes = await asyncio.gather(*(self._probe(i) for i in watched))
            for i, cause in zip(watched, causes):
                if cause is not None and self.fatal is None:
                    self.spawn_restart(i, cause)

    async def _probe(self, i: int) -> str | None:
        """None when engine i is healthy, else why not."""
        try:
            health = await asyncio.wait_for(self.fleet.engines[i].health.remote(),
                                            self.timeout_s)
        except RayActorError as exc:
            return f"the actor died: {quote(str(exc), 300)}"
        except (asyncio.TimeoutError, GetTimeoutError):
            return f"no answer to its health probe within {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 -- the SGLang server's own health check
            return f"health probe failed: {type(exc).__name__}: {quote(str(exc), 300)}"
        stalled = health.get("seconds_without_progress", 0.0)
        if stalled > self.timeout_s:
            return f"requests made no decode progress for {stalled:.0f} s"
        return None

    async def restart(self, i: int, cause: str) -> None:
        """Replace engine i (put into the fleet's `down` set, if it is not there yet). An
        engine that left the fleet (`rl-async scale`) is not replaced: a probe may have
        caught it between its removal and its end."""
        if i in self._restarting or self.fatal is not None or i in self.fleet.removed:
            return
        self._restarting.add(i)
        try:
            await self._restart(i, cause)
        except Exception as exc:  # noqa: BLE001 -- it becomes the run's error, quoted
            self.fatal = RunStopped(
                f"engine-{i} failed ({quote(cause, 300)}) and replacing it failed too: "
                f"{type(exc).__name__}: {quote(str(exc), 300)}")
            await self.fleet.bounded(self.fleet.producer.fail.remote(str(self.fatal)),
                                     "producer.fail")
        finally:
            self._restarting.discard(i)
        again = self._again.pop(i, None)
        if again is not None and self.fatal is None and i in self.fleet.down:
            self.spawn_restart(i, again)

    async def _restart(self, i: int, cause: str) -> None:
        fleet = self.fleet
        fleet.down.add(i)
        await fleet.bounded(fleet.producer.engine_down.remote(i), "producer.engine_down")
        fleet.fault_log.append({"engine": i, "cause": quote(cause, 300), "at": time.time()})
        print(f"[rl-async] engine-{i} is out of routing: {cause}; restarting it", flush=True)
        try:
            self.restarts.record(i, cause)
        except RunStopped as exc:
            self.fatal = exc
            await fleet.bounded(fleet.producer.fail.remote(str(exc)), "producer.fail")
            return
        ray.kill(fleet.engines[i], no_restart=True)  # a hung one too: its calls now fail
        await self._name_free(f"{fleet.prefix}/engine-{i}")
        new = fleet.start_engine(i)
        await asyncio.wait_for(new.start.remote(), fleet.engine_start_timeout_s)
        async with fleet.members_lock:  # never swapped under a transfer
            fleet.engines[i] = new
            fleet.incarnations[i] = fleet.incarnations.get(i, 0) + 1
            fleet.down.discard(i)
            fleet.pending_up.add(i)
        await fleet.catch_up()  # at once if nothing else can generate

    @staticmethod
    async def _name_free(name: str) -> None:
        """The old actor's name is released once Ray has seen it die."""
        deadline = time.monotonic() + NAME_FREE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{name} was killed but its name is still taken after "
                           f"{NAME_FREE_TIMEOUT_S} s")
