"""async.staleness_bound = "admission": the completed buffer grants the producer tickets only
for groups that will fit the lag when the trainer reaches them (rl_async/loop/admission.py);
the dequeue filter remains, as a fallback. And rollout/length_ks, the length bias of what is
trained."""

from __future__ import annotations

import asyncio

import pytest
from inprocess_fleet import Disk, InProcessFleet

from rl_async.base.types import Group, Sample
from rl_async.loop.admission import AdmissionBound
from rl_async.loop.buffer import BufferClosedError, CompletedBuffer
from rl_async.loop.controller import Controller
from rl_async.observe.length_ks import LengthKS
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config


def group(gid: str, version: int, length: int = 2) -> Group:
    return Group(gid, [Sample(prompt_id=gid, prompt_ids=[1], response_ids=[2] * length,
                              behavior_logprobs=[-1.0] * length,
                              token_versions=[version] * length)])


def test_the_horizon_is_whole_collections_within_the_lag():
    b = AdmissionBound(lag=4, collection_groups=3, updates_per_collection=2)
    assert b.horizon() == 3 * (4 // 2 + 1)               # next collections at v0, v2, v4
    b.set_trainer_version(2)                              # the trainer moved, engines did not
    assert b.horizon() == 3 * (2 // 2 + 1)
    b.set_engine_version(2)
    assert b.horizon() == 9
    b.set_trainer_version(8)                              # engines 6 behind a lag of 4
    assert b.horizon() == 0 and b.allowed(0) == 0
    assert b.allowed(0, starving=2) == 2                  # a waiting trainer is never starved
    assert b.grant(5, ahead=0, starving=2) == 2 and b.forced == 2 and b.tickets == 2
    with pytest.raises(ValueError, match="released twice"):
        b.returned(3)
    with pytest.raises(ValueError, match="max_weight_staleness"):
        AdmissionBound(lag=0, collection_groups=1, updates_per_collection=1)


def test_the_buffer_parks_admission_until_the_trainer_consumes():
    async def scenario():
        buf = CompletedBuffer(8, max_lag=1,
                              admission=AdmissionBound(1, collection_groups=2,
                                                       updates_per_collection=1))
        assert await buf.admit(10) == 4                   # collections at v0 and v1
        parked = asyncio.ensure_future(buf.admit(1))
        await asyncio.sleep(0.01)
        assert not parked.done()                          # everything ahead is within the lag
        for i in range(4):
            await buf.put(group(f"g{i}", 0))
        assert buf.admission.bound.tickets == 0 and len(buf) == 4
        got = await buf.get(2, 0)                         # trains v0; next collection is v1
        assert [g.group_id for g in got] == ["g0", "g1"]
        await asyncio.sleep(0.01)
        assert not parked.done()                          # engines still at 0: v2 - 0 > lag
        buf.set_version(1, engine_version=1)
        assert await parked == 1                          # a group for the v2 collection
        buf.release(1)                                    # say it was filtered
        assert buf.admission.bound.tickets == 0
        assert await buf.admit(5) == 2                    # 2 buffered + 2: the horizon, 4
        waiting = asyncio.ensure_future(buf.admit(1))
        await asyncio.sleep(0)
        buf.close("shutdown")
        with pytest.raises(BufferClosedError):
            await waiting
    asyncio.run(scenario())


def test_a_waiting_trainer_gets_its_groups_even_past_the_horizon():
    async def scenario():
        buf = CompletedBuffer(8, max_lag=1, admission=AdmissionBound(1, 2, 1))
        buf.set_version(5)                                # engines at 0: far beyond the lag
        get = asyncio.ensure_future(buf.get(2, 5))
        granted = await asyncio.wait_for(buf.admit(4), 1.0)
        get.cancel()
        return granted, buf.admission.bound.forced
    assert asyncio.run(scenario()) == (2, 2)


def run(overrides: list[str]) -> dict:
    cfg = load_config("cluster_configs/local.toml", ["wandb.mode=disabled", "eval.every_steps=0",
                                                     *overrides])
    plan = plan_capacity(cfg)[0]
    fleet = InProcessFleet(cfg, plan, Disk(), seed=3)
    return asyncio.run(Controller(cfg, plan, fleet, lambda m, s: None).run())


# Engines that trail the trainer (publication every 2 updates) with a lag that leaves room
# for it: the producer's budget and the buffer let groups age past the lag while queued.
SCENARIO = ["run.max_steps=24", "async.max_weight_staleness=2", "publication.every_updates=2",
            "async.async_data_buffer_capacity_factor=4"]


def test_admission_discards_nothing_where_dequeue_filtering_discards():
    dequeue = run(SCENARIO + ["async.staleness_bound=dequeue"])
    admission = run(SCENARIO + ["async.staleness_bound=admission"])
    assert dequeue["ledger"]["discarded_groups"] > 0      # the scenario does age groups out
    assert admission["ledger"]["discarded_groups"] == 0
    assert admission["staleness"]["bound"] == "admission"
    assert admission["staleness"]["max_delivered"] <= 2
    for s in (dequeue, admission):
        assert s["ledger"]["unaccounted"] == 0 and s["steps"] == 24


def test_length_ks():
    ks = LengthKS()
    assert ks.distance() == 0.0
    ks.add_generated([1, 2, 3, 4])
    ks.add_trained([1, 2, 3, 4])
    assert ks.distance() == 0.0
    ks.add_generated([10, 10, 10, 10])                    # the long half never trained
    assert ks.distance() == pytest.approx(0.5)


def test_length_ks_reaches_w_and_b_and_the_summary():
    async def scenario():
        buf = CompletedBuffer(4, max_lag=0)
        await buf.put(group("short", 0, length=1))
        await buf.put(group("long", 0, length=9))
        buf.set_version(1)
        await buf.put(group("fresh", 1, length=1))
        await buf.get(1, 1)                               # "short" and "long" are stale
        return buf.metrics()
    m = asyncio.run(scenario())
    assert m["length_ks"] == pytest.approx(1 / 3)         # generated 1,9,1 vs trained 1
    summary = run(SCENARIO + ["async.staleness_bound=dequeue"])
    assert summary["rollout"]["length_ks"] == 0.0  # the fake engine answers 2 tokens, always


def test_the_plan_resolves_the_bound_and_its_horizon():
    def plan(*overrides):
        return plan_capacity(load_config("cluster_configs/local.toml", list(overrides)))[0]
    p = plan("async.staleness_bound=admission", "async.max_weight_staleness=4")
    assert (p.staleness_bound, p.admission_horizon_groups) == ("admission", 8 * (4 + 1))
    assert plan("async.staleness_bound=admission", "async.max_weight_staleness=0"
                ).staleness_bound == "dequeue"               # lag 0 is sync by construction
    assert plan().staleness_bound == "dequeue"


def test_tickets_are_banked_so_most_groups_open_without_a_round_trip():
    cfg = load_config("cluster_configs/local.toml", [
        "wandb.mode=disabled", "eval.every_steps=0", "run.max_steps=8",
        "async.staleness_bound=admission"])
    plan = plan_capacity(cfg)[0]
    fleet = InProcessFleet(cfg, plan, Disk(), seed=5)
    calls = []
    admit = fleet.buffer.admit

    async def counted(n):
        calls.append(n)
        return await admit(n)
    fleet.producer._admit = counted
    summary = asyncio.run(Controller(cfg, plan, fleet, lambda m, s: None).run())
    opened = summary["ledger"]["submitted_groups"]
    assert opened >= 8 * plan.rollout_batch_size and len(calls) <= opened / 4


def test_a_landing_publication_moves_only_the_engine_version():
    """The controller's landing task sends (None, engine version): the trainer version the
    loop sent before it stays, whatever order the two calls arrive in."""
    buf = CompletedBuffer(8, max_lag=1, admission=AdmissionBound(1, 2, 1))
    buf.set_version(32)
    buf.set_version(None, engine_version=31)
    assert buf._version == 32
    assert buf.admission.bound.engine_version == 31
    with pytest.raises(ValueError, match="older than version 32"):
        buf.set_version(31)
