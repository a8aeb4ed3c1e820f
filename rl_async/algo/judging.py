"""Judge deployment settings, resolved from the run file's `[judge]` section (no Ray here).

A judge is a user class (`judge.judge_class = "module:Class"`) whose instances have a
`grade(sample) -> float` method, sync or async. Ray Serve runs it as an autoscaled
deployment (actors/judges.py); the reward actor calls it through a deployment handle with the
judge's timeout and bounded retries (rl_async.algo.rewards.RewardRunner).

`JudgeDeployment` is everything Serve needs, computed once so the fleet and the tests deploy
exactly what the run file says; tests may override the tuning keys in OVERRIDABLE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# `[judge]` keys a caller may override (defaults live in rl_async.plan.config.JudgeSection).
OVERRIDABLE = ("upscale_delay_s", "downscale_delay_s", "look_back_period_s", "num_cpus",
               "num_gpus", "kwargs")

DEPLOYMENT_NAME = "judge"


def judge_app_name(run_name: str) -> str:
    """The Serve application that holds a run's judge: one per run, so runs sharing a
    cluster never grade with each other's judges."""
    return f"{run_name}-judge"


@dataclass(frozen=True)
class JudgeDeployment:
    app_name: str
    judge_class: str
    max_ongoing_requests: int
    autoscaling: dict[str, float]
    ray_actor_options: dict[str, float]
    judge_kwargs: dict[str, Any] = field(default_factory=dict)


def judge_deployment(section: Any, run_name: str, **overrides: Any) -> JudgeDeployment:
    """`[judge]` (+ overrides for the optional keys) -> the deployment to run.

    Raises ValueError naming the key when the values cannot describe a deployment."""
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"judge overrides {unknown}: unknown; expected some of "
                         f"{sorted(OVERRIDABLE)}")
    if section.min_replicas > section.max_replicas:
        raise ValueError(f"judge.min_replicas = {section.min_replicas} > judge.max_replicas = "
                         f"{section.max_replicas}; raise max_replicas or lower min_replicas")
    if ":" not in section.judge_class:
        raise ValueError(f"judge.judge_class = {section.judge_class!r}: expected 'module:Class'")
    opt = {"upscale_delay_s": section.upscale_delay_s,
           "downscale_delay_s": section.downscale_delay_s,
           "look_back_period_s": section.look_back_period_s, "num_cpus": section.num_cpus,
           "num_gpus": section.num_gpus, "kwargs": section.kwargs, **overrides}
    for key in ("upscale_delay_s", "downscale_delay_s", "num_cpus", "num_gpus"):
        if opt[key] < 0:
            raise ValueError(f"judge.{key} = {opt[key]}: must be >= 0")
    if opt["look_back_period_s"] <= 0:
        raise ValueError(f"judge.look_back_period_s = {opt['look_back_period_s']}: must be > 0")
    if not isinstance(opt["kwargs"], dict):
        raise ValueError(f"judge.kwargs = {opt['kwargs']!r}: must be a table of constructor "
                         f"arguments for {section.judge_class}")
    autoscaling = {
        "min_replicas": section.min_replicas,
        "max_replicas": section.max_replicas,
        "target_ongoing_requests": float(section.target_ongoing_requests),
        "upscale_delay_s": float(opt["upscale_delay_s"]),
        "downscale_delay_s": float(opt["downscale_delay_s"]),
        "look_back_period_s": float(opt["look_back_period_s"]),
    }
    actor_options = {"num_cpus": float(opt["num_cpus"])}
    if opt["num_gpus"]:
        actor_options["num_gpus"] = float(opt["num_gpus"])
    return JudgeDeployment(judge_app_name(run_name), section.judge_class,
                           section.max_ongoing_requests, autoscaling, actor_options,
                           dict(opt["kwargs"]))
