"""A delivered group's age splits into the part it gained in flight (generation, up to its
insertion into the buffer) and in queue (waiting there): summary `staleness.inflight_mean`
and `staleness.queue_mean`, W&B `rollout/staleness_inflight_mean` / `_queue_mean`."""

from __future__ import annotations

import asyncio

import pytest
from inprocess_fleet import Disk, InProcessFleet

from rl_async.base.types import Group, Sample
from rl_async.loop.buffer import CompletedBuffer
from rl_async.loop.controller import Controller
from rl_async.observe.staleness import StalenessSplit, quantile, split_age
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config


def group(gid: str, versions: list[int]) -> Group:
    return Group(gid, [Sample(prompt_id=gid, prompt_ids=[1], response_ids=[2] * len(versions),
                              behavior_logprobs=[-1.0] * len(versions),
                              token_versions=versions)])


def test_the_buffer_stamps_the_trainer_version_and_the_split_adds_up():
    async def scenario():
        buf = CompletedBuffer(4, max_lag=None)
        buf.set_version(3)
        await buf.put(group("a", [1, 2]))      # generated at 1-2, inserted at trainer v3
        buf.set_version(5)
        await buf.put(group("b", [4]))         # inserted at v5
        return await buf.get(2, 7)
    a, b = asyncio.run(scenario())
    assert (a.version_at_insert, b.version_at_insert) == (3, 5)
    assert split_age(a) == (2, 4) and a.age_at_delivery == 6     # 3-1 in flight, 7-3 queued
    assert split_age(b) == (1, 2) and b.age_at_delivery == 3
    s = StalenessSplit()
    assert s.observe([a, b]) == {"rollout/staleness_inflight_mean": 1.5,
                                 "rollout/staleness_queue_mean": 3.0}
    d = s.to_dict()
    assert (d["inflight_mean"], d["queue_mean"], d["p99_delivered"]) == (1.5, 3.0, 6.0)


def test_quantile_of_a_histogram():
    from collections import Counter
    h = Counter({0: 98, 1: 1, 5: 1})
    assert quantile(h, 0.5) == 0 and quantile(h, 0.99) == 1 and quantile(h, 1.0) == 5


def test_a_run_summary_splits_its_mean_delivered_staleness():
    cfg = load_config("cluster_configs/local.toml", ["wandb.mode=disabled", "run.max_steps=6",
                                                     "eval.every_steps=0"])
    plan = plan_capacity(cfg)[0]
    logged = []
    summary = asyncio.run(Controller(cfg, plan, InProcessFleet(cfg, plan, Disk(), seed=1),
                                     lambda m, s: logged.append(m)).run())
    st = summary["staleness"]
    assert st["inflight_mean"] + st["queue_mean"] == pytest.approx(st["mean_delivered"])
    assert st["mean_delivered"] > 0  # the scenario makes old data to split
    rows = [m for m in logged if "rollout/staleness_queue_mean" in m]
    assert len(rows) == summary["steps"] // plan.optimizer_steps_per_collection
