"""Runs an agent environment's rollouts against the gateway (the same interface as
TrajectoryRunner: the producer and the evaluation call `run`).

    open a trajectory on the gateway --> env.rollout(row, endpoint) under the watchdog
        --> close it (later calls refused, in-flight ones cancelled)
        --> infrastructure? abort (regenerated) | failure? fail the group | reward

Time: `task.env_timeout_s` bounds each stretch the environment holds control (from the
rollout's start or the end of a model call to the next call or the return), never model time
or publication pauses; past it the rollout is cancelled and the group fails.
`task.trajectory_timeout_s` bounds the whole trajectory: later calls answer empty and the
trajectory ends truncated ("timeout"), scored with the reward the environment returns.

Infrastructure is not the policy: a call the gateway refused, a call whose client went away
mid-call, an engine lost past the producer's turn retries, a transport error the
environment let through, or an `InfrastructureError` it raised for a tool service: the
trajectory is aborted and its group regenerated through the ledger, whatever reward the
environment returned.

Environments scored per group (`rollout_group(rows, endpoints) -> rewards`, e.g. verifiers
rubrics with group reward functions) run once per group: each sibling registers its
trajectory and the last to arrive starts the one call (the producer submits every sibling of
an opened group, so the rendezvous completes).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

from rl_async.algo.chat import ChatRenderer
from rl_async.algo.environments import (SYNC_FIX, EnvironmentFailure, InfrastructureError,
                                        check_score, row_of)
from rl_async.base import clock
from rl_async.base.types import Sample
from rl_async.loop.agent import AgentTrajectory, Endpoint
from rl_async.loop.trajectory import GroupSlot, TrajectoryLimits, TrajectoryResult, TurnGenerate

# Exceptions that mean the model call failed in transport, not that the policy failed.
_TRANSPORT = {("openai", "APIConnectionError"), ("openai", "APITimeoutError"),
              ("openai", "InternalServerError"), ("httpx", "TransportError"),
              ("aiohttp", "ClientConnectionError"), ("builtins", "ConnectionError")}


def transport_cause(exc: BaseException) -> str | None:
    """The transport error in `exc`'s chain (causes and contexts), described, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for klass in type(exc).__mro__:
            if (klass.__module__.split(".")[0], klass.__name__) in _TRANSPORT:
                return f"a model call failed in transport ({type(exc).__name__}: {exc})"
        exc = exc.__cause__ or exc.__context__
    return None


async def watched(trajectories: list[AgentTrajectory], coroutine, timeout_s: float,
                  where: str, what: str = "rollout"):
    """Await the environment's `coroutine`, cancelling it once it has held control (no model
    call in flight on any of `trajectories`) for `timeout_s` in one stretch."""
    task = asyncio.ensure_future(coroutine)
    changed = asyncio.Event()
    for t in trajectories:
        t.changed = changed
    try:
        while not task.done():
            changed.clear()
            busy = any(t.busy for t in trajectories)
            left = None if busy else max(t.env_since for t in trajectories) + timeout_s - clock.now()
            waiter = asyncio.ensure_future(changed.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=None if left is None else max(0.0, left))
            waiter.cancel()
            if not done:
                raise EnvironmentFailure(
                    f"environment {what} for {where} held control for more than "
                    f"task.env_timeout_s = {timeout_s:g} s without calling the model (the "
                    f"call was cancelled)")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=timeout_s)
    try:
        return task.result()
    except (InfrastructureError, EnvironmentFailure, asyncio.CancelledError):
        raise
    except Exception as exc:
        if (cause := transport_cause(exc)) is not None:
            raise InfrastructureError(f"environment {what} for {where}: {cause}") from exc
        raise EnvironmentFailure(f"environment {what} for {where} raised "
                                 f"{type(exc).__name__}: {exc}") from exc


@dataclass
class _GroupCall:
    size: int
    members: dict[int, tuple[dict, Endpoint, AgentTrajectory]] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future | None = None


