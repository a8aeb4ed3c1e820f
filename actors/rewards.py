"""Reward actor: runs the configured reward function (`module:function`, sync or async)
with its timeout, bounded retries and concurrency cap (rl_async.algo.rewards.RewardRunner).

With `judge.enabled` it grades through the run's Ray Serve judge deployment instead (started
by the fleet before this actor), under the judge's own timeout and retries."""

from __future__ import annotations

import asyncio

import ray

from rl_async.plan.config import RunConfig
from rl_async.algo.judging import judge_app_name
from rl_async.loop.monitor import LoopMonitor
from rl_async.algo.rewards import RewardRunner, load_callable
from rl_async.algo.tasks import default_reward_path, load_tokenizer
from rl_async.base.types import Sample


@ray.remote(num_cpus=0)
class RewardActor:
    def __init__(self, cfg: RunConfig):
        r, j = cfg.reward, cfg.judge
        self.monitor = LoopMonitor()
        # Text tasks: responses are decoded once here, for reward functions and judges.
        self.tokenizer = load_tokenizer(cfg.model)
        if j.enabled:
            from actors.judges import judge_scorer  # imports Ray Serve only when judging

            app = judge_app_name(cfg.run.name)
            self.runner = RewardRunner(judge_scorer(app), f"judge {j.judge_class} (Serve app "
                                       f"{app!r})", j.timeout_s, j.max_retries, r.concurrency)
            return
        path = r.function or default_reward_path(cfg.task)
        self.runner = RewardRunner(load_callable(path), path, r.timeout_s, r.max_retries,
                                   r.concurrency)

    async def score(self, sample: Sample) -> float:
        self.monitor.ensure_started()
        if self.tokenizer is not None:
            sample.metadata["response_text"] = self.tokenizer.decode(
                sample.response_ids, skip_special_tokens=True)
        return await self.runner.score(sample)

    async def score_batch(self, samples: list[Sample]) -> list:
        """Many samples in one actor call. The reward function's contract is unchanged (one
        sample in, one float out, sync or async): each sample is scored on its own,
        concurrently under reward.concurrency, and a sample's RewardError is returned in its
        place, failing only that sample's group."""
        self.monitor.ensure_started()
        return await asyncio.gather(*(self.score(s) for s in samples),
                                    return_exceptions=True)

    def metrics(self) -> dict[str, float]:
        return {**self.runner.metrics(), **self.monitor.metrics("reward")}
