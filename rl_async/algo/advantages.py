"""Advantage estimators over one group's rewards, pluggable by name (SPEC §8).

An estimator maps the rewards of one group (the `n_samples_per_prompt` responses to one
prompt) to one advantage per response; the trainer broadcasts it to the response's tokens.

- `group_norm` (default): `(R − mean_group R) / (std_group R + 1e-6)`, with the POPULATION
  standard deviation (divide by n, not n − 1). SPEC §8 does not say which; the population
  form is defined for a group of one (advantage 0) and matches GRPO implementations that
  use `torch.std(unbiased=False)`-style normalisation.
- `mean_only`: `R − mean_group R` (Dr. GRPO-style, no scaling by the spread).

Register another estimator with `register_advantage_fn(name, fn)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rl_async.base.types import Group

AdvantageFn = Callable[[Sequence[float]], list[float]]

STD_EPS = 1e-6
DEFAULT_ESTIMATOR = "group_norm"


def group_normalized(rewards: Sequence[float]) -> list[float]:
    """(R − mean) / (population std + 1e-6) over one group."""
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + STD_EPS) for r in rewards]


def mean_only(rewards: Sequence[float]) -> list[float]:
    """R − mean over one group."""
    n = len(rewards)
    if n == 0:
        return []
    mean = math.fsum(rewards) / n
    return [r - mean for r in rewards]


_REGISTRY: dict[str, AdvantageFn] = {
    "group_norm": group_normalized,
    "mean_only": mean_only,
}


def advantage_names() -> list[str]:
    return sorted(_REGISTRY)


def register_advantage_fn(name: str, fn: AdvantageFn) -> None:
    """Add an estimator under `name`; re-registering an existing name is an error."""
    if name in _REGISTRY:
        raise ValueError(f"advantage estimator {name!r} is already registered; pick another name")
    _REGISTRY[name] = fn


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered as `name`; an unknown name lists the allowed ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"advantage estimator {name!r} is unknown: use one of "
                         f"{advantage_names()}") from None


def group_advantages(groups: Sequence[Group], name: str = DEFAULT_ESTIMATOR
                     ) -> list[list[float]]:
    """One advantage per sample, per group, from the samples' rewards.

    A sample without a reward is an error: training on it would silently use a made-up value.
    """
    fn = get_advantage_fn(name)
    out: list[list[float]] = []
    for group in groups:
        rewards = []
        for i, sample in enumerate(group.samples):
            if sample.reward is None or not math.isfinite(sample.reward):
                raise ValueError(f"group {group.group_id!r} sample {i} has reward "
                                 f"{sample.reward!r}: every trained sample needs a finite reward")
            rewards.append(float(sample.reward))
        advs = fn(rewards)
        if len(advs) != len(rewards):
            raise ValueError(f"advantage estimator {name!r} returned {len(advs)} values for "
                             f"{len(rewards)} rewards in group {group.group_id!r}")
        out.append(list(advs))
    return out
