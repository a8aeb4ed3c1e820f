"""`plan --simulate` on GPUs: how to split the same GPUs between engines and the trainer.

On CPU the thread balancer (rl_async/loop/threads.py) measures which side bounds the loop and
lends it the other side's idle cores. On GPUs the unit is a GPU and moving one means a new
placement, so the same question is answered before the run, by the simulator: with the
file's G = inference_gpus + trainer_gpus fixed, splits are simulated (the whole fleet, the
capacity plan re-derived for each, as `rl-async simulate --set` would) and the fastest one in
optimizer steps per hour is named when it beats the file's by SPLIT_GAIN or more.

A split is a candidate only if `validate` accepts it: engines in whole `gpus_per_engine`,
trainer layouts the checks accept (TP x PP, the batch over data-parallel ranks) and a memory
plan that fits; a trainer that no longer fits is skipped, not advised. The trainer's time per
sample (the `[synthetic]` value, or the calibration's, measured on the file's trainer GPUs)
is scaled by file_trainer_gpus / candidate_trainer_gpus: data parallel, linear. That is
optimistic for more GPUs (gradient all-reduce, a smaller per-GPU batch) and pessimistic for
fewer, which is why the advice names the gain it assumes and asks for a calibration.

The search walks from the file's split one valid split at a time toward more engines and
toward more trainer GPUs, while steps/hour rises (the rate is the slower side's: it rises
until the sides cross), so a 24-GPU file costs a handful of simulations, not 23.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_async.plan.capacity import Warning_
from rl_async.plan.checks import validate
from rl_async.plan.config import RunConfig
from rl_async.plan.load import load_config

SPLIT_GAIN = 0.05     # name a split that simulates at least 5% more steps/hour
MIN_STEP_GAIN = 0.01  # keep walking while each split adds at least 1%

Simulate = Callable[[tuple[str, ...], float], dict[str, Any]]


def split_overrides(inference: int, trainer: int) -> tuple[str, ...]:
    """The --set overrides of one split (one trainer process per GPU)."""
    return (f"cluster.inference_gpus={inference}", f"cluster.trainer_gpus={trainer}",
            f"cluster.trainer_workers={trainer}")


def _valid(path: str, overrides: tuple[str, ...], inference: int, trainer: int) -> bool:
    try:
        cfg = load_config(path, (*overrides, *split_overrides(inference, trainer)))
    except ValueError:
        return False
    return validate(cfg).ok


def split_warning(path: str, overrides: tuple[str, ...], cfg: RunConfig, base: dict[str, Any],
                  run: Simulate) -> Warning_ | None:
    """SIM_GPU_SPLIT when another split of the same GPUs simulates >= SPLIT_GAIN faster;
    None on CPU, with colocated engines and trainer, or when the file's split is best.

    `run(overrides, trainer_scale)` simulates the file with those overrides and the
    trainer's seconds per sample multiplied by `trainer_scale`; `base` is the file's result."""
    c = cfg.cluster
    if not (c.inference_gpus and c.trainer_gpus):
        return None
    total, now = c.inference_gpus + c.trainer_gpus, c.trainer_gpus
    rate = {now: base["steps_per_hour"]}
    results = {now: base}

    def at(trainer: int) -> float | None:
        """Steps/hour with `trainer` trainer GPUs; None when that split is not valid."""
        if trainer not in rate:
            inference = total - trainer
            if (inference % c.gpus_per_engine
                    or not _valid(path, overrides, inference, trainer)):
                rate[trainer] = None
            else:
                results[trainer] = run(split_overrides(inference, trainer), now / trainer)
                rate[trainer] = results[trainer]["steps_per_hour"]
        return rate[trainer]

    for direction in (-1, +1):  # fewer trainer GPUs (more engines), then more
        best, trainer = now, now + direction
        while 0 < trainer < total:
            r = at(trainer)
            if r is not None:
                if r < rate[best] * (1 + MIN_STEP_GAIN):
                    break
                best = trainer
            trainer += direction
    valid = {t: r for t, r in rate.items() if r is not None}
    best = max(valid, key=valid.get)
    gain = valid[best] / max(rate[now], 1e-9) - 1
    if best == now or gain < SPLIT_GAIN:
        return None
    p = results[best]
    return Warning_("SIM_GPU_SPLIT", (
        f"of the {total} GPUs, {total - best} for engines and {best} for the trainer simulate "
        f"{valid[best]:.0f} steps/hour against {rate[now]:.0f} with the file's "
        f"{c.inference_gpus} + {now} (+{gain:.0%}; trainer wait "
        f"{base['trainer_wait_fraction']:.0%} -> {p['trainer_wait_fraction']:.0%}, engines "
        f"idle {base['generation_idle_fraction']:.0%} -> {p['generation_idle_fraction']:.0%}): "
        f"--set {' --set '.join(split_overrides(total - best, best))}. It assumes the "
        f"trainer's time per sample scales as 1 / trainer GPUs (data parallel); "
        f"--calibrate with a run's summary measures the rest"))
