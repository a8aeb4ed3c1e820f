"""The engine supervisor (actors/engine_supervisor.py) restarts engines in tasks of their own:
a lost node's engines come back concurrently, and the probe loop keeps probing the others
while they start (it used to await each restart inside the loop: one at a time, and a
second engine that hung meanwhile went unnoticed for minutes)."""

from __future__ import annotations

import asyncio
import types

import actors.engine_supervisor as sup
from rl_async.plan.load import load_config


class Call:
    """`handle.method.remote(...)` returning an awaitable, like a Ray actor handle's."""

    def __init__(self, fn):
        self.remote = fn


class FakeEngine:
    def __init__(self, fleet, i: int, healthy: bool = True):
        self.fleet, self.i, self.healthy = fleet, i, healthy
        self.health = Call(self._health)
        self.start = Call(self._start)

    async def _health(self):
        self.fleet.probes.append(self.i)
        if not self.healthy:
            raise RuntimeError("sglang server exited with code -9")
        return {"seconds_without_progress": 0.0}

    async def _start(self):
        self.fleet.starting.add(self.i)
        self.fleet.most_starting = max(self.fleet.most_starting, len(self.fleet.starting))
        await self.fleet.release.wait()
        self.fleet.starting.discard(self.i)


class FakeFleet:
    def __init__(self, cfg):
        self.cfg, self.prefix = cfg, "t"
        self.engines = [FakeEngine(self, i, healthy=i == 2) for i in range(3)]
        self.down, self.pending_up, self.fault_log, self.removed = set(), set(), [], set()
        self.incarnations = {}
        self.members_lock = asyncio.Lock()
        self.engine_start_timeout_s = 30
        self.probes, self.starting, self.most_starting = [], set(), 0
        self.release = asyncio.Event()
        self.caught_up = 0
        noop = Call(lambda *a: asyncio.sleep(0))
        self.producer = types.SimpleNamespace(engine_down=noop, fail=noop)

    async def bounded(self, ref, what, timeout_s=120):
        return await ref

    def start_engine(self, i):
        return FakeEngine(self, i)

    async def catch_up(self):
        self.caught_up += 1


def no_ray(monkeypatch) -> None:
    """Killing an actor and waiting for its name are Ray's: nothing to do here."""
    async def name_free(name):
        return None

    monkeypatch.setattr(sup.ray, "kill", lambda actor, no_restart=True: None)
    monkeypatch.setattr(sup.EngineSupervisor, "_name_free", staticmethod(name_free))


def test_restarts_run_concurrently_and_probing_goes_on_meanwhile(monkeypatch):
    cfg = load_config("cluster_configs/local.toml", ["engine.health_check_interval_s=0.05",
                                                     "engine.max_restarts=5"])
    no_ray(monkeypatch)

    async def main():
        fleet = FakeFleet(cfg)
        supervisor = sup.EngineSupervisor(fleet)
        supervisor.start()
        for _ in range(200):  # engines 0 and 1 fail their probes at once
            if fleet.most_starting == 2:
                break
            await asyncio.sleep(0.01)
        assert fleet.most_starting == 2, "the two replacements did not start concurrently"
        probes_while_starting = len(fleet.probes)
        await asyncio.sleep(0.3)
        assert fleet.probes.count(2) >= 3 and len(fleet.probes) > probes_while_starting, \
            "the probe loop stopped probing while replacements were starting"
        fleet.release.set()
        for _ in range(200):
            if fleet.pending_up == {0, 1}:
                break
            await asyncio.sleep(0.01)
        supervisor.stop()
        assert fleet.pending_up == {0, 1} and fleet.incarnations == {0: 1, 1: 1}
        assert supervisor.restarts.restarts == 2 and supervisor.fatal is None
        assert all("exited with code -9" in f["cause"] for f in fleet.fault_log)

    asyncio.run(main())


def test_a_replacement_lost_inside_its_own_catch_up_is_replaced_again(monkeypatch):
    """The replacement's catch-up runs inside its restart; losing it there used to ask for a
    restart that was ignored (its restart was still running), leaving it down for good."""
    cfg = load_config("cluster_configs/local.toml", ["engine.health_check_interval_s=60",
                                                     "engine.max_restarts=5"])
    no_ray(monkeypatch)

    async def main():
        fleet = FakeFleet(cfg)
        fleet.release.set()
        supervisor = sup.EngineSupervisor(fleet)

        async def catch_up():  # the first replacement dies inside it, as fleet.lost does
            fleet.caught_up += 1
            if fleet.caught_up == 1:
                fleet.down.add(0)
                supervisor.spawn_restart(0, "receiving the weights failed: the actor died")
                await asyncio.sleep(0.05)  # the catch-up goes on (other engines, commits)

        fleet.catch_up = catch_up
        supervisor.spawn_restart(0, "the actor died")
        for _ in range(200):
            if fleet.caught_up == 2 and not supervisor._tasks:
                break
            await asyncio.sleep(0.01)
        assert supervisor.restarts.restarts == 2 and fleet.incarnations == {0: 2}
        assert 0 not in fleet.down and fleet.caught_up == 2

    asyncio.run(main())


def test_an_engine_whose_loop_answers_but_whose_forward_hangs_is_restarted():
    """The probe answers (the actor's event loop is free) while requests make no progress:
    the supervisor reads seconds_without_progress and replaces the engine all the same."""
    cfg = load_config("cluster_configs/local.toml", ["engine.health_check_timeout_s=10"])

    async def main():
        fleet = FakeFleet(cfg)
        stuck = fleet.engines[2]

        async def stalled_health():
            return {"seconds_without_progress": 11.0}
        stuck.health = Call(stalled_health)
        supervisor = sup.EngineSupervisor(fleet)
        return await supervisor._probe(2), await supervisor._probe(0)

    stalled, dead = asyncio.run(main())
    assert stalled == "requests made no decode progress for 11 s"
    assert "exited with code -9" in dead


def test_the_embedded_engine_reports_a_hung_forward_while_its_loop_answers():
    import threading

    from test_engine_embedded import make_engine

    from rl_async.engine.base import SamplingParams

    async def main():
        engine = make_engine()
        release = threading.Event()
        compute = engine._compute
        engine._compute = lambda admitted: (release.wait(30), compute(admitted))[1]
        task = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))
        await asyncio.sleep(0.5)
        stalled = engine.seconds_without_progress()  # asked on the loop: it answers
        release.set()
        out = await task
        after = engine.seconds_without_progress()
        await engine.close()
        return stalled, out, after

    stalled, out, after = asyncio.run(main())
    assert stalled >= 0.4  # the hung forward shows as time without progress ...
    assert len(out.output_ids) == 4 and after == 0.0  # ... and idle again after it finished
