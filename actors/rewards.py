"""Reward actor: runs the configured reward function (`module:function`, sync or async)
with its timeout, bounded retries and concurrency cap (rl_async.algo.scoring.SampleScorer),
when reward.placement resolves to "actor" (user code that may block; judges).

With `judge.enabled` it grades through the run's Ray Serve judge deployment instead (started
by the fleet before this actor), under the judge's own timeout and retries."""

from __future__ import annotations

import ray

from rl_async.plan.config import RunConfig
from rl_async.algo.judging import judge_app_name
from rl_async.algo.rewards import RewardRunner
from rl_async.algo.scoring import SampleScorer
from rl_async.loop.monitor import LoopMonitor
from rl_async.base.types import Sample


@ray.remote(num_cpus=0)
class RewardActor:
    def __init__(self, cfg: RunConfig):
        r, j = cfg.reward, cfg.judge
        self.monitor = LoopMonitor()
        runner = None
        if j.enabled:
            from actors.judges import judge_scorer  # imports Ray Serve only when judging

            app = judge_app_name(cfg.run.name)
            runner = RewardRunner(judge_scorer(app), f"judge {j.judge_class} (Serve app "
                                  f"{app!r})", j.timeout_s, j.max_retries, r.concurrency)
        # Text tasks: responses are decoded once here, for reward functions and judges.
        self.scorer = SampleScorer.from_config(cfg, runner)

    async def score(self, sample: Sample) -> float:
        self.monitor.ensure_started()
        return await self.scorer.score(sample)

    async def score_batch(self, samples: list[Sample]) -> list:
        """Many samples in one actor call. The reward function's contract is unchanged (one
        sample in, one float out, sync or async); a sample's RewardError is returned in its
        place, failing only that sample's group."""
        self.monitor.ensure_started()
        return await self.scorer.score_batch(samples)

    def metrics(self) -> dict[str, float]:
        return {**self.scorer.metrics(), **self.monitor.metrics("reward")}
