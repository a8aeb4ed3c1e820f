"""async.health_control: off-policy diagnostics past a threshold make the controller publish
sooner, then lower the producer budget; healthy collections loosen it again; every decision
is a W&B row and a summary event (rl_async/loop/health.py)."""

from __future__ import annotations

import asyncio

from inprocess_fleet import Disk, InProcessFleet

from rl_async.loop.controller import Controller
from rl_async.loop.health import HealthControl, HealthThresholds
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config

SICK = {"train/kl_k3_trainer_rollout": 0.5, "train/tis_ess_ratio": 0.9}
WELL = {"train/kl_k3_trainer_rollout": 0.001, "train/logratio_over_ln2_fraction": 0.0,
        "train/tis_ess_ratio": 0.95}


def test_tighten_then_loosen_one_step_at_a_time():
    h = HealthControl(HealthThresholds(patience=2), every_updates=8, budget_groups=8,
                      floor_groups=2)
    acts = [d["action"] for step in range(6) for d in h.observe(SICK, step)]
    assert acts == ["publish_sooner"] * 3 + ["lower_budget"] * 2   # 8 -> 1, then 8 -> 2
    assert (h.current_every, h.current_budget) == (1, 2)
    assert h.events[0]["reason"].startswith("kl_k3_trainer_rollout 0.5 > 0.05")
    acts = [d["action"] for step in range(6, 18) for d in h.observe(WELL, step)]
    assert acts == ["raise_budget"] * 2 + ["publish_later"] * 3 + []  # budget first
    assert (h.current_every, h.current_budget) == (8, 8) and h.unhealthy == 6
    assert h.metrics([])["health/action"] == 0.0


def test_low_ess_and_many_far_tokens_are_unhealthy_too():
    t = HealthThresholds()
    assert t.breaches({"train/tis_ess_ratio": 0.2})
    assert t.breaches({"train/logratio_over_ln2_fraction": 0.2})
    assert not t.breaches(WELL) and not t.breaches({})


def test_the_controller_acts_and_records_every_decision():
    cfg = load_config("cluster_configs/local.toml", [
        "wandb.mode=disabled", "eval.every_steps=0", "run.max_steps=12",
        "async.max_weight_staleness=8", "publication.every_updates=4",
        "async.health_control=true", "async.health_patience=2"])
    plan = plan_capacity(cfg)[0]
    fleet = InProcessFleet(cfg, plan, Disk(), seed=4)
    calls, budgets = [], []

    async def train(groups, version):
        calls.append(version)
        return dict(SICK if len(calls) <= 4 else WELL)

    async def set_budget(groups):
        budgets.append(groups)
        fleet.producer.set_budget(groups)
    fleet.train, fleet.producer_set_budget = train, set_budget
    rows = []
    summary = asyncio.run(Controller(cfg, plan, fleet, lambda m, s: rows.append(m)).run())
    h = summary["health"]
    assert [e["action"] for e in h["events"]][:4] == ["publish_sooner", "publish_sooner",
                                                      "lower_budget", "lower_budget"]
    assert "raise_budget" in [e["action"] for e in h["events"]]
    assert budgets[:2] == [plan.producer_groups // 2, plan.producer_groups // 4]
    # publish_sooner took the interval 4 -> 1: from the second collection on, every one
    # publishes (none is skipped while the interval is 1)
    skipped = [m["publish/skipped"] for m in rows if "publish/skipped" in m]
    assert skipped[1:5] == [0.0] * 4
    codes = [m["health/action"] for m in rows if "health/action" in m]
    assert codes[:4] == [1.0, 1.0, 2.0, 2.0] and len(codes) == 12
