"""What the controller loop reports as it goes: its progress (the driver's status line and
the summary read it) and its own share of each step's time."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_async.base.types import Group
from rl_async.observe.queue_metrics import COMPLETED_QUEUE_PREFIX


@dataclass
class Progress:
    step: int = 0
    version: int = 0
    reward: float = 0.0
    staleness: float = 0.0
    trainer_wait_seconds: float = 0.0
    discard_fraction: float = 0.0  # dropped / (dropped + delivered) samples, the run so far
    dropped_samples: int = 0
    delivered_samples: int = 0
    initial_eval: float | None = None
    final_eval: float | None = None
    # [step, wall seconds since the loop started, eval/reward] for every evaluation, and the
    # first and last evaluation's full metrics (pass@k, mean@k with eval.n_samples).
    eval_curve: list = field(default_factory=list)
    eval_first: dict = field(default_factory=dict)
    eval_last: dict = field(default_factory=dict)
    useful_tokens: int = 0
    trained_samples: int = 0  # samples in the collections the trainer took
    max_staleness: int = 0
    staleness_sum: int = 0
    staleness_groups: int = 0
    nonfinite_updates: int = 0  # skipped by the trainer (rl_async/train/guard.py)
    length_ks: float = 0.0  # rollout/length_ks as last reported (the run so far)
    phase: str = "starting"
    bound: str = ""  # which side bounds the loop, once measured (rl_async/loop/threads.py)

    def collection_metrics(self, groups: list[Group], wait: float, version: int,
                           elapsed: float) -> dict[str, float]:
        """Count one trained collection; its rollout and perf rows."""
        rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
        ages = [g.age_at_delivery for g in groups if g.age_at_delivery is not None]
        self.version = version
        self.reward = sum(rewards) / max(1, len(rewards))
        self.staleness = sum(ages) / len(ages) if ages else 0.0
        self.max_staleness = max([self.max_staleness, *ages])
        self.staleness_sum += sum(ages)
        self.staleness_groups += len(ages)
        self.trainer_wait_seconds += wait
        self.useful_tokens += sum(g.response_tokens for g in groups)
        elapsed = max(1e-9, elapsed)
        return {"rollout/reward_mean": self.reward, "train/trainer_wait_seconds": wait,
                "perf/useful_tokens_per_s": self.useful_tokens / elapsed,
                "perf/trainer_wait_fraction": self.trainer_wait_seconds / elapsed,
                "policy/version": float(version)}

    def count_discards(self, metrics: dict[str, float]) -> None:
        """The run's discard fraction so far (the progress line's), from the buffer's
        windowed counts that this collection's metrics carry; and the run's length KS."""
        self.dropped_samples += int(metrics.get(COMPLETED_QUEUE_PREFIX + "dropped_samples", 0))
        self.delivered_samples += int(metrics.get(COMPLETED_QUEUE_PREFIX + "delivered_samples",
                                                  0))
        decided = self.dropped_samples + self.delivered_samples
        self.discard_fraction = self.dropped_samples / decided if decided else 0.0
        self.length_ks = metrics.get("rollout/length_ks", self.length_ks)


# What a checkpoint keeps of the progress, so that a resumed run's summary is the whole run's
# (steps and the ledger were; time, throughput, the eval curve and the guard's count restarted
# at zero). `wall_seconds` is saved beside them: the loop's clock continues from it.
CUMULATIVE = ("initial_eval", "eval_curve", "eval_first", "useful_tokens", "trained_samples",
              "max_staleness", "staleness_sum", "staleness_groups", "nonfinite_updates",
              "trainer_wait_seconds", "dropped_samples", "delivered_samples", "discard_fraction")


def cumulative_state(p: Progress, wall_seconds: float) -> dict:
    return {**{name: getattr(p, name) for name in CUMULATIVE}, "wall_seconds": wall_seconds}


def orchestration_metrics(step_s: float, wait_s: float, train_s: float, publish_s: float,
                          updates: int) -> dict[str, float]:
    """The controller loop's own time in one collection: everything but waiting for the
    collection, training and the awaited part of publication (metrics gathering, logging,
    bookkeeping), per optimizer update. Trainer wait high with this low: generation is the
    bottleneck; this high: orchestration is."""
    own = max(0.0, step_s - wait_s - train_s - publish_s)
    return {"perf/orchestration_seconds_per_step": own / updates,
            "perf/publication_wait_seconds_per_step": publish_s / updates,
            "perf/orchestration_fraction": own / step_s if step_s > 0 else 0.0,
            "perf/step_seconds": step_s / updates}