class AgentRunner:
    """Runs an agent environment's rollouts against a gateway."""

    def __init__(self, env, renderer: ChatRenderer, limits: TrajectoryLimits, gateway):
        self.env, self.renderer, self.limits, self.gateway = env, renderer, limits, gateway
        self._groups: dict[str, _GroupCall] = {}
        method = "rollout_group" if self._group_scored() else "rollout"
        if not inspect.iscoroutinefunction(getattr(env, method, None)):
            raise EnvironmentFailure(f"the environment's {method} is a plain function; "
                                     f"{SYNC_FIX}")

    def _group_scored(self) -> bool:
        return bool(getattr(self.env, "group_scored", False))

    async def run(self, sample: Sample, generate: TurnGenerate,
                  slot: GroupSlot | None = None) -> TrajectoryResult:
        where = f"row {sample.metadata.get('where', sample.prompt_id)}"
        traj = AgentTrajectory(self.renderer, self.limits, generate,
                               getattr(self.env, "max_turns", None))
        traj.sample = Sample(prompt_id=sample.prompt_id, prompt_ids=[])
        endpoint = await self.gateway.open(traj)
        start = clock.now()
        traj.deadline, traj.env_since = self.limits.deadline(start), start
        try:
            row = row_of(sample.metadata)
            if self._group_scored() and slot is not None:
                reward = await self._in_group(slot, row, endpoint, traj, where)
            elif self._group_scored():  # an evaluation: a group of one
                reward = (await watched([traj], self.env.rollout_group([row], [endpoint]),
                                        self.limits.env_timeout_s, where))[0]
            else:
                reward = await watched([traj], self.env.rollout(row, endpoint),
                                       self.limits.env_timeout_s, where)
        except InfrastructureError as exc:
            if traj.error is not None:  # the 500 the environment saw: an engine's error
                raise traj.error
            return self._aborted(traj, traj.infrastructure() or str(exc))
        except EnvironmentFailure:
            if (cause := traj.infrastructure()) is not None:
                return self._aborted(traj, cause)
            if traj.error is not None:  # an engine or actor error behind a call: as it was
                raise traj.error
            raise
        finally:
            self.gateway.close(endpoint.trajectory_id)
        if (cause := traj.infrastructure()) is not None:
            return self._aborted(traj, cause)
        if traj.error is not None:  # the environment swallowed a failed call
            raise traj.error
        return self._finished(sample, traj, reward, clock.now() - start, where)

    def _aborted(self, traj: AgentTrajectory, reason: str) -> TrajectoryResult:
        return TrajectoryResult("abort", traj.sample.turns, 0.0, traj.sampled, reason=reason)

    def _finished(self, sample: Sample, traj: AgentTrajectory, reward, seconds: float,
                  where: str) -> TrajectoryResult:
        done = traj.sample
        if done.turns == 0:
            if traj.finish == "timeout":
                raise EnvironmentFailure(
                    f"environment rollout for {where}: task.trajectory_timeout_s = "
                    f"{self.limits.trajectory_timeout_s:g} s ran out before its first model call")
            if traj.finish == "max_tokens":
                raise EnvironmentFailure(
                    f"environment rollout for {where}: its first prompt is "
                    f"{len(done.prompt_ids)} tokens and rollout.max_trajectory_tokens = "
                    f"{self.limits.max_trajectory_tokens} leaves no room for a reply")
            raise EnvironmentFailure(f"environment rollout for {where} never called the model "
                                     f"through the gateway")
        reward = check_score(reward, f"{where} (rollout)")
        # Copies, ending at the last sampled token: context no turn answered (a call still in
        # flight when the rollout returned, or past a budget) is not part of the sample, and
        # nothing that reaches the gateway after this can touch it.
        n = max((i + 1 for i, m in enumerate(done.loss_mask) if m), default=0)
        sample.prompt_ids, sample.response_ids = list(done.prompt_ids), done.response_ids[:n]
        sample.behavior_logprobs = done.behavior_logprobs[:n]
        sample.token_versions, sample.loss_mask = done.token_versions[:n], done.loss_mask[:n]
        sample.turns, sample.reward, sample.finish_reason = done.turns, reward, traj.finish
        # The environment's own time: the rollout's wall time less its waits on the model.
        env_seconds = max(0.0, seconds - traj.generate_seconds)
        return TrajectoryResult(traj.finish, done.turns, env_seconds, traj.sampled)

    async def _in_group(self, slot: GroupSlot, row: dict, endpoint: Endpoint,
                        traj: AgentTrajectory, where: str) -> float:
        call = self._groups.setdefault(slot.group_id, _GroupCall(slot.size))
        call.members[slot.index] = (row, endpoint, traj)
        if len(call.members) == call.size:  # the last sibling starts the group's one call
            del self._groups[slot.group_id]
            order = [call.members[i] for i in range(call.size)]
            call.task = asyncio.ensure_future(watched(
                [t for _, _, t in order],
                self.env.rollout_group([r for r, _, _ in order], [e for _, e, _ in order]),
                self.limits.env_timeout_s, f"{where} (its group)", "rollout_group"))
            call.ready.set()
        await call.ready.wait()
        rewards = await asyncio.shield(call.task)
        if not (isinstance(rewards, (list, tuple)) and len(rewards) == call.size):
            raise EnvironmentFailure(f"environment rollout_group for {where} returned "
                                     f"{rewards!r}: expected {call.size} rewards")
        return rewards[slot.index]
