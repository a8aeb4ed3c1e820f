"""Actor wiring on the shared local cluster: short async and sync runs, publication, death."""

import asyncio
import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config

pytestmark = pytest.mark.ray

SMALL = ["run.max_steps=4", "wandb.mode=disabled", "rollout.rollout_batch_size=4",
         "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=16", "task.num_eval_prompts=8", "sglang.max_running_requests=8",
         # every run ends with a checkpoint (and its export): keep them out of the repo
         f"run.output_dir={tempfile.mkdtemp(prefix='rl-async-e2e-')}"]


def small(path, *extra, name):
    cfg = load_config(path, [*SMALL, f"run.name={name}", *extra])
    return cfg, validate(cfg)


def run(cfg, report, tmp_path):
    out = tmp_path / "summary.json"
    code = run_training(cfg, report, str(out))
    return code, json.loads(out.read_text())


def assert_ledger_closed(summary):
    ledger = summary["ledger"]
    assert ledger["unaccounted"] == 0
    others = sum(v for k, v in ledger.items() if k not in ("submitted_groups", "unaccounted"))
    assert ledger["submitted_groups"] == others > 0


def test_short_async_run_accounts_for_everything(ray_cluster, tmp_path):
    # eval.every_steps=2 + eval.drain: one evaluation with a lifecycle drain mid-run.
    # verify_checksum with lag 2: publication overlaps the next step, so engines must match
    # the snapshot that was sent, not the trainer's weights that have moved on since.
    cfg, report = small("cluster_configs/local.toml", "async.max_weight_staleness=2",
                        "eval.every_steps=2", "eval.drain=true", "run.checkpoint_every=2",
                        "publication.verify_checksum=true", "eval.n_samples=2",
                        f"run.output_dir={tmp_path}", name="t-async")
    code, summary = run(cfg, report, tmp_path)
    assert code == 0, summary
    assert summary["steps"] == 4 and summary["policy_version"] == 4
    assert_ledger_closed(summary)
    assert summary["ledger"]["delivered_groups"] == 4 * 4
    # Staleness never exceeds the lag in delivered groups.
    assert summary["staleness"]["max_delivered"] <= 2
    assert 0 <= summary["eval"]["initial_reward"] <= 1
    assert 0 <= summary["eval"]["mean@2"] <= summary["eval"]["pass@2"] <= 1
    # The eval curve: initial, the mid-run drain at step 2, final; wall time increasing.
    curve = summary["eval"]["curve"]
    assert [c[0] for c in curve] == [0, 2, 4]
    assert curve[0][1] < curve[1][1] < curve[2][1] and curve[-1][2] == summary["eval"]["final_reward"]
    run_dir = tmp_path / "t-async" / Path(summary["run_dir"]).name
    # every run leaves its summary in its run directory, --summary-json or not
    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text()) == summary
    assert summary["export_dir"] == str(run_dir / "step_000004" / "hf")
    # Checkpoints at steps 2 and 4 hold the trainer state, the ledger and the export.
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000002", "step_000004"]
    # the thread balancer's record (4 short updates: it may not have decided yet)
    assert summary["threads"]["planned"] == {"engine": 1, "trainer": 1}
    assert summary["threads"]["state"] in ("measuring", "trial", "settled")
    assert (run_dir / "step_000002" / "meta.json").is_file()
    assert (run_dir / "step_000002" / "hf" / "config.json").is_file()


def test_short_sync_run_is_on_policy(ray_cluster, tmp_path):
    # bf16 engines: the trainer keeps fp32 masters, publishes bf16, and the checksum is
    # compared in the engines' dtype.
    cfg, report = small("cluster_configs/dev.toml", "model.dtype=bfloat16",
                        "publication.verify_checksum=true", name="t-sync")
    assert not cfg.fully_async
    code, summary = run(cfg, report, tmp_path)
    assert code == 0, summary
    assert_ledger_closed(summary)
    assert summary["staleness"]["max_delivered"] == 0
    # Synchronous: exactly one collection generated per update, nothing left over.
    assert summary["ledger"]["buffered_groups"] == 0
    assert summary["ledger"]["submitted_groups"] == summary["ledger"]["delivered_groups"] == 16


def test_publication_makes_engine_weights_equal_trainer_weights(ray_cluster):
    from actors.fleet import RayFleet

    cfg, report = small("cluster_configs/local.toml", "cluster.cpu_engines=2",
                        "cluster.engine_cpus=0.5", name="t-publish")

    async def main():
        fleet = RayFleet(cfg, report.plan)
        try:
            await fleet.start()
            producer = await fleet.producer_task()
            groups = await fleet.get_groups(4, 0)
            for g in groups:  # distinct rewards: nonzero advantages, so training moves weights
                for i, sample in enumerate(g.samples):
                    sample.reward = float(i % 2)
            await fleet.train(groups, 0)
            before = await fleet.engines[0].named_weights.remote()
            trainer = dict(await fleet.trainers[0].named_weights.remote())
            assert any(not torch.equal(t, trainer[n]) for n, t in before)  # training moved it
            await fleet.stop_submissions()
            await fleet.drain(30)
            sent = await fleet.transfer(1)
            await fleet.resume_submissions()
            assert sent > 0
            for engine in fleet.engines:
                got = dict(await engine.named_weights.remote())
                assert got.keys() == trainer.keys()
                assert all(torch.equal(got[n], trainer[n]) for n in trainer)
                assert await engine.get_weight_version.remote() == 1
            await fleet.producer_stop()
            producer.cancel()
        finally:
            await fleet.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("victim,named", [("engine-0", "engine"), ("reward", "reward"),
                                           ("completed-buffer", "buffer")])
