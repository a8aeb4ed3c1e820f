"""One multi-turn trajectory: reset, then assistant turns and environment steps, then score.

    reset(row) -> prompt ids --> [generate turn --> step(messages) --> rendered env tokens]*
               --> score(messages)

The sample it fills is the training sample of SPEC §12: `prompt_ids` from the reset
conversation; `response_ids` the turns back to back, each assistant turn's sampled tokens
(`loss_mask` 1, their log-probs and versions) and each environment turn's rendered tokens
(`loss_mask` 0, log-prob 0, version -1). Every turn's request is the exact token sequence so
far, so the engine continues what it sampled (token-in/token-out: rl_async.algo.chat).

Ends: `done` from the environment; `max_turns` (the environment's max_turns assistant turns
without done: truncated); `max_tokens` (rollout.max_trajectory_tokens, prompt included, leaves
no room for another token: truncated); `timeout` (task.trajectory_timeout_s passed: no new
turn starts; truncated); `abort` (a turn's engine failed past the producer's turn retries:
the group is regenerated from its row, like any aborted sample). Truncated trajectories are
scored and trained like finished ones, and counted. Each environment call runs under
task.env_timeout_s (rl_async.algo.environments.call_env); model time never counts there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from rl_async.algo.chat import ChatRenderer
from rl_async.algo.environments import (EnvironmentFailure, call_env, check_messages,
                                        check_score, check_step, row_of)
from rl_async.algo.seeding import turn_seed
from rl_async.base import clock
from rl_async.base.types import Sample
from rl_async.engine.base import EngineError, GenerateOutput

TRUNCATED = ("max_turns", "max_tokens", "timeout")

# (input_ids, max_new_tokens, turn) -> the engine's output for that turn.
TurnGenerate = Callable[[list[int], int, int], Awaitable[GenerateOutput]]


def turn_request(sample: Sample, input_ids: list[int], turn: int) -> Sample:
    """One turn's generation request: the trajectory's tokens so far, with the turn's own
    sampling seed derived from the sample's (rl_async.algo.seeding)."""
    return Sample(prompt_id=sample.prompt_id, prompt_ids=input_ids,
                  seed=None if sample.seed is None else turn_seed(sample.seed, turn))


@dataclass(frozen=True)
class GroupSlot:
    """Which trajectory of which group a run is (environments scored per group need it)."""

    group_id: str
    index: int
    size: int


@dataclass(frozen=True)
class TrajectoryLimits:
    max_response_len: int                 # tokens per assistant turn
    max_trajectory_tokens: int | None     # prompt + every turn; None = no budget
    env_timeout_s: float                  # each environment call
    trajectory_timeout_s: float | None = None  # the whole trajectory, wall clock

    def deadline(self, start: float) -> float | None:
        return None if self.trajectory_timeout_s is None else start + self.trajectory_timeout_s


@dataclass
class TrajectoryResult:
    finish: str          # "done" | "max_turns" | "max_tokens" | "timeout" | "abort"
    turns: int
    env_seconds: float
    sampled_tokens: int
    aborted_tokens: int = 0
    reason: str = ""     # why an aborted trajectory was aborted (the ledger records it)

    @property
    def truncated(self) -> bool:
        return self.finish in TRUNCATED


class TrajectoryRunner:
    """Runs trajectories of one environment through one renderer."""

    def __init__(self, env, renderer: ChatRenderer, limits: TrajectoryLimits):
        self.env, self.renderer, self.limits = env, renderer, limits

    async def _env(self, method: str, args: tuple, where: str, spent: list[float]):
        start = clock.now()
        try:
            return await call_env(self.env, method, args, self.limits.env_timeout_s, where)
        finally:
            spent[0] += clock.now() - start

    async def run(self, sample: Sample, generate: TurnGenerate,
                  slot: GroupSlot | None = None) -> TrajectoryResult:
        where = f"row {sample.metadata.get('where', sample.prompt_id)}"
        spent = [0.0]
        reset = await self._env("reset", (row_of(sample.metadata),), where, spent)
        if not (isinstance(reset, tuple) and len(reset) == 2):
            raise EnvironmentFailure(f"environment reset for {where} returned {reset!r}: "
                                     f"expected (messages, state)")
        messages, state = reset
        messages = list(check_messages(messages, f"environment reset for {where}"))
        if not messages or messages[-1]["role"] == "assistant":
            raise EnvironmentFailure(f"environment reset for {where}: the conversation must "
                                     f"end with a message the policy answers (user or tool)")
        sample.prompt_ids = self.renderer.prompt_ids(messages)
        sample.response_ids, sample.behavior_logprobs = [], []
        sample.token_versions, sample.loss_mask, sample.turns = [], [], 0
        budget = self.limits.max_trajectory_tokens
        if budget is not None and len(sample.prompt_ids) >= budget:
            raise EnvironmentFailure(
                f"environment reset for {where}: the prompt is {len(sample.prompt_ids)} tokens, "
                f"rollout.max_trajectory_tokens = {budget} leaves no room for a turn")
        finish, sampled = "max_turns", 0
        deadline = self.limits.deadline(clock.now())
        for turn in range(self.env.max_turns):
            if deadline is not None and clock.now() >= deadline:
                finish = "timeout"  # task.trajectory_timeout_s: scored as it stands
                break
            used = len(sample.prompt_ids) + len(sample.response_ids)
            room = self.limits.max_response_len
            if budget is not None:
                room = min(room, budget - used)
            if room < 1:
                finish = "max_tokens"
                break
            out = await generate(sample.prompt_ids + sample.response_ids, room, turn)
            if not (len(out.output_ids) == len(out.output_logprobs) == len(out.token_versions)):
                raise EngineError(f"engine reply for {where} turn {turn} is malformed: "
                                  f"{len(out.output_ids)} tokens, {len(out.output_logprobs)} "
                                  f"log-probs, {len(out.token_versions)} versions")
            sample.turns += 1
            if out.finish_reason == "abort":
                sample.finish_reason = "abort"
                return TrajectoryResult("abort", sample.turns, spent[0], sampled,
                                        len(out.output_ids), "an engine aborted a turn")
            self._append(sample, out.output_ids, out.output_logprobs, out.token_versions, 1)
            sampled += len(out.output_ids)
            messages.append({"role": "assistant",
                             "content": self.renderer.assistant_text(out.output_ids)})
            new, done = check_step(await self._env("step", (messages, state), where, spent),
                                   where)
            if done:
                finish = "done"
                break
            if turn + 1 == self.env.max_turns:
                break  # max_turns: nothing answers the environment's last messages
            ids = self.renderer.continuation_ids(messages, out.output_ids, new)
            if budget is not None and used + len(out.output_ids) + len(ids) >= budget:
                finish = "max_tokens"  # the environment's turn leaves no room to answer it
                break
            messages.extend(new)
            self._append(sample, ids, [0.0] * len(ids), [-1] * len(ids), 0)
        sample.reward = check_score(await self._env("score", (messages, state), where, spent),
                                    where)
        sample.finish_reason = finish
        return TrajectoryResult(finish, sample.turns, spent[0], sampled)

    @staticmethod
    def _append(sample: Sample, ids, logprobs, versions, mask: int) -> None:
        sample.response_ids.extend(int(t) for t in ids)
        sample.behavior_logprobs.extend(float(x) for x in logprobs)
        sample.token_versions.extend(int(v) for v in versions)
        sample.loss_mask.extend([mask] * len(ids))
