"""The progress line's discard fraction is the run's so far, not the last logged row's (which
could be an evaluation or watchdog row without the key, showing 0, or one window's noise)."""

from __future__ import annotations

from inprocess_fleet import Disk, InProcessFleet

from rl_async.loop.controller import Controller
from rl_async.observe.queue_metrics import COMPLETED_QUEUE_PREFIX as Q
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config


def test_the_discard_fraction_accumulates_over_collections():
    cfg = load_config("cluster_configs/local.toml", ["wandb.mode=disabled"])
    plan = plan_capacity(cfg)[0]
    controller = Controller(cfg, plan, InProcessFleet(cfg, plan, Disk(), seed=0),
                            lambda m, s: None)
    for dropped, delivered in ((16, 48), (0, 64), (0, 0)):
        controller.progress.count_discards({Q + "dropped_samples": dropped,
                                    Q + "delivered_samples": delivered})
    assert controller.progress.discard_fraction == 16 / 128
    controller.progress.count_discards({"eval/reward": 0.5})  # a row without the counts: unchanged
    assert controller.progress.discard_fraction == 16 / 128
