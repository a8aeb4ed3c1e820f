"""Simulated multi-turn trajectories (SPEC §12) for the simulated fleet: the producer runs
them through the same `trajectory.run(sample, generate)` hook as a real environment, so its
permits, gating and sticky routing are the real ones; the environment is the calibrated
turn structure (rl_async.sim.timings.TurnTiming): its seconds after each turn on the virtual
clock and its tokens between turns (context for the next turn's prefill, never sampled)."""

from __future__ import annotations

import asyncio
import math
import random

from rl_async.base.types import Sample
from rl_async.loop.trajectory import TrajectoryResult, TurnGenerate
from rl_async.sim.timings import TurnTiming


class SimTrajectory:
    def __init__(self, timing: TurnTiming, rng: random.Random, max_response_len: int,
                 max_trajectory_tokens: int | None):
        self.timing, self.rng = timing, rng
        self.max_response_len, self.budget = max_response_len, max_trajectory_tokens

    def _turns(self) -> int:
        low = max(1, math.floor(self.timing.turns_mean))
        return low + int(self.rng.random() < self.timing.turns_mean - low)

    async def run(self, sample: Sample, generate: TurnGenerate, slot=None) -> TrajectoryResult:
        turns, t = self._turns(), self.timing
        gap = max(0, round(t.env_tokens_per_gap))
        sample.response_ids, sample.behavior_logprobs = [], []
        sample.token_versions, sample.loss_mask, sample.turns = [], [], 0
        finish, sampled, env_s = "done", 0, 0.0
        for turn in range(turns):
            room = self.max_response_len
            if self.budget is not None:
                room = min(room, self.budget - len(sample.prompt_ids) - len(sample.response_ids))
            if room < 1:
                finish = "max_tokens"
                break
            out = await generate(sample.prompt_ids + sample.response_ids, room, turn)
            sample.turns += 1
            if out.finish_reason == "abort":
                return TrajectoryResult("abort", sample.turns, env_s, sampled, len(out.output_ids))
            n = len(out.output_ids)
            sampled += n
            sample.response_ids += out.output_ids
            sample.behavior_logprobs += out.output_logprobs
            sample.token_versions += out.token_versions
            sample.loss_mask += [1] * n
            if t.env_seconds_per_turn:
                await asyncio.sleep(t.env_seconds_per_turn)
                env_s += t.env_seconds_per_turn
            if turn + 1 < turns and gap:
                sample.response_ids += [1] * gap
                sample.behavior_logprobs += [0.0] * gap
                sample.token_versions += [-1] * gap
                sample.loss_mask += [0] * gap
        sample.reward = float(self.rng.random() < 0.5)
        sample.finish_reason = finish
        return TrajectoryResult(finish, sample.turns, env_s, sampled)
