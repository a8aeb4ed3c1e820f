"""`rl-async scale --run NAME --engines N`: change a running run's engine fleet.

Connects to the cluster `RAY_ADDRESS` names (as `ray job submit` does; without it, the local
cluster a `rl-async run` on this machine started), finds the run's controller actor
(`<run.name>/controller` in the `rl-async` namespace) and calls its `scale` (actors/
fleet_scale.py): leaving engines drain and are gone when it returns; joining engines are
placed, started and caught up in the background, and enter routing once they hold the
newest published weights.
"""

from __future__ import annotations

import json
import os

SCALE_CALL_TIMEOUT_S = 600  # leaves drain for up to publication.drain_timeout_s each


def scale_run(run: str, engines: int, placement_timeout_s: float | None) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from launch.run import CONTROL_NAMESPACE, controller_options

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    name = controller_options(run)["name"]
    try:
        controller = ray.get_actor(name, namespace=CONTROL_NAMESPACE)
    except ValueError:
        raise LookupError(f"--run {run!r}: no running run of that name on this cluster (no "
                          f"actor {name!r} in namespace {CONTROL_NAMESPACE!r}); the name is "
                          f"the run file's run.name, and RAY_ADDRESS must name the cluster "
                          f"the run is on") from None
    return ray.get(controller.scale.remote(engines, placement_timeout_s),
                   timeout=SCALE_CALL_TIMEOUT_S)


def print_result(result: dict) -> None:
    print(json.dumps(result), flush=True)
