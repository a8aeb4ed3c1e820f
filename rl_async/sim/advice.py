"""`rl-async plan --simulate`: the plan's warnings plus simulated consequences.

The file is simulated as it is; when the prediction shows a bottleneck, a few candidate
sizings are simulated too (each one a `--set` override of the same file, so every limit is
re-derived by the capacity plan as a real run would) and the smallest one that fixes it is
named:

    trainer wait > TARGET_WAIT   -> more engines: x2 first; under target -> the smallest of
        x1.25, x1.5 that still is; else x3, x4 (the first under target)
    trainer wait < TARGET_WAIT and generation idle > IDLE_LIMIT -> the trainer is the
        bottleneck: fewer engines that keep the wait under target
    discarded groups > DISCARD_LIMIT -> max_weight_staleness x2 (and x4 when x2 is not enough)
    GPUs for engines and for the trainer -> the split of the same GPUs that simulates the
        most steps/hour, when it beats the file's by 5% (rl_async/sim/split.py)

Candidates are simulated for fewer steps than `simulate` by default (PLAN_STEPS): a warning
is a direction and an order of magnitude, not a forecast to the percent.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

from rl_async.plan.capacity import Warning_, plan_capacity
from rl_async.plan.config import RunConfig
from rl_async.plan.load import load_config
from rl_async.sim.calibrate import sim_timings
from rl_async.engine.timing import TrainerTiming
from rl_async.sim.run import simulate
from rl_async.sim.split import split_warning

TARGET_WAIT = 0.05
IDLE_LIMIT = 0.30
DISCARD_LIMIT = 0.10
PLAN_STEPS = 20
ENGINE_FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0)
SHRINK_FACTORS = (0.5, 0.75)


def _engines_override(cfg: RunConfig, engines: int) -> str:
    c = cfg.cluster
    if c.inference_gpus:
        return f"cluster.inference_gpus={engines * c.gpus_per_engine}"
    return f"cluster.cpu_engines={engines}"


def simulated_warnings(path: str, overrides: tuple[str, ...], cfg: RunConfig,
                       calibration: dict | None = None, steps: int = PLAN_STEPS
                       ) -> tuple[dict[str, Any], list[Warning_]]:
    """(the file's prediction, warnings with simulated consequences)."""
    steps = min(cfg.run.max_steps, steps)

    def run(extra: tuple[str, ...], trainer_scale: float = 1.0) -> dict[str, Any]:
        c = load_config(path, (*overrides, *extra))
        timings = sim_timings(c, calibration)
        if trainer_scale != 1.0:  # another trainer size than the measured one (sim/split.py)
            per_sample = timings.trainer.seconds_per_sample * trainer_scale
            timings = replace(timings, trainer=TrainerTiming(per_sample))
        return simulate(c, plan_capacity(c)[0], timings, steps)

    base = run(())
    engines = plan_capacity(cfg)[0].engines
    out = [Warning_("SIMULATED", _headline(base, steps))]
    wait, idle = base["trainer_wait_fraction"], base["generation_idle_fraction"]
    if wait > TARGET_WAIT:
        out.append(_more_engines(cfg, engines, base, run))
    elif idle > IDLE_LIMIT and engines > 1:
        out.append(_fewer_engines(cfg, engines, idle, run))
    if base["discarded_groups_fraction"] > DISCARD_LIMIT:
        out.append(_more_lag(cfg, base, run))
    split = split_warning(path, overrides, cfg, base, run)
    if split is not None:
        out.append(split)
    return base, out


def _headline(p: dict[str, Any], steps: int) -> str:
    return (f"simulated {steps} optimizer steps: trainer waits {p['trainer_wait_fraction']:.0%} "
            f"of the time, engines idle {p['generation_idle_fraction']:.0%}, "
            f"{p['discarded_groups_fraction']:.0%} of groups discarded as stale, staleness "
            f"mean {p['mean_staleness']:.2f} / p99 {p['staleness']['p99_delivered']:g} (in flight "
            f"{p['staleness']['inflight_mean']:.2f} / {p['staleness']['inflight_p99']:g}, in "
            f"queue {p['staleness']['queue_mean']:.2f} / {p['staleness']['queue_p99']:g}), "
            f"{p['samples_per_s']:.1f} samples/s, {p['steps_per_hour']:.0f} steps/hour "
            f"(timings: {p['timings_source']['decode'].split(' (')[0]})")


def _more_engines(cfg: RunConfig, engines: int, base: dict, run: Callable) -> Warning_:
    wait = base["trainer_wait_fraction"]
    def sized(factor: float) -> int:
        return max(engines + 1, math.ceil(engines * factor))

    tried: dict[int, dict] = {}

    def wait_at(n: int) -> float:
        if n not in tried:
            tried[n] = run((_engines_override(cfg, n),))
        return tried[n]["trainer_wait_fraction"]

    order = ([sized(1.25), sized(1.5), sized(2.0)] if wait_at(sized(2.0)) <= TARGET_WAIT
             else [sized(3.0), sized(4.0)])
    for n in order:
        if wait_at(n) <= TARGET_WAIT:
            p = tried[n]
            return Warning_("SIM_GENERATION_BOUND", (
                f"the trainer waits {wait:.0%} of the time: generation is the bottleneck; "
                f"{n - engines} more engine(s) ({n} in all) bring it to "
                f"{p['trainer_wait_fraction']:.0%} ({p['steps_per_hour']:.0f} steps/hour)"))
    n = max(tried)
    return Warning_("SIM_GENERATION_BOUND", (
        f"the trainer waits {wait:.0%} of the time: generation is the bottleneck, and even "
        f"{n} engines leave it at {tried[n]['trainer_wait_fraction']:.0%}: publications pause "
        f"generation {base['publication_pause_fraction']:.0%} of the time (draining long "
        f"responses: publication.drain_timeout_s = {cfg.publication.drain_timeout_s:g} s, "
        f"max_response_len {cfg.rollout.max_response_len}) or the producer budget limits it"))


def _fewer_engines(cfg: RunConfig, engines: int, idle: float, run: Callable) -> Warning_:
    for factor in SHRINK_FACTORS:
        n = max(1, math.floor(engines * factor))
        if n == engines:
            continue
        p = run((_engines_override(cfg, n),))
        if p["trainer_wait_fraction"] <= TARGET_WAIT:
            return Warning_("SIM_TRAINER_BOUND", (
                f"engines idle {idle:.0%} of the time: training is the bottleneck; {n} "
                f"engines instead of {engines} keep the trainer wait at "
                f"{p['trainer_wait_fraction']:.0%}"))
    return Warning_("SIM_TRAINER_BOUND", (
        f"engines idle {idle:.0%} of the time: training is the bottleneck (fewer engines "
        f"would make the trainer wait; a faster trainer helps)"))


def _more_lag(cfg: RunConfig, base: dict[str, Any], run: Callable) -> Warning_:
    lag = cfg.max_weight_staleness
    key = "async.max_weight_staleness"
    frac = base["discarded_groups_fraction"]
    msg = (f"{frac:.0%} of groups are discarded as older than max_weight_staleness = {lag} "
           f"(regenerated: wasted generation)")
    if not cfg.fully_async or not cfg.structured:
        return Warning_("SIM_STALE_DISCARDS", msg)
    for new in (max(1, 2 * lag), max(2, 4 * lag)):
        p = run((f"{key}={new}",))
        if p["discarded_groups_fraction"] <= DISCARD_LIMIT or new == max(2, 4 * lag):
            return Warning_("SIM_STALE_DISCARDS", (
                f"{msg}; {key} = {new} gives {p['discarded_groups_fraction']:.0%} discarded, "
                f"mean staleness {p['mean_staleness']:.2f}, trainer wait "
                f"{p['trainer_wait_fraction']:.0%}"))
    return Warning_("SIM_STALE_DISCARDS", msg)
