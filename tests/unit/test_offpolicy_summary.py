"""The run summary's `corrections` block: the off-policy diagnostics the trainer reports per
step, as mean / worst / last over the run, with the loss and mask that produced them."""

from __future__ import annotations

import asyncio

import pytest
from inprocess_fleet import Disk, InProcessFleet

from rl_async.loop.controller import Controller
from rl_async.observe.offpolicy import OffPolicyStats
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config


def test_stats_keep_mean_worst_and_last():
    s = OffPolicyStats("m2po", "icepop")
    s.observe({"train/kl_k3_trainer_rollout": 0.1, "train/tis_ess_ratio": 0.9})
    s.observe({"eval/reward": 1.0})  # a row without diagnostics counts for nothing
    s.observe({"train/kl_k3_trainer_rollout": 0.3, "train/tis_ess_ratio": 0.5})
    d = s.to_dict()
    assert d["policy_loss"] == "m2po" and d["is_mask"] == "icepop" and d["collections"] == 2
    assert d["kl_k3_trainer_rollout"] == pytest.approx({"mean": 0.2, "worst": 0.3, "last": 0.3})
    assert d["ess_ratio"] == pytest.approx({"mean": 0.7, "worst": 0.5, "last": 0.5})


def test_the_controller_summary_carries_the_diagnostics():
    cfg = load_config("cluster_configs/dev.toml", [
        "run.max_steps=3", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=4", "train.micro_batch_size=4", "sglang.max_running_requests=2",
        "wandb.mode=disabled", "train.policy_loss=cispo", "train.is_mask=geo_rs"])
    plan = plan_capacity(cfg)[0]
    fleet = InProcessFleet(cfg, plan, Disk(), seed=0)
    calls = []

    async def train(groups, version):
        calls.append(version)
        return {"train/masked_fraction_adv_neg": 0.1 * len(calls),
                "train/logratio_over_ln2_fraction": 0.02}
    fleet.train = train
    logged = []
    summary = asyncio.run(Controller(cfg, plan, fleet, lambda m, s: logged.append(m)).run())
    c = summary["corrections"]
    assert (c["policy_loss"], c["is_mask"], c["collections"]) == ("cispo", "geo_rs", 3)
    assert c["masked_fraction_adv_neg"] == pytest.approx({"mean": 0.2, "worst": 0.3, "last": 0.3})
    assert c["logratio_over_ln2_fraction"]["mean"] == pytest.approx(0.02)
    assert sum("train/masked_fraction_adv_neg" in m for m in logged) == 3  # W&B: every step
