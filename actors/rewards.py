"""Reward actor: runs the configured reward function (`module:function`, sync or async)
with its timeout, bounded retries and concurrency cap (rl_async.rewards.RewardRunner)."""

from __future__ import annotations

import ray

from rl_async.config import RunConfig
from rl_async.rewards import RewardRunner, load_callable
from rl_async.tasks import default_reward_path
from rl_async.types import Sample


@ray.remote(num_cpus=0)
class RewardActor:
    def __init__(self, cfg: RunConfig):
        path = cfg.reward.function or default_reward_path(cfg.task)
        r = cfg.reward
        self.runner = RewardRunner(load_callable(path), path, r.timeout_s, r.max_retries,
                                   r.concurrency)

    async def score(self, sample: Sample) -> float:
        return await self.runner.score(sample)

    def metrics(self) -> dict[str, float]:
        return self.runner.metrics()
