"""Transactional publication under faults, on real actors (CPU, gloo), and the provenance
audit that proves it.

One run of the real controller over a real fleet of two embedded engines, with the audit
on every trained token (`run.audit_fraction = 1`, `run.deterministic`: tolerance 0). While
it trains, faults land on successive publications: an engine killed as it is about to
receive bucket 0, 1 and 2 of 3; one killed after its weights verified, before the switch;
a bucket corrupted on arrival; an engine wedged before a bucket, past the bucket deadline;
and both engines killed at once with the first replacement killed inside its catch-up. The
run must finish with nothing unaccounted, every restart counted, and no trained token whose
log-prob differs from a recomputation under the weights of the version it claims: no
response recorded under a version its engine had not committed, none from a half-updated
model.

Then the audit's negative control: an engine that keeps its prompt cache across weight
loads (stale KV) is caught within 10 collections, while the same run without the fault
audits clean."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from test_end_to_end import assert_ledger_closed, small

pytestmark = pytest.mark.ray

AUDITED = ["run.deterministic=true", "run.audit_fraction=1.0"]
FAULTS = [*AUDITED, "cluster.cpu_engines=2", "cluster.engine_cpus=0.5",
          "engine.max_restarts=20", "engine.health_check_interval_s=1",
          "engine.health_check_timeout_s=20", "publication.drain_timeout_s=5",
          "publication.channel_timeout_s=5", "publication.timeout_s=60",
          # three buckets of the tiny model: a death before each of them
          "publication.bucket_bytes=120000"]
GUARD_S = 120  # each fault must have landed, and the fleet healed, within this


async def _until(what: str, ready, run_task) -> None:
    deadline = time.monotonic() + GUARD_S
    while not ready():
        if run_task.done():
            run_task.result()  # the run's own error
            raise AssertionError(f"the run ended before {what}")
        assert time.monotonic() < deadline, f"{what}: not within {GUARD_S} s"
        await asyncio.sleep(0.2)


def test_faults_at_every_stage_of_a_publication_cost_engines_never_the_run(ray_cluster):
    from actors.fleet import RayFleet
    from rl_async.loop.controller import Controller

    cfg, report = small("cluster_configs/local.toml", *FAULTS, "run.max_steps=2000",
                        name="t-pub-faults")
    assert report.ok, report.errors

    async def main():
        fleet = RayFleet(cfg, report.plan)
        await fleet.start()
        assert len(fleet._metas) == 3, [m[3] for m in fleet._metas]
        controller = Controller(cfg, report.plan, fleet, lambda m, s: None)
        run_task = asyncio.ensure_future(controller.run())
        restarts = lambda: fleet.supervisor.restarts.restarts  # noqa: E731
        healthy = lambda: not fleet.down and not fleet.pending_up  # noqa: E731

        async def fault(engine: int, kind: str, bucket: int | None, landed) -> None:
            step = controller.progress.step
            await _until("the fleet healed", lambda: healthy() and
                         controller.progress.step >= step + 2, run_task)
            await fleet.engines[engine].debug_fault.remote(kind, bucket)
            await _until(f"{kind} {bucket} on engine-{engine}", landed, run_task)

        try:
            for n, (engine, kind, bucket) in enumerate([
                    (0, "die_at_bucket", 0), (1, "die_at_bucket", 1), (0, "die_at_bucket", 2),
                    (1, "die_before_commit", None), (1, "stall_at_bucket", 1)]):
                await fault(engine, kind, bucket, lambda n=n: restarts() == n + 1)
            unverified = lambda: any("not verified" in f["cause"]  # noqa: E731
                                     for f in fleet.fault_log)
            await fault(0, "corrupt_bucket", 1, unverified)
            assert restarts() == 5  # a corrupted transfer costs no restart

            # Both engines at once: nothing can generate, so the replacements are caught up
            # with the published snapshot; the first one dies inside that catch-up.
            start_engine = fleet.start_engine

            def armed(i):
                actor = start_engine(i)
                if i == 0 and fleet.incarnations.get(0, 0) == 2:  # its first replacement
                    actor.debug_fault.remote("die_at_bucket", 1)
                return actor

            fleet.start_engine = armed
            step = controller.progress.step
            await _until("the fleet healed", healthy, run_task)
            for i in (0, 1):
                os.kill((await fleet.engines[i].health.remote())["pid"], signal.SIGKILL)
            await _until("the catch-up and its fault", lambda: restarts() == 8 and healthy()
                         and controller.progress.step >= step + 2, run_task)
            controller.stop_requested = True
            summary = await asyncio.wait_for(run_task, 300)
        finally:
            await fleet.shutdown()
        return summary, fleet.fault_log

    summary, fault_log = asyncio.run(main())
    assert_ledger_closed(summary)
    assert summary["faults"]["engine_restarts"] == 8, fault_log
    # the six faults that hit publications, each an engine that did not commit that version
    assert summary["publication"]["aborted_transfers"] >= 6, summary["publication"]
    audit = summary["provenance"]
    assert audit["audited_tokens"] > 500 and audit["unverifiable_tokens"] == 0, audit
    assert audit["mismatches"] == 0 and audit["max_abs_diff"] == 0.0, audit


@pytest.mark.parametrize("stale_cache", [False, True])
def test_the_audit_catches_a_prompt_cache_kept_across_weight_loads(ray_cluster, tmp_path,
                                                                   stale_cache):
    from actors.controller import ControllerActor

    name = f"t-audit-{stale_cache}"
    cfg, report = small("cluster_configs/local.toml", *AUDITED, "run.max_steps=10",
                        f"run.output_dir={tmp_path}", name=name)
    controller = ControllerActor.remote(cfg, report.plan, [])
    ref = controller.run.remote()
    if stale_cache:
        deadline = time.monotonic() + GUARD_S
        while True:  # as soon as the engine exists: before the first collection's publication
            try:
                ray.get(ray.get_actor(f"{name}/engine-0").debug_fault.remote(
                    "keep_prompt_cache"), timeout=10)
                break
            except (ValueError, ray.exceptions.GetTimeoutError):  # not created, or busy
                assert time.monotonic() < deadline, "engine-0 never answered"  # starting
                time.sleep(0.1)
    summary = ray.get(ref, timeout=600)
    ray.kill(controller)
    assert summary["steps"] == 10
    assert_ledger_closed(summary)
    audit = summary["provenance"]
    assert audit["audited_tokens"] > 0, audit
    if stale_cache:
        assert audit["mismatches"] > 0 and audit["max_abs_diff"] > 0, audit
    else:
        assert audit["mismatches"] == 0 and audit["max_abs_diff"] == 0.0, audit


@pytest.mark.parametrize("relay", ["chain", "off"])
def test_the_relay_sends_once_and_a_dead_forwarders_followers_get_a_direct_send(
        ray_cluster, relay):
    """Three engines in a chain: rank 0 sends each publication once (off: three times) and
    every engine holds exactly the snapshot. Engine 1, the middle of the chain, dies as it
    receives bucket 2: it is lost and restarted, engine 2 falls back to a direct send and
    still commits that version."""
    from actors.fleet import RayFleet
    from rl_async.loop.publish import Publisher

    cfg, report = small("cluster_configs/local.toml", "cluster.cpu_engines=3",
                        "cluster.engine_cpus=0.5", "publication.verify_checksum=true",
                        "publication.drain_timeout_s=5", "publication.channel_timeout_s=5",
                        "publication.timeout_s=60", "publication.bucket_bytes=120000",
                        f"publication.relay={relay}", name=f"t-relay-{relay}")
    publisher = Publisher("off", cfg.publication.drain_timeout_s, cfg.publication.timeout_s)

    async def main():
        fleet = RayFleet(cfg, report.plan)
        try:
            await fleet.start()
            nbytes = sum(m[3] for m in fleet._metas)
            before = await fleet.trainers[0].publication_bytes_sent.remote()
            await publisher.transfer(1, fleet)  # verify_checksum: each holds the snapshot
            sent = await fleet.trainers[0].publication_bytes_sent.remote() - before
            assert sent == nbytes * (1 if relay == "chain" else 3)
            await fleet.engines[1].debug_fault.remote("die_at_bucket", 1)
            await publisher.transfer(2, fleet)
            assert [fleet.committed.get(i) for i in range(3)] == [2, 1, 2] or 1 in fleet.down
            versions = [await fleet.engines[i].get_weight_version.remote() for i in (0, 2)]
            assert versions == [2, 2]
            assert "engine" in fleet.fault_log[0] and fleet.fault_log[0]["engine"] == 1
        finally:
            await fleet.shutdown()

    asyncio.run(main())
