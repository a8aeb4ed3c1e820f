"""What the controller loop reports as it goes: its progress (the driver's status line and
the summary read it) and its own share of each step's time."""

from __future__ import annotations

from dataclasses import dataclass, field


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
