"""Real actors with `engine.backend = "sglang"`: SGLangEngine launches, per engine, the test
double of an SGLang server (tests/fake_sglang_server.py: SGLang's HTTP API and rules over a
real tiny model), so the whole SGLang path runs on CPU: launch, health, generate, pause and
continue, per-engine publication channels over gloo, restarts.

What a GPU run dies of first, rehearsed here: the process that dies is the SERVER behind a
live engine actor (OOM killer, CUDA fault), and every call to it fails with an EngineError,
not a dead-actor error."""

import os
import signal
import time

import pytest
import ray

from test_end_to_end import assert_ledger_closed, small
from test_faults import FT, start, wait_for_step

pytestmark = pytest.mark.ray

LOCAL = "cluster_configs/local.toml"


@pytest.fixture(scope="module")
def sglang_file(tmp_path_factory):
    """local.toml with its tiny model saved to disk (an SGLang server loads model.path)."""
    import tomllib

    from rl_async.state.models import build_causal_lm

    text = open(LOCAL).read()
    hf_config = tomllib.loads(text)["model"]["hf_config"]
    directory = tmp_path_factory.mktemp("sglang-tiny")
    build_causal_lm(hf_config, seed=0).save_pretrained(directory)
    lines = [f'path = "{directory}"' if line.startswith("hf_config =") else line
             for line in text.splitlines()]
    path = directory / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


SGLANG = ["engine.backend=sglang", "sglang.launch_module=fake_sglang_server",
          "sglang.port_base=0", "sglang.startup_timeout_s=120", "cluster.engine_cpus=0.5"]


def test_a_server_killed_behind_a_live_engine_actor_costs_a_restart_not_the_run(
        ray_cluster, sglang_file):
    name = "t-sgl-server-kill"
    cfg, report = small(sglang_file, *SGLANG, *FT, "cluster.cpu_engines=2",
                        "run.max_steps=30", name=name)
    assert report.ok, report.errors
    assert [w.code for w in report.warnings].count("SGLANG_ON_CPU") == 1
    controller, ref = start(cfg, report)
    wait_for_step(controller, 2, run_ref=ref)
    health = ray.get(ray.get_actor(f"{name}/engine-0").health.remote())
    actor_pid, server_pid = health["pid"], health["server_pid"]
    os.killpg(server_pid, signal.SIGKILL)  # the server, not the actor
    summary = ray.get(ref, timeout=300)
    assert summary["steps"] == 30
    assert_ledger_closed(summary)
    faults = summary["faults"]
    assert faults["engine_restarts"] == 1, faults
    [failure] = faults["engine_failures"]
    assert failure["engine"] == 0, failure
    # the actor was alive: the cause is the server's (a failed call or probe), not a death
    assert "the actor died" not in failure["cause"], failure
    assert actor_pid  # the actor itself was killed only by the restart that replaced it
    ray.kill(controller)


def test_mixed_policy_over_sglang_refreshes_requests_and_never_flushes_a_retracted_server(
        ray_cluster, sglang_file, tmp_path):
    """The last bucket carries flush_cache=False under mixed_policy: the double exits, as
    SGLang's scheduler does, if a flush is asked while retracted requests wait. Requests
    cross publications (rebuilt under new weights), which the summary must show."""
    name = "t-sgl-mixed"
    cfg, report = small(sglang_file, *SGLANG, "refresh.mode=mixed_policy",
                        "engine.fault_tolerance=false", "rollout.max_response_len=24",
                        "run.max_steps=6", name=name)
    assert report.ok, report.errors
    controller, ref = start(cfg, report)
    summary = ray.get(ref, timeout=300)
    assert summary["steps"] == 6 and summary["policy_version"] == 6
    assert_ledger_closed(summary)
    assert summary["ledger"]["aborted_groups"] == 0  # nothing aborted for an update
    assert summary["faults"]["refreshed_requests"] > 0, summary["faults"]
    ray.kill(controller)


def test_routing_replay_over_sglang_replays_the_servers_experts(ray_cluster, tmp_path):
    """The MoE demo's tiny Qwen3-MoE served by the double: the engine launches it with
    --enable-return-routed-experts, asks every request for its routes, and the trainer
    replays them (on-policy tokens score as the server sampled them)."""
    import tomllib

    from rl_async.state.models import build_causal_lm

    text = open("cluster_configs/qwen3_moe.toml").read()
    build_causal_lm(tomllib.loads(text)["model"]["hf_config"], seed=0).save_pretrained(tmp_path)
    lines = [f'path = "{tmp_path}"' if line.startswith("hf_config =") else line
             for line in text.splitlines() if not line.startswith("init_seed")]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    cfg, report = small(str(tmp_path / "run.toml"), *SGLANG, "run.max_steps=4",
                        name="t-sgl-r3")
    assert report.ok, report.errors
    controller, ref = start(cfg, report)
    summary = ray.get(ref, timeout=300)
    assert summary["steps"] == 4
    assert_ledger_closed(summary)
    routing = summary["routing"]
    assert routing["replay"] and routing["unreplayed_tokens"] == 0, routing
    assert routing["replayed_tokens"] > 0 and routing["logprob_mismatch_replay"] < 1e-4, routing
    ray.kill(controller)


def test_each_engine_listens_on_its_own_channel_and_superseded_channels_are_destroyed(
        ray_cluster):
    """A replacement gets a channel of its own; the dead engine's channel is destroyed on
    trainer rank 0; every engine receives on exactly the channel the trainer sends it on."""
    import asyncio

    from actors.fleet import RayFleet
    from rl_async.loop.publish import Publisher

    cfg, report = small(LOCAL, *FT, "cluster.cpu_engines=2", "publication.verify_checksum=true",
                        "publication.relay=off",  # direct channels (relay: test_publication_faults)
                        name="t-channels")
    publisher = Publisher("off", cfg.publication.drain_timeout_s, cfg.publication.timeout_s)

    async def channels_agree(fleet):
        trainer = await fleet.trainers[0].channels.remote()
        engines = [await e.weight_update_groups.remote() for e in fleet.engines]
        assert trainer == sorted(name for name, _ in fleet.channels.values())
        assert engines == [[fleet.channels[i][0]] for i in range(len(fleet.engines))]
        return trainer

    async def main():
        fleet = RayFleet(cfg, report.plan)
        try:
            await fleet.start()
            before = await channels_agree(fleet)
            victim = fleet.engines[0]
            os.kill((await victim.health.remote())["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 180
            while fleet.engines[0] is victim or 0 in fleet.down:
                assert time.monotonic() < deadline, fleet.fault_log
                await asyncio.sleep(0.2)
            await publisher.transfer(1, fleet)
            after = await channels_agree(fleet)
            assert before[0] not in after and before[1] in after  # engine-1 kept its own
            assert "/engine-0/n1/" in fleet.channels[0][0]  # the replacement's incarnation
            assert [await e.get_weight_version.remote() for e in fleet.engines] == [1, 1]
        finally:
            await fleet.shutdown()

    asyncio.run(main())