def test_killing_an_actor_mid_run_ends_in_a_clear_error(ray_cluster, victim, named):
    # the built-in verifier scores inside the producer; placement=actor runs the reward actor
    import ray

    from actors.controller import ControllerActor

    name = f"t-kill-{victim}"
    # Engines are restarted under fault tolerance (tests/ray/test_faults.py); without it a
    # dead engine ends the run like any other actor.
    cfg, report = small("cluster_configs/local.toml", "run.max_steps=1000",
                        "engine.fault_tolerance=false", "reward.placement=actor", name=name)
    controller = ControllerActor.remote(cfg, report.plan, [])
    ref = controller.run.remote()
    deadline = time.monotonic() + 120
    while ray.get(controller.progress.remote()).get("step", 0) < 2:
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.5)
    ray.kill(ray.get_actor(f"{name}/{victim}"))
    with pytest.raises(ray.exceptions.RayTaskError) as exc:
        ray.get(ref, timeout=60)
    # (ray.get above has the 60 s deadline: a run that did not fail in time raised there)
    message = str(exc.value).lower()
    assert named in message and "died" in message, message[-2000:]
    partial = ray.get(controller.failure_summary.remote())
    assert partial["error"] and partial["run_dir"]  # the driver writes its summary.json there
    assert partial["ledger"]["unaccounted"] == 0  # the ledger lives in the prompt source
    ray.kill(controller)


def test_mixed_policy_refresh_run_loses_nothing(ray_cluster, tmp_path):
    cfg, report = small("cluster_configs/local.toml", "refresh.mode=mixed_policy",
                        "rollout.max_response_len=12", "run.max_steps=3", name="t-refresh")
    assert report.ok, report.errors
    code, summary = run(cfg, report, tmp_path)
    assert code == 0, summary
    assert_ledger_closed(summary)
    # In-flight requests survive publications: nothing is aborted for an update, and some
    # did cross one (without that, the two lines above would hold for any mode)
    assert summary["ledger"]["aborted_groups"] == 0
    assert summary["faults"]["refreshed_requests"] > 0, summary["faults"]


def test_set_threads_reaches_the_threads_that_compute(ray_cluster):
    # torch's thread count is per calling thread: the engine's forward runs in a worker
    # thread, the trainer's in Ray's task thread; both report what they really ran with.
    from actors.fleet import RayFleet

    cfg, report = small("cluster_configs/local.toml", name="t-threads")

    async def main():
        fleet = RayFleet(cfg, report.plan)
        try:
            await fleet.start()
            producer = await fleet.producer_task()
            first = await fleet.train(await fleet.get_groups(4, 0), 0)
            assert first["trainer/threads"] == 1.0
            assert (await fleet.metrics())["engine/0/threads"] == 1.0
            # cluster.cpu_allocator = reuse (the default) reached both processes (glibc here)
            assert first["trainer/memory_reused"] == 1.0
            metrics = await fleet.metrics()
            assert metrics["engine/0/memory_reused"] == 1.0
            # each process's own resident memory (torch alone is over 100 MB resident)
            assert first["trainer/rss_bytes"] > 100e6 and metrics["engine/0/rss_bytes"] > 100e6
            await fleet.set_threads(2, 2)
            await fleet.evaluate()  # engine steps after the change
            assert (await fleet.metrics())["engine/0/threads"] == 2.0
            second = await fleet.train(await fleet.get_groups(4, 0), 0)
            assert second["trainer/threads"] == 2.0
            assert second["trainer/cpu_seconds"] > first["trainer/cpu_seconds"] > 0
            await fleet.producer_stop()
            producer.cancel()
        finally:
            await fleet.shutdown()

    asyncio.run(main())


def test_counting_task_responses_run_to_each_prompts_own_budget(ray_cluster, tmp_path):
    """task.count_tokens on real actors: each request carries its prompt's budget (the
    engine stops there, not at rollout.max_response_len), the verifier counts, and the
    ledger closes; what was trained is read back from the recorded collections."""
    from rl_async.algo.successor import successor_reward
    from rl_async.state.rollouts import read_collection

    cfg, report = small("cluster_configs/local.toml", "task.count_tokens=12",
                        "rollout.max_response_len=16", "run.record_rollouts=true",
                        f"run.output_dir={tmp_path}",
                        name="t-count")
    assert report.ok, report.errors
    code, summary = run(cfg, report, tmp_path)
    assert code == 0, summary
    assert_ledger_closed(summary)
    samples = [s for step in (1, 2, 3, 4)
               for g in read_collection(summary["run_dir"], step)[1] for s in g.samples]
    assert len(samples) == 4 * 16
    for s in samples:  # its own budget, or shorter only when it sampled the stop token
        n = s.metadata["count"]
        assert len(s.response_ids) == n or (len(s.response_ids) < n and s.finish_reason == "stop")
        assert s.reward == successor_reward(s)
    assert len({len(s.response_ids) for s in samples}) > 3  # lengths vary by prompt
    assert summary["calibration"]["response_length"]["max"] <= 12
