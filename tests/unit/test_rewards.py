"""Reward functions by import path: sync/async, timeouts, bounded retries, clear errors."""

import asyncio

import pytest

from rl_async.algo.rewards import RewardError, RewardRunner, load_callable
from rl_async.base.types import Sample


def test_load_callable_errors_name_the_key():
    assert load_callable("rl_async.algo.tasks:successor_reward").__name__ == "successor_reward"
    with pytest.raises(ValueError, match="reward.function = 'nocolon'"):
        load_callable("nocolon")
    with pytest.raises(ValueError, match="cannot import module"):
        load_callable("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_callable("rl_async.algo.tasks:nope")


def run(runner, sample=None):
    return asyncio.run(runner.score(sample or Sample("p0")))


def test_sync_and_async_functions():
    assert run(RewardRunner(lambda s: 0.5, "f", 5, 0, 4)) == 0.5

    async def af(s):
        return 1
    assert run(RewardRunner(af, "af", 5, 0, 4)) == 1.0


def test_retries_then_success():
    calls = []

    def flaky(s):
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("transient")
        return 1.0
    r = RewardRunner(flaky, "flaky", 5, 2, 4)
    assert run(r) == 1.0 and r.retries == 2 and r.failures == 0


def test_exhausted_retries_name_function_prompt_and_cause():
    def broken(s):
        raise ValueError("bad grader")
    r = RewardRunner(broken, "pkg:broken", 5, 1, 4)
    with pytest.raises(RewardError, match=r"pkg:broken failed on prompt 'p0' after 2 attempt"):
        run(r)
    assert r.failures == 1


def test_timeout_and_non_numbers_are_failures():
    async def slow(s):
        await asyncio.sleep(5)
    with pytest.raises(RewardError, match="timed out after 0.05s"):
        run(RewardRunner(slow, "slow", 0.05, 0, 4))
    for bad in (None, "1", float("nan"), True):
        with pytest.raises(RewardError, match="must be a finite number"):
            run(RewardRunner(lambda s, b=bad: b, "bad", 5, 0, 4))
