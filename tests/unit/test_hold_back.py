"""async.hold_back_collections: the trainer leaves that many collections in the buffer behind
the one it takes, so data is that much older (the forced lags of benchmarks/offpolicy_lag.py:
a deeper buffer, generation at the training pace)."""

from __future__ import annotations

import asyncio

import pytest
from inprocess_fleet import Disk, InProcessFleet

from rl_async.base.types import Group, Sample
from rl_async.loop.buffer import CompletedBuffer
from rl_async.loop.controller import Controller
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config


def group(gid: str) -> Group:
    return Group(gid, [Sample(prompt_id=gid, prompt_ids=[1], response_ids=[2],
                              behavior_logprobs=[-1.0], token_versions=[0])])


def test_a_get_leaves_the_held_groups_behind():
    async def scenario():
        buf = CompletedBuffer(6, max_lag=None, hold_back_groups=2)
        for i in range(3):
            await buf.put(group(f"g{i}"))
        first = await buf.get(1, 0)
        pending = asyncio.ensure_future(buf.get(1, 0))
        await asyncio.sleep(0.01)
        assert not pending.done() and len(buf) == 2      # two held back
        await buf.put(group("g3"))
        return first, await pending
    first, second = asyncio.run(scenario())
    assert first[0].group_id == "g0" and second[0].group_id == "g1"


def run(hold: int) -> dict:
    cfg = load_config("cluster_configs/local.toml", [
        "wandb.mode=disabled", "eval.every_steps=0", "run.max_steps=20",
        "async.max_weight_staleness=8", f"async.hold_back_collections={hold}",
        f"async.async_data_buffer_capacity_factor={hold + 1}"])
    plan = plan_capacity(cfg)[0]
    return asyncio.run(Controller(cfg, plan, InProcessFleet(cfg, plan, Disk(), seed=2),
                                  lambda m, s: None).run())


def test_held_back_collections_make_the_data_that_much_older():
    plain, held = run(0), run(3)
    assert held["staleness"]["queue_mean"] >= plain["staleness"]["queue_mean"] + 2.5
    assert held["ledger"]["discarded_groups"] == 0 and held["ledger"]["unaccounted"] == 0


@pytest.mark.parametrize("overrides,message", [
    (["async.hold_back_collections=2"], "async_data_buffer_capacity_factor to 3"),
    (["async.hold_back_collections=2", "async.async_data_buffer_capacity_factor=3",
      "async.max_weight_staleness=2"], "raise it to at least 3")])
def test_plan_errors_name_the_keys(overrides, message):
    cfg = load_config("cluster_configs/local.toml", overrides)
    assert any(message in e for e in plan_capacity(cfg)[2])
