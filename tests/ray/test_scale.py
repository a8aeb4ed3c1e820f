"""An elastic fleet on real actors (actors/fleet_scale.py, `rl-async scale`): a running run
grows from 2 to 4 engines through the CLI (another driver on the same cluster) and back to
2 through the controller; the joiners serve only once they hold a committed version, the
leavers' work goes back to the ledger, and the audit finds no token under a version its
engine had not committed. An engine the cluster cannot place is given up at its deadline
without holding anything up."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from test_end_to_end import assert_ledger_closed, small

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
RL_ASYNC = str(Path(sys.executable).parent / "rl-async")


def _wait(what: str, ready, run_ref, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if ray.wait([run_ref], timeout=0)[0]:
            ray.get(run_ref)
            raise AssertionError(f"the run ended before {what}")
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.3)


def _serving(name: str, i: int) -> bool:
    """engine-i exists, holds a published version and has answered requests."""
    try:
        load = ray.get(ray.get_actor(f"{name}/engine-{i}").load.remote(), timeout=10)
    except Exception:  # noqa: BLE001 -- not there yet
        return False
    return load["extra"]["finished"] > 0


def test_a_running_run_grows_and_shrinks_and_loses_nothing(ray_cluster, tmp_path):
    from actors.controller import ControllerActor
    from launch.run import controller_options

    name = "t-scale"
    cfg, report = small("cluster_configs/local.toml", "run.deterministic=true",
                        "run.audit_fraction=1.0", "cluster.cpu_engines=2",
                        "cluster.engine_cpus=0.5", "run.max_steps=2000",
                        "publication.drain_timeout_s=5", "publication.channel_timeout_s=10",
                        f"run.output_dir={tmp_path}", name=name)
    controller = ControllerActor.options(**controller_options(name)).remote(
        cfg, report.plan, [])
    ref = controller.run.remote()
    step = lambda: ray.get(controller.progress.remote()).get("step", 0)  # noqa: E731
    _wait("step 2", lambda: step() >= 2, ref)

    # Grow through the CLI, a second driver on this cluster.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([RL_ASYNC, "scale", "--run", name,
                          "--engines", "4"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["joining"] == 2, reply
    _wait("the joiners serving", lambda: _serving(name, 2) and _serving(name, 3), ref)
    at = step()
    _wait("two more steps with four engines", lambda: step() >= at + 2, ref)

    # Shrink through the controller: the two highest leave, drained.
    reply = ray.get(controller.scale.remote(2), timeout=300)
    assert reply["left"] == [3, 2] and reply["engines"] == 2, reply
    at = step()
    _wait("two more steps with two engines", lambda: step() >= at + 2, ref)

    missing = subprocess.run([RL_ASYNC, "scale", "--run", "nope",
                              "--engines", "2"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "no running run of that name" in missing.stderr

    controller.request_stop.remote()
    summary = ray.get(ref, timeout=300)
    ray.kill(controller)
    assert summary["fleet"] == {"engines_added": 2, "engines_removed": 2, "engines_max": 4,
                                "engines_unplaced": 0, "engines_final": 2}, summary["fleet"]
    assert_ledger_closed(summary)
    assert summary["faults"]["engine_restarts"] == 0, summary["faults"]
    audit = summary["provenance"]
    assert audit["audited_tokens"] > 0 and audit["mismatches"] == 0, audit


def test_an_engine_the_cluster_cannot_place_is_given_up_at_its_deadline(ray_cluster):
    from actors.fleet import RayFleet

    cfg, report = small("cluster_configs/local.toml", "cluster.engine_cpus=64",
                        name="t-unplaceable")
    fleet = RayFleet(cfg, report.plan)

    async def main():
        started = time.monotonic()
        bundle = await fleet._place(1.0)
        return bundle, time.monotonic() - started

    bundle, seconds = asyncio.run(main())
    assert bundle is None and seconds < 30
