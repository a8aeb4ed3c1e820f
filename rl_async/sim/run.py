"""`rl-async simulate`: one run of the real controller loop on the virtual clock, and what it
predicts.

    SimTimings ([synthetic] or --calibrate) --> SimFleet (real core, simulated engines)
        --> Controller.run() on VirtualClockLoop (run.max_steps capped by --steps)
        --> the controller's own summary + the fleet's time integrals --> prediction

Definitions match a real run's summary, because the same Controller computes them:
trainer_wait_fraction = trainer wait / whole wall time (evaluations included);
mean_staleness = summary `staleness.mean_delivered`; discarded_groups_fraction = ledger
discarded / (discarded + delivered). dropped_samples_fraction is SPEC §7's (age filter only,
samples); evicted and aborted fractions are over every group attempt that ended.
"""

from __future__ import annotations

import time
from typing import Any

from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.loop.controller import Controller
from rl_async.observe.queue_metrics import LENGTH_BIN_LABELS
from rl_async.sim.fleet import OUTCOMES, SimFleet
from rl_async.sim.timings import SimTimings
from rl_async.sim.virtual_loop import SimulationDeadlock, run_virtual

DEFAULT_STEPS = 100  # optimizer updates simulated unless --steps says otherwise
TIMELINE_POINTS = 10


def simulate(cfg: RunConfig, plan: CapacityPlan, timings: SimTimings, steps: int | None = None,
             seed: int | None = None) -> dict[str, Any]:
    """Simulate `steps` optimizer updates (default: run.max_steps capped at DEFAULT_STEPS)."""
    steps = steps if steps is not None else min(cfg.run.max_steps, DEFAULT_STEPS)
    if steps < 1:
        raise ValueError(f"--steps = {steps}: simulate at least one optimizer update")
    cfg = cfg.model_copy(deep=True)
    cfg.run.max_steps = steps
    cfg.cluster.cpu_threads = "fixed"  # simulated engines and trainers have no threads
    fleet = SimFleet(cfg, plan, timings, seed=cfg.run.seed if seed is None else seed)
    logged = {"paused_seconds": 0.0, "publication_seconds": 0.0}

    def log(metrics: dict[str, float], step: int) -> None:
        for key in logged:
            logged[key] += metrics.get(f"publish/{key}", 0.0)

    async def main() -> dict[str, Any]:
        await fleet.start()
        summary = await Controller(cfg, plan, fleet, log).run()
        fleet.occupancy.mark(len(fleet.buffer))  # close the last interval on the virtual clock
        for engine in fleet.engines:
            engine.track()
            await engine.close()
        return summary

    cpu = time.process_time()
    try:
        summary = run_virtual(main())
    except SimulationDeadlock as exc:
        raise SimulationDeadlock(f"{exc}; what each stage holds: {fleet.state()}") from None
    cpu = time.process_time() - cpu
    return prediction(cfg, plan, timings, fleet, summary, logged, cpu)


def _fraction(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def prediction(cfg: RunConfig, plan: CapacityPlan, timings: SimTimings, fleet: SimFleet,
               summary: dict, logged: dict, cpu_s: float) -> dict[str, Any]:
    wall = summary["wall_seconds"]
    ledger = summary["ledger"]
    ended = sum(ledger[k] for k in ("delivered_groups", "discarded_groups", "evicted_groups",
                                    "aborted_groups", "filtered_groups", "failed_groups"))
    tally = fleet.tally
    n_eng = len(fleet.engines)
    busy = sum(e.busy_seconds for e in fleet.engines) / n_eng
    running = sum(e.request_seconds for e in fleet.engines) / n_eng
    by_length = {}
    for label in LENGTH_BIN_LABELS:
        row = {o: tally.counts[o][label] for o in OUTCOMES}
        if any(row.values()):
            total = sum(row.values())
            row.update({f"{o}_fraction": _fraction(row[o], total) for o in OUTCOMES[1:]})
            by_length[label] = row
    dropped, delivered = tally.total("dropped"), tally.total("delivered")
    occ = fleet.occupancy
    span = max(1e-9, occ.span)
    return {
        "config": cfg.run.name, "simulated_steps": summary["steps"],
        "simulated_seconds": wall, "simulator_cpu_seconds": round(cpu_s, 3),
        "timings_source": dict(timings.sources),
        "trainer_wait_fraction": summary["throughput"]["trainer_wait_fraction"],
        "generation_idle_fraction": 1 - _fraction(busy, wall),
        "mean_running_requests_per_engine": _fraction(running, wall),
        "engine_slot_utilisation": _fraction(running, wall * plan.max_running_requests),
        "dropped_samples_fraction": _fraction(dropped, dropped + delivered),
        "discarded_groups_fraction": _fraction(ledger["discarded_groups"],
                                               ledger["discarded_groups"]
                                               + ledger["delivered_groups"]),
        "evicted_groups_fraction": _fraction(ledger["evicted_groups"], ended),
        "aborted_groups_fraction": _fraction(ledger["aborted_groups"], ended),
        "by_response_length": by_length,
        "mean_staleness": summary["staleness"]["mean_delivered"],
        "max_staleness": summary["staleness"]["max_delivered"],
        # where the age comes from (rl_async/observe/staleness.py), and its tail
        "staleness": {k: summary["staleness"][k] for k in (
            "mean_delivered", "p99_delivered", "inflight_mean", "inflight_p99", "queue_mean",
            "queue_p99")},
        "samples_per_s": _fraction(fleet.trained_samples, wall),
        "max_weight_staleness": plan.max_weight_staleness,
        "staleness_histogram": {k: v for k, v in fleet.ages.items() if v},
        "buffer": {"capacity_groups": plan.completed_buffer_groups,
                   "mean_groups": occ.area / span, "peak_groups": occ.peak,
                   "full_fraction": occ.full_seconds / span,
                   "timeline": _timeline(occ.samples, TIMELINE_POINTS)},
        "publications": fleet.publications,
        "publication_pause_seconds": logged["paused_seconds"],
        "publication_pause_fraction": _fraction(logged["paused_seconds"], wall),
        "eval_seconds": fleet.eval_seconds,
        "steps_per_hour": _fraction(summary["steps"], wall) * 3600,
        "useful_tokens_per_s": summary["throughput"]["useful_tokens_per_s"],
        "ledger": ledger,
        **({"rollout": summary["rollout"]} if timings.turns is not None else {}),
    }


def _timeline(samples: list[tuple[float, int]], points: int) -> list[list[float]]:
    """[seconds since the producer started, mean groups] over `points` equal slices of the
    run (time-weighted)."""
    if len(samples) < 2:
        return [[t, float(n)] for t, n in samples]
    t0, t1 = samples[0][0], samples[-1][0]
    width = (t1 - t0) / points or 1.0
    out = []
    for k in range(points):
        lo, hi = t0 + k * width, t0 + (k + 1) * width
        area = 0.0
        for (ta, n), (tb, _) in zip(samples, samples[1:]):
            overlap = min(hi, tb) - max(lo, ta)
            if overlap > 0:
                area += n * overlap
        out.append([round(hi - t0, 3), round(area / width, 2)])
    return out
