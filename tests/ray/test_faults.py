"""Chaos on real actors (CPU): an engine SIGKILLed mid-run costs a restart, not the run; past
the restart budget the run fails fast naming the engine; failing rewards stop the run on
their own; a hung engine is caught by the health check."""

import json
import os
import signal
import time

import pytest
import ray

from launch.run import run_training
from test_end_to_end import assert_ledger_closed, small

pytestmark = pytest.mark.ray

FT = ["engine.health_check_interval_s=1", "engine.health_check_timeout_s=10",
      "cluster.cpu_engines=2", "cluster.engine_cpus=0.5",
      # a bucket stuck on a hung engine's channel errors after channel_timeout_s; that
      # engine is dropped, the others' transfers go on
      "publication.drain_timeout_s=5", "publication.channel_timeout_s=15",
      "publication.timeout_s=45"]


def start(cfg, report):
    from actors.controller import ControllerActor

    controller = ControllerActor.remote(cfg, report.plan, [])
    return controller, controller.run.remote()


def wait_for_step(controller, step, timeout=180, run_ref=None):
    """Until the run reaches `step`; a run that ended first (failed) raises its error."""
    deadline = time.monotonic() + timeout
    while ray.get(controller.progress.remote()).get("step", 0) < step:
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        if run_ref is not None and ray.wait([run_ref], timeout=0)[0]:
            ray.get(run_ref)  # raises the run's error
            raise AssertionError(f"the run ended before step {step}")
        time.sleep(0.3)


def engine_pid(name, i):
    return ray.get(ray.get_actor(f"{name}/engine-{i}").health.remote())["pid"]


# One engine: the local demo's shape, where nothing else can generate meanwhile; two: the
# survivor keeps generating. The kill lands wherever the run is (in a transfer or not); the
# deterministic placements are test_killed_engine_is_replaced_and_the_next_transfers_...
def rejoined(name: str, killed_pid: int, timeout: float = 180):
    """engine-0's replacement: a new process that has finished requests; its handle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            engine = ray.get_actor(f"{name}/engine-0")
            if (ray.get(engine.health.remote(), timeout=10)["pid"] != killed_pid
                    and ray.get(engine.load.remote(), timeout=10)["extra"]["finished"] > 0):
                return engine
        except Exception:  # noqa: BLE001 -- not there yet (being replaced)
            pass
        time.sleep(0.5)
    raise AssertionError(f"engine-0's replacement never served a request in {timeout} s")


@pytest.mark.parametrize("engines", [1, 2])
def test_sigkilled_engine_is_restarted_and_the_run_finishes(ray_cluster, tmp_path, engines):
    name = f"t-ft-kill{engines}"
    # long enough that the run is still going when the replacement has rejoined; it is then
    # asked to stop (a graceful stop: drain, evaluate, summary)
    cfg, report = small("cluster_configs/local.toml", *FT, "run.max_steps=2000",
                        f"cluster.cpu_engines={engines}", name=name)
    controller, ref = start(cfg, report)
    wait_for_step(controller, 2)
    killed = engine_pid(name, 0)
    os.kill(killed, signal.SIGKILL)  # the OOM killer's way
    replacement = rejoined(name, killed)
    # ... and serves the current policy: it got the weights the run published meanwhile
    version = ray.get(replacement.get_weight_version.remote())
    assert version >= ray.get(controller.progress.remote())["version"] - 1 > 0
    controller.request_stop.remote()
    summary = ray.get(ref, timeout=300)
    assert 2 < summary["steps"] < 2000
    assert_ledger_closed(summary)
    faults = summary["faults"]
    assert faults["engine_restarts"] == 1, faults
    assert faults["engine_failures"][0]["engine"] == 0
    assert "died" in faults["engine_failures"][0]["cause"]
    ray.kill(controller)


@pytest.mark.parametrize("engines", [1, 2])
@pytest.mark.parametrize("when", ["inside_a_transfer", "between_transfers"])
def test_killed_engine_is_replaced_and_the_next_transfers_reach_everyone(ray_cluster, when,
                                                                          engines):
    """inside_a_transfer (deterministic): engine-0 SIGKILLs itself at the start of its
    receive, while trainer rank 0 (and the other engine) are inside the broadcast; that
    publication still completes without it (each engine has its own channel). between_
    transfers: no publication runs while it is down, and its replacement forms a new
    channel and is caught up before it serves. Either way the replacement then gets every
    later publication's weights."""
    import asyncio

    from actors.fleet import RayFleet
    from rl_async.loop.publish import Publisher

    cfg, report = small("cluster_configs/local.toml", *FT, f"cluster.cpu_engines={engines}",
                        "publication.verify_checksum=true", name=f"t-ft-{when}{engines}")
    publisher = Publisher("off", cfg.publication.drain_timeout_s, cfg.publication.timeout_s)

    async def replaced(fleet, victim):
        deadline = time.monotonic() + 180
        while fleet.engines[0] is victim or 0 in fleet.down:
            assert time.monotonic() < deadline, f"engine-0 never replaced: {fleet.fault_log}"
            await asyncio.sleep(0.2)

    async def main():
        fleet = RayFleet(cfg, report.plan)
        try:
            await fleet.start()  # version 0 everywhere; the supervisor is running
            victim = fleet.engines[0]
            if when == "inside_a_transfer":
                await victim.debug_die_in_transfer.remote()
                await publisher.transfer(1, fleet)  # under publication.timeout_s
            else:
                os.kill((await victim.health.remote())["pid"], signal.SIGKILL)
            await replaced(fleet, victim)
            # The next publication reaches everyone (verify_checksum: every engine holds
            # exactly the trainer's snapshot); a lone replacement was caught up already.
            await publisher.transfer(2, fleet)
            assert not fleet.pending_up and not fleet.down
            versions = [await e.get_weight_version.remote() for e in fleet.engines]
            assert versions == [2] * engines
            assert fleet.supervisor.fatal is None and fleet.supervisor.restarts.restarts == 1
            [failure] = fleet.fault_log
            assert failure["engine"] == 0 and "died" in failure["cause"], failure
        finally:
            await fleet.shutdown()

    asyncio.run(main())


