"""Shared by the actor-system benchmarks: config loading, one local Ray cluster, and a timed
run of the real controller over the real fleet.

`TimedRun` is ControllerActor's loop (RayFleet + rl_async.loop.controller.Controller) with one
addition: every logged row is stamped with time.monotonic(), so a benchmark can measure the
training loop itself (initial eval row -> last collection row) instead of actor start-up,
evaluation and shutdown.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` from anywhere
    sys.path.insert(0, str(ROOT))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402

from rl_async.plan.checks import Report, validate  # noqa: E402
from rl_async.plan.config import RunConfig  # noqa: E402
from rl_async.plan.load import load_config  # noqa: E402


def load_checked(path: str, overrides: list[str]) -> tuple[RunConfig, Report]:
    """Load a run file with `--set`-style overrides; raise with every error if invalid."""
    cfg = load_config(ROOT / path, overrides)
    report = validate(cfg)
    if not report.ok:
        raise SystemExit(f"benchmark config {path} {overrides} is invalid:\n  "
                         + "\n  ".join(report.errors))
    return cfg, report


def init_ray(num_cpus: int) -> None:
    """One local cluster for the whole benchmark, bound to 127.0.0.1."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                       "TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}"}})


@ray.remote(num_cpus=0)
class TimedRun:
    """A whole training run (fleet start, controller loop, shutdown) with stamped metrics."""

    async def run(self, cfg: RunConfig, plan) -> dict:
        from actors.fleet import RayFleet
        from rl_async.loop.controller import Controller

        rows: list[tuple[float, int, dict]] = []
        fleet = RayFleet(cfg, plan)
        try:
            started = time.monotonic()
            await fleet.start()
            ready = time.monotonic()
            controller = Controller(cfg, plan, fleet,
                                    lambda m, step: rows.append((time.monotonic(), step, m)))
            summary = await controller.run()
            ended = time.monotonic()
        finally:
            await fleet.shutdown()
        return {"summary": summary, "rows": rows, "start_seconds": ready - started,
                "end": ended}
