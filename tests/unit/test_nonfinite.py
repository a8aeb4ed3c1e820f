"""Non-finite training stops instead of going on wrong: an update whose gradient norm is NaN
(injected through a NaN behaviour log-prob) is skipped and counted, weights and schedule unchanged;
more than train.max_nonfinite_updates in a row stop the run naming the step and the
quantity; NaN metrics are logged as NaN, not dropped; NaN weights are never published or
exported."""

from __future__ import annotations

import math

import pytest
import torch

from rl_async.observe.metrics import MemorySink, MetricsLogger
from rl_async.state.weights import NonFiniteWeights
from rl_async.train.guard import NonFiniteTraining
from test_torch_trainer import make, make_groups, params


def poisoned(groups):
    """A NaN behaviour log-prob (rewards are refused earlier): its TIS weight, the loss and
    the gradients turn NaN, as a bf16 overflow or a runaway learning rate would make them."""
    sample = groups[0].samples[0]
    sample.behavior_logprobs = [float("nan")] * len(sample.behavior_logprobs)
    return groups


def test_a_nonfinite_update_is_skipped_and_counted_and_a_run_of_them_stops_it():
    trainer = make(max_nonfinite_updates=2)
    before = params(trainer)
    metrics = trainer.train_collection(poisoned(make_groups(seed=1)), 1)
    assert metrics["train/nonfinite_updates"] == 1 and math.isnan(metrics["train/loss"])
    assert math.isnan(metrics["train/grad_norm"])
    after = params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing moved
    assert trainer.step == 0
    trainer.train_collection(make_groups(seed=2), 2)  # a finite one resets the count
    assert trainer.step == 1
    trainer.train_collection(poisoned(make_groups(seed=3)), 3)
    trainer.train_collection(poisoned(make_groups(seed=4)), 4)
    with pytest.raises(NonFiniteTraining, match=r"optimizer step 1: non-finite loss \(nan\) "
                                                r"in 3 updates in a row.*max_nonfinite_updates = 2"):
        trainer.train_collection(poisoned(make_groups(seed=5)), 5)


def test_nan_metrics_are_logged_as_nan_not_dropped():
    sink = MemorySink()
    MetricsLogger([sink]).log({"train/loss": float("nan"), "train/grad_norm": float("inf"),
                               "rollout/reward": 0.5}, step=3)
    [(step, row)] = sink.rows
    assert step == 3 and math.isnan(row["train/loss"]) and row["train/grad_norm"] == math.inf


def test_nan_weights_are_never_published_or_exported(tmp_path):
    from rl_async.state.hf_export import export_hf
    from rl_async.state.sender import PublicationSender
    from test_torch_trainer import TINY

    trainer = make()
    named = list(trainer.named_tensors_for_publication())
    named[3] = (named[3][0], named[3][1].clone().fill_(float("nan")))
    with pytest.raises(NonFiniteWeights, match=rf"publication snapshot: weight {named[3][0]!r}"):
        PublicationSender("gloo").stage(named, torch.float32, 1 << 20, flat=True)
    with pytest.raises(NonFiniteWeights, match="Hugging Face export"):
        export_hf(named, tmp_path / "hf", hf_config=TINY)
    assert not (tmp_path / "hf").exists()


@pytest.mark.megatron
def test_megatron_skips_a_nonfinite_update(megatron_cpu):
    from test_megatron_resume_and_memory import trainer as megatron_trainer
    from test_megatron_trainer import groups, run_config

    meg = megatron_trainer(run_config())
    before = {k: v.clone() for k, v in meg.named_tensors_for_publication()}
    bad = groups(11, 1)
    for g in bad:
        poisoned([g])
    metrics = meg.train_collection(bad, 1)
    assert metrics["train/nonfinite_updates"] == 2  # both optimizer steps of the collection
    assert meg.step == 0
    after = dict(meg.named_tensors_for_publication())
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_update_megatron_skips_itself_is_not_counted_as_taken(megatron_cpu):
    """optimizer.step() answers ok = False when megatron skips the update on its own (an fp16
    grad scaler's found_inf): the step, the lr schedule and the guard must not count it."""
    from test_megatron_resume_and_memory import trainer as megatron_trainer
    from test_megatron_trainer import groups, run_config

    meg = megatron_trainer(run_config())
    meg.optimizer.step = lambda: (False, 0.0, None)  # what megatron returns when it skips
    metrics = meg.train_collection(groups(11, 1), 1)
    assert metrics["train/nonfinite_updates"] == 2 and meg.step == 0
    assert meg.guard.skipped == 2


from megatron_cpu_shims import megatron_cpu  # noqa: E402,F401  (fixture)


def test_a_skipped_update_is_marked_in_the_trained_log_and_not_counted_as_trained():
    """A non-finite update reached no weights: its collection's line in trained.jsonl says so
    (`skipped_updates`), and throughput.trained_samples leaves its samples out."""
    import asyncio

    from inprocess_fleet import Disk, InProcessFleet

    from rl_async.loop.controller import Controller
    from rl_async.plan.capacity import plan_capacity
    from rl_async.plan.load import load_config

    cfg = load_config("cluster_configs/dev.toml", [
        "run.max_steps=3", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=4", "train.micro_batch_size=4", "sglang.max_running_requests=2",
        "wandb.mode=disabled"])
    plan = plan_capacity(cfg)[0]
    disk = Disk()
    fleet = InProcessFleet(cfg, plan, disk, seed=0)
    calls = []

    async def train(groups, version):
        calls.append(version)
        return {"train/nonfinite_updates": 1.0} if len(calls) == 2 else {}
    fleet.train = train
    summary = asyncio.run(Controller(cfg, plan, fleet, lambda m, s: None).run())
    assert [i.get("skipped_updates", 0) for i in disk.info] == [0, 1, 0]
    assert summary["throughput"]["trained_samples"] == 2 * 4
    assert summary["faults"]["nonfinite_updates"] == 1
