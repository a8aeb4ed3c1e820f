"""What an elastic fleet (actors/fleet_scale.py) relies on in the core: the producer's budget
and generation gate resized while it runs (`Producer.resize`), the router taking a new engine
only once it is put in routing, and the limits for a new engine count."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.engine.router import NoHealthyEngine, Router
from rl_async.plan.capacity import limits_for_engines
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from test_producer import World


def test_the_budget_and_the_gate_follow_a_resize_while_running():
    async def main():
        w = World(group_size=2, gen_delay=0.005)
        p = w.producer("sample", budget=4, http=100)
        task = asyncio.create_task(p.run())
        await asyncio.sleep(0.2)
        assert w.max_inflight == 4
        p.resize(8, 100)  # two more engines' worth
        await asyncio.sleep(0.2)
        assert w.max_inflight == 8
        p.resize(8, 3)  # the gate shrinks: permits come back as requests return
        await asyncio.sleep(0.2)
        w.max_inflight = 0
        await asyncio.sleep(0.2)
        assert 0 < w.max_inflight <= 3
        with pytest.raises(ValueError, match="whole number of groups of 2"):
            p.resize(3, 3)
        p.stop()
        await task
        assert p.limits.producer_samples == 8 and p.limits.http_slots == 3
    asyncio.run(main())


def test_a_new_engine_takes_requests_only_once_in_routing():
    router = Router(["e0"])
    router.set_healthy(0, False)
    assert router.add("e1") == 1
    with pytest.raises(NoHealthyEngine):
        router.pick()
    router.set_healthy(1, True)
    assert router.pick() == 1 and router.outstanding(1) == 1


@pytest.mark.parametrize("explicit, want", [(None, [128, 128, 256]), ("64", [32, 64, 128])])
def test_limits_for_a_new_engine_count(explicit, want):
    cfg = load_config("cluster_configs/local.toml", ["cluster.cpu_engines=2"])
    cfg.async_.async_max_concurrent_samples = None if explicit is None else int(explicit)
    plan = validate(cfg).plan
    got = [limits_for_engines(cfg, plan, n) for n in (1, 2, 4)]
    assert [producer for producer, _ in got] == want
    assert [http for _, http in got] == [plan.server_concurrency * n for n in (1, 2, 4)]
