"""The learning-rate schedule both trainer backends follow (train.lr_schedule)."""

from __future__ import annotations

import math


def lr_at(config, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) for a config with `lr`,
    `lr_schedule`, `total_steps` and `min_lr_ratio`: a pure function of the step, so a
    restored checkpoint continues the schedule exactly."""
    if config.lr_schedule == "constant":
        return config.lr
    progress = min(step / config.total_steps, 1.0)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
