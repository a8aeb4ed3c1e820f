"""Advantage estimators and their registry."""

import math

import pytest

from rl_async.algo.advantages import (advantage_names, get_advantage_fn, group_advantages,
                                 group_normalized, mean_only, register_advantage_fn)
from rl_async.base.types import Group, Sample


def test_group_norm_uses_population_std():
    rewards = [0.0, 1.0, 1.0, 2.0]
    mean, std = 1.0, math.sqrt(0.5)           # population: Σ(r−mean)² / n = 2/4
    assert group_normalized(rewards) == pytest.approx([(r - mean) / (std + 1e-6)
                                                       for r in rewards])


def test_group_norm_constant_and_single_groups_are_zero():
    assert group_normalized([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_normalized([5.0]) == [0.0]
    assert group_normalized([]) == []


def test_mean_only():
    assert mean_only([0.0, 1.0, 2.0]) == pytest.approx([-1.0, 0.0, 1.0])


def test_registry_lookup_and_unknown_name_lists_allowed():
    assert get_advantage_fn("group_norm") is group_normalized
    assert get_advantage_fn("mean_only") is mean_only
    with pytest.raises(ValueError, match=r"'grpo_typo'.*group_norm.*mean_only"):
        get_advantage_fn("grpo_typo")


def test_register_custom_estimator_and_refuse_duplicates():
    name = "test_rank_only"
    if name not in advantage_names():
        register_advantage_fn(name, lambda rs: [float(r > 0) for r in rs])
    groups = [Group("g", [Sample("g", reward=1.0), Sample("g", reward=-1.0)])]
    assert group_advantages(groups, name) == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_fn("group_norm", mean_only)


def test_group_advantages_per_group_and_missing_reward():
    groups = [Group("a", [Sample("a", reward=0.0), Sample("a", reward=1.0)]),
              Group("b", [Sample("b", reward=3.0), Sample("b", reward=3.0)])]
    out = group_advantages(groups, "mean_only")
    assert out == [[-0.5, 0.5], [0.0, 0.0]]
    bad = [Group("c", [Sample("c", reward=1.0), Sample("c", reward=None)])]
    with pytest.raises(ValueError, match=r"group 'c' sample 1 has reward None"):
        group_advantages(bad)
