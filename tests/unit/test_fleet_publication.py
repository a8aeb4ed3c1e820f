"""The fleet's publication side (actors/fleet_publication.py) over fake actor handles: a
catch-up that never finishes fails within publication.timeout_s and lets go of members_lock;
a wedged engine's checksum answer loses that engine instead of holding members_lock forever;
the same error from every engine is raised, not blamed on each of them (which would restart
them all until engine.max_restarts is spent)."""

from __future__ import annotations

import asyncio
import types

import pytest

from actors.fleet_publication import FleetPublication
from rl_async.plan.load import load_config

GUARD_S = 30  # the test's own deadline: the code under test must answer well before it


class Call:
    """`handle.method.remote(...)` returning an awaitable, like a Ray actor handle's."""

    def __init__(self, fn):
        self.remote = fn


async def forever(*_args, **_kwargs):
    await asyncio.Event().wait()


async def nothing(*_args, **_kwargs):
    return None


class Fleet(FleetPublication):
    def __init__(self, engines: list, trainer, **publication):
        self.cfg = load_config("cluster_configs/local.toml",
                               [f"publication.{k}={v}" for k, v in publication.items()])
        self.prefix, self.engines, self.trainers = "t", engines, [trainer]
        self.down, self.pending_up, self.channels, self.incarnations = set(), set(), {}, {}
        self.members_lock = asyncio.Lock()
        self._channel_generation, self.version_hint = 0, 0
        self._metas = self._published_metas = [(["w"], ["float32"], [[1]], 4)]
        self._init_staging()
        self._init_relay()
        self._init_scale(len(engines))
        self.fault_log: list[dict] = []
        self.lost_engines: list[tuple[int, str]] = []
        self.supervisor = types.SimpleNamespace(
            spawn_restart=lambda i, cause: self.lost_engines.append((i, cause)))
        self.producer = types.SimpleNamespace(engine_up=Call(nothing))

    async def bounded(self, ref, what, timeout_s=120):
        return await asyncio.wait_for(ref, timeout_s)


def engine(**methods):
    return types.SimpleNamespace(**{k: Call(v) for k, v in methods.items()})


def trainer(**methods):
    base = {"open_channel": lambda name, t: _value(("127.0.0.1", 1)),
            "join_channels": lambda names, world: _value({}),
            "close_channels": nothing, "commit_publication": nothing}
    return engine(**{**base, **methods})


async def _value(v):
    return v


def test_a_catch_up_that_never_ends_fails_within_the_publication_deadline():
    async def main():
        fleet = Fleet([engine(init_weights_update_group=nothing, stage_weights=forever)],
                      trainer(send_publication=forever), timeout_s=1)
        fleet.pending_up = {0}  # a replacement, and nothing else can generate
        with pytest.raises(TimeoutError, match=r"catching up replacement engines \[0\].*"
                                               r"publication.timeout_s = 1"):
            await asyncio.wait_for(fleet.catch_up(), GUARD_S)
        assert not fleet.members_lock.locked()

    asyncio.run(main())


def test_a_wedged_engines_checksum_loses_that_engine_not_the_lock():
    async def main():
        fleet = Fleet([engine(weights_checksum=lambda: _value("abc")),
                       engine(weights_checksum=forever)],
                      trainer(snapshot_checksum=lambda which: _value("abc")),
                      channel_timeout_s=0.5)
        await asyncio.wait_for(fleet.verify_weights([0, 1]), GUARD_S)
        assert [i for i, _ in fleet.lost_engines] == [1]
        assert "weights checksum" in fleet.lost_engines[0][1]

    asyncio.run(main())


def test_the_same_error_from_every_engine_is_raised_not_blamed_on_them():
    async def bug(mode):
        raise TypeError("pause_generation() got an unexpected keyword argument")

    async def dead(mode):
        raise ConnectionError("sglang server gone")

    async def main():
        fleet = Fleet([engine(pause_generation=bug) for _ in range(3)], trainer())
        with pytest.raises(RuntimeError, match="failed on every engine alike"):
            await fleet.pause_engines("abort")
        assert fleet.lost_engines == []
        one = Fleet([engine(pause_generation=nothing), engine(pause_generation=dead),
                     engine(pause_generation=nothing)], trainer())
        await one.pause_engines("abort")  # one engine's own failure: that engine is lost
        assert [i for i, _ in one.lost_engines] == [1]

    asyncio.run(main())
