"""What the producer is given and what it reports: its limits (from the capacity plan), its
counters, and the put-time filter of dynamic sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_async.base.types import Group


def zero_variance(group: Group) -> str | None:
    """`filter.zero_variance`: a group whose rewards are all equal has zero group-normalised
    advantage everywhere, so it carries no learning signal (dynamic sampling)."""
    rewards = {s.reward for s in group.samples}
    return f"zero reward variance (all {next(iter(rewards))})" if len(rewards) == 1 else None


@dataclass
class ProducerLimits:
    granularity: str          # "group" | "sample"
    producer_samples: int     # budget in samples, a whole number of groups
    group_size: int
    http_slots: int           # global generation semaphore


@dataclass
class ProducerStats:
    submitted_samples: int = 0
    generated_tokens: int = 0
    aborted_samples: int = 0
    aborted_tokens: int = 0
    inserted_groups: int = 0
    filtered_groups: int = 0
    aborted_groups: int = 0
    failed_groups: int = 0
    generation_seconds: float = 0.0
    # Time with at least one generation request outstanding: generation_seconds over it is
    # the mean requests in flight while generating (the simulator's calibration, which must
    # not count publication pauses and evals as light load).
    generation_busy_seconds: float = 0.0
    put_wait_seconds: float = 0.0
    # Time inside the prompt fetches and reward calls (actor round trips in a real run; a
    # permit is held through both): the simulator's calibration.
    fetch_seconds: float = 0.0
    fetches: int = 0
    score_seconds: float = 0.0
    scored_samples: int = 0
    # A generate call's time outside the engine (engines that time themselves: embedded,
    # synthetic), over these samples: rollout requests only, unlike the engine's own mean.
    transit_seconds: float = 0.0
    transit_samples: int = 0
    # mixed_policy refresh: requests whose prefix was rebuilt under new weights, and
    # responses whose tokens span more than one policy version.
    refreshed_requests: int = 0
    mixed_version_responses: int = 0
    extra: dict = field(default_factory=dict)
