"""Shared by the actor-system benchmarks: config loading, one local Ray cluster, and a timed
run of the real controller over the real fleet.

`TimedRun` is ControllerActor's loop (RayFleet + rl_async.loop.controller.Controller) with one
addition: every logged row is stamped with time.monotonic(), so a benchmark can measure the
training loop itself (initial eval row -> last collection row) instead of actor start-up,
evaluation and shutdown.
"""

from __future__ import annotations

import math
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

    async def run(self, cfg: RunConfig, plan, engine_calls: tuple = ()) -> dict:
        """`engine_calls`: (method, args) to call on every engine once the fleet is up (a
        benchmark's debug setting, e.g. routing_replay.py's routing noise)."""
        from actors.fleet import RayFleet
        from rl_async.loop.controller import Controller

        rows: list[tuple[float, int, dict]] = []
        fleet = RayFleet(cfg, plan)
        try:
            started = time.monotonic()
            await fleet.start()
            for method, args in engine_calls:
                for engine in fleet.engines:
                    await fleet.bounded(getattr(engine, method).remote(*args), method)
            ready = time.monotonic()
            controller = Controller(cfg, plan, fleet,
                                    lambda m, step: rows.append((time.monotonic(), step, m)))
            summary = await controller.run()
            ended = time.monotonic()
        finally:
            await fleet.shutdown()
        return {"summary": summary, "rows": rows, "start_seconds": ready - started,
                "end": ended}


async def started_fleet(cfg: RunConfig, plan):
    """A started RayFleet (its version-0 publication is a warm-up) and a Publisher over it,
    as the controller's; the caller shuts the fleet down."""
    from actors.fleet import RayFleet
    from rl_async.loop.publish import Publisher

    fleet = RayFleet(cfg, plan)
    try:
        await fleet.start()
    except BaseException:
        await fleet.shutdown()
        raise
    return fleet, Publisher(cfg.refresh.mode, cfg.publication.drain_timeout_s,
                            cfg.publication.timeout_s)


def curve_without_evals(result: dict) -> tuple[list[list], float]:
    """A TimedRun's eval curve ([step, seconds, reward]) on the training loop's clock: each
    point's wall time minus the seconds of every evaluation up to and including it (the
    `eval/seconds` rows). A drain before an evaluation (eval.drain) stays on the clock: it is
    the pipeline's cost, not the evaluation's. Returns the curve and the seconds taken out."""
    evals = [(m["eval/wall_seconds"], m["eval/seconds"]) for _t, _s, m in result["rows"]
             if "eval/seconds" in m]
    curve, taken_out = [], 0.0
    for (step, _wall, reward), (wall, seconds) in zip(result["summary"]["eval"]["curve"], evals):
        taken_out += seconds
        curve.append([step, round(wall - taken_out, 3), reward])
    return curve, taken_out


def speedup(theirs: float, ours: float) -> float:
    """How many times sooner `ours` reaches a target than `theirs` (seconds, +inf: never):
    0 when ours never does; 1 when both are there at the start."""
    if not math.isfinite(ours):
        return 0.0
    if ours == 0:
        return 1.0 if theirs == 0 else 1e9
    return theirs / ours


def finite(x: float) -> float | None:
    """JSON has no infinity: a target never reached is null."""
    return round(x, 2) if math.isfinite(x) else None
