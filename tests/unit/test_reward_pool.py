"""A sync reward call that times out is stopped, not abandoned: it runs in a worker process
that the timeout kills (reward.isolation = "process", the default), so retries cannot pile up
stuck threads; math-verify's own timeouts work there (a worker's main thread)."""

from __future__ import annotations

import asyncio
import threading

import psutil
import pytest

from rl_async.algo.reward_pool import ProcessCallPool, RewardCallError, WorkerLost
from rl_async.algo.rewards import RewardError
from rl_async.algo.scoring import SampleScorer
from rl_async.base.types import Sample
from rl_async.plan.load import load_config


def scorer(function: str, *extra: str) -> SampleScorer:
    cfg = load_config("cluster_configs/dev.toml", [f"reward.function={function}",
                                                   "reward.timeout_s=0.5",
                                                   "reward.max_retries=2", *extra])
    return SampleScorer.from_config(cfg)


def alive_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE}


def test_a_hung_sync_reward_is_killed_on_timeout_and_leaves_no_thread_behind():
    threads, children = threading.active_count(), alive_children()
    s = scorer("chaos_rewards:hangs")
    with pytest.raises(RewardError, match="after 3 attempt"):
        asyncio.run(s.score(Sample(prompt_id="p0", prompt_ids=[1])))
    assert threading.active_count() == threads  # no thread still inside the grader
    assert s.metrics()["reward/workers_killed"] == 3  # one per attempt
    assert alive_children() <= children  # and no process either


def test_the_thread_isolation_abandons_the_call_as_documented():
    threads = threading.active_count()
    s = scorer("chaos_rewards:hangs", "reward.isolation=thread", "reward.max_retries=0")

    async def go():
        with pytest.raises(RewardError):
            await s.score(Sample(prompt_id="p0", prompt_ids=[1]))
        return threading.active_count()

    assert s.runner.pool is None
    assert asyncio.run(go()) > threads  # the timed-out call runs on in its thread


def test_workers_are_reused_and_a_raising_function_keeps_its_worker():
    async def go():
        pool = ProcessCallPool("rl_async.algo.tasks:exact_match_reward", 2)
        sample = Sample(prompt_id="p", prompt_ids=[1], response_ids=[5],
                        metadata={"answer_ids": [5]})
        values = [await pool.call(sample, 30) for _ in range(3)]
        with pytest.raises(RewardCallError, match="AttributeError"):
            await pool.call("not a sample", 30)
        values.append(await pool.call(sample, 30))
        pool.close()
        return values, pool.started

    values, started = asyncio.run(go())
    assert values == [1.0] * 4 and started == 1


def test_a_worker_that_dies_is_reported_and_replaced():
    async def go():
        pool = ProcessCallPool("chaos_rewards:dies", 1)
        with pytest.raises(WorkerLost, match="exit code 3"):
            await pool.call(Sample(prompt_id="p", prompt_ids=[1]), 30)
        with pytest.raises(WorkerLost):  # the next call gets a fresh worker (which dies too)
            await pool.call(Sample(prompt_id="p", prompt_ids=[1]), 30)
        return pool.started

    assert asyncio.run(go()) == 2


def test_math_verify_grades_in_a_worker_with_its_own_timeouts():
    pytest.importorskip("math_verify")
    s = scorer("rl_async.algo.math_reward:math_reward", "reward.timeout_s=60")
    assert s.runner.pool is not None
    sample = Sample(prompt_id="m0", prompt_ids=[1], metadata={
        "answer": "0.5", "response_text": "so the answer is \\boxed{\\frac{1}{2}}"})
    assert asyncio.run(s.runner.score(sample)) == 1.0
