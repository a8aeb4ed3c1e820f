"""Where a delivered group's age came from: generation (in flight) or waiting (in queue).

A group's age at dequeue (SPEC §5) splits at the moment it entered the completed buffer:

    in flight = version at insertion − oldest token version   (the engines' trail behind the
                trainer when it started, plus the updates made while it was generated)
    in queue  = version at dequeue − version at insertion     (updates made while it waited)

Per collection the means go to W&B (`rollout/staleness_inflight_mean`, `_queue_mean`); the
run's means and 99th percentiles go to the summary's `staleness` block, beside the
delivered age's own, so a run shows whether its data ages in the engines or in the buffer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rl_async.base.types import Group


def split_age(group: Group) -> tuple[int, int] | None:
    """(in flight, in queue) of a delivered group; None when its age is unknown."""
    age, oldest = group.age_at_delivery, group.oldest_version()
    if age is None or oldest is None or group.version_at_insert is None:
        return None
    inflight = max(0, group.version_at_insert - oldest)
    return inflight, max(0, age - inflight)


def quantile(hist: Counter, q: float) -> float:
    """The q-quantile of a histogram of integers (the smallest value with at least q of the
    mass at or below it); 0 when empty."""
    total = sum(hist.values())
    if not total:
        return 0.0
    need, seen = q * total, 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= need:
            return float(value)
    return float(max(hist))


@dataclass
class StalenessSplit:
    inflight: Counter = field(default_factory=Counter)
    queue: Counter = field(default_factory=Counter)
    total: Counter = field(default_factory=Counter)

    def observe(self, groups: list[Group]) -> dict[str, float]:
        """Count one collection's delivered groups; its W&B means."""
        parts = [p for p in map(split_age, groups) if p is not None]
        for inflight, queue in parts:
            self.inflight[inflight] += 1
            self.queue[queue] += 1
            self.total[inflight + queue] += 1
        n = max(1, len(parts))
        return {"rollout/staleness_inflight_mean": sum(p[0] for p in parts) / n,
                "rollout/staleness_queue_mean": sum(p[1] for p in parts) / n}

    def to_dict(self) -> dict[str, float]:
        def mean(h: Counter) -> float:
            n = sum(h.values())
            return sum(v * c for v, c in h.items()) / n if n else 0.0
        return {"inflight_mean": mean(self.inflight), "queue_mean": mean(self.queue),
                "inflight_p99": quantile(self.inflight, 0.99),
                "queue_p99": quantile(self.queue, 0.99),
                "p99_delivered": quantile(self.total, 0.99)}
