"""Reward functions by import path: sync/async, timeouts, bounded retries, clear errors."""

import asyncio

import pytest

from rl_async.algo.rewards import RewardError, RewardRunner, inline_safe, load_callable
from rl_async.algo.scoring import SampleScorer, reward_placement
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


def test_inline_safe_functions_run_on_the_loop_thread_and_keep_retries():
    import threading

    threads = []

    def plain(s):
        threads.append(threading.get_ident())
        return 1.0

    marked = inline_safe(lambda s: threads.append(threading.get_ident()) or 1.0)
    assert run(RewardRunner(plain, "plain", 5, 0, 4)) == 1.0
    assert run(RewardRunner(marked, "marked", 5, 0, 4)) == 1.0
    # the plain function ran in a worker thread, the marked one on the caller's thread
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()
    calls = []
    flaky = inline_safe(lambda s: calls.append(1) or (1.0 if len(calls) > 1 else None))
    r = RewardRunner(flaky, "flaky", 5, 1, 4)
    assert run(r) == 1.0 and r.retries == 1
    with pytest.raises(RewardError, match="must be a finite number"):
        run(RewardRunner(inline_safe(lambda s: None), "none", 5, 0, 4))


def test_reward_placement_puts_only_marked_verifiers_in_the_producer():
    from rl_async.plan.checks import validate
    from rl_async.plan.load import load_config

    def placement(*overrides):
        return reward_placement(load_config("cluster_configs/local.toml", list(overrides)))

    assert placement() == "producer"  # the built-in successor verifier
    assert placement("reward.function=rl_async.algo.tasks:exact_match_reward") == "producer"
    # user code (unmarked) and judges stay in the reward actor; an explicit choice wins
    assert placement("reward.function=rl_async.algo.math_reward:math_reward") == "actor"
    assert placement("judge.enabled=true") == "actor"
    assert placement("reward.placement=actor") == "actor"
    assert placement("reward.function=rl_async.algo.math_reward:math_reward",
                     "reward.placement=producer") == "producer"
    cfg = load_config("cluster_configs/local.toml", ["judge.enabled=true",
                                                     "reward.placement=producer"])
    assert any("reward.placement = 'producer' with judge.enabled" in e
               for e in validate(cfg).errors)


def test_scorer_decodes_text_for_the_reward_and_returns_errors_in_place():
    class Tok:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    def reward(s):
        if not s.response_ids:
            raise ValueError("empty")
        return 1.0 if s.metadata["response_text"] == "4 2" else 0.0

    scorer = SampleScorer(RewardRunner(reward, "r", 5, 0, 4), Tok())
    good, empty = Sample("a", response_ids=[4, 2]), Sample("b", response_ids=[])
    out = asyncio.run(scorer.score_batch([good, empty]))
    assert out[0] == 1.0 and isinstance(out[1], RewardError) and "prompt 'b'" in str(out[1])
    assert scorer.metrics()["reward/failures"] == 1


def test_inline_safe_refuses_an_async_function():
    """An async reward is never called inline: marking one must fail, not do nothing."""
    async def graded(sample):
        return 1.0

    with pytest.raises(TypeError, match="async function: only a plain def"):
        inline_safe(graded)
    assert not hasattr(graded, "rl_async_inline_safe")