def test_engine_deaths_past_the_budget_fail_the_run_within_60s(ray_cluster):
    name = "t-ft-budget"
    cfg, report = small("cluster_configs/local.toml", *FT, "engine.max_restarts=0",
                        "run.max_steps=1000", name=name)
    controller, ref = start(cfg, report)
    wait_for_step(controller, 2)
    os.kill(engine_pid(name, 1), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayTaskError) as exc:
        ray.get(ref, timeout=60)
    # (ray.get above has the 60 s deadline: a run that did not fail in time raised there)
    message = str(exc.value)
    assert "engine-1" in message and "engine.max_restarts = 0" in message, message[-1500:]
    partial = ray.get(controller.failure_summary.remote())
    assert partial["ledger"]["unaccounted"] == 0
    ray.kill(controller)


def test_failing_rewards_stop_the_run_naming_the_cause(ray_cluster, tmp_path):
    # goes_down counts its calls in a module global: one process for every call (thread)
    cfg, report = small("cluster_configs/local.toml", "reward.function=chaos_rewards:goes_down",
                        "reward.isolation=thread", "run.max_steps=1000", "reward.max_retries=1",
                        name="t-ft-reward")
    out = tmp_path / "summary.json"
    started = time.monotonic()
    assert run_training(cfg, report, str(out)) == 1
    assert time.monotonic() - started < 120  # stops on its own, quickly
    summary = json.loads(out.read_text())
    error = summary["error"]
    assert "groups failed" in error and "run.max_failed_group_fraction" in error, error
    assert "judge service unavailable: connection refused (chaos)" in error  # quoted
    assert summary["ledger"]["failed_groups"] > 50 and summary["ledger"]["unaccounted"] == 0


def test_hung_engine_is_caught_by_the_health_check(ray_cluster):
    name = "t-ft-hang"
    cfg, report = small("cluster_configs/local.toml", *FT, "run.max_steps=8", name=name)
    controller, ref = start(cfg, report)
    wait_for_step(controller, 2)
    ray.get_actor(f"{name}/engine-0").debug_block.remote(600)  # alive, answers nothing
    summary = ray.get(ref, timeout=300)
    assert summary["steps"] == 8
    assert_ledger_closed(summary)
    [failure] = summary["faults"]["engine_failures"]
    assert failure["engine"] == 0 and "no answer to its health probe" in failure["cause"]
    ray.kill(controller)
