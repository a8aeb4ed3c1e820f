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
    # Multi-turn environments: finished trajectories (aborted ones not counted), their
    # assistant turns, the truncated ones (max_turns or max_trajectory_tokens) and the
    # seconds spent inside reset/step/score.
    trajectories: int = 0
    turns: int = 0
    truncated_trajectories: int = 0
    env_seconds: float = 0.0
    retried_turns: int = 0    # turns sent again after an engine aborted them
    extra: dict = field(default_factory=dict)

    def rollout_summary(self) -> dict[str, float]:
        """The summary's `rollout`: samples generated to the end and scored (the work done,
        whatever became of it: trained, filtered, discarded) and aborted ones; for multi-turn
        runs (zeros otherwise) assistant turns per trajectory, the share truncated by
        max_turns or the token budget, and seconds inside the environment per trajectory."""
        n = max(1, self.trajectories)
        return {"generated_samples": self.scored_samples,
                "aborted_samples": self.aborted_samples,
                "trajectories": self.trajectories, "turns_mean": self.turns / n,
                "truncated_fraction": self.truncated_trajectories / n,
                "env_seconds_mean": self.env_seconds / n}

    def record_trajectory(self, result) -> None:
        """Count one trajectory (rl_async.loop.trajectory.TrajectoryResult)."""
        if result.finish == "abort":
            self.aborted_samples += 1
            self.aborted_tokens += result.sampled_tokens + result.aborted_tokens
            return
        self.trajectories += 1
        self.turns += result.turns
        self.truncated_trajectories += int(result.truncated)
        self.env_seconds += result.env_seconds
        self.generated_tokens += result.sampled_tokens


@dataclass
class OpenGroup:
    """A group the producer owns: its samples in flight and how the attempt is going."""

    group: Group
    next_index: int = 0       # samples submitted so far (sample granularity)
    done: int = 0
    aborted: bool = False
    abort_reason: str = ""    # why, where a trajectory said (else a publication or shutdown)
    error: BaseException | None = None
    inserted: bool = False    # entered the completed buffer
