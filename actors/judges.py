"""Judges as an autoscaled Ray Serve deployment, and a rule-based judge that runs on CPU.

The judge interface: a class whose constructor takes keyword arguments (`judge.kwargs`) and
whose instances have `grade(sample: Sample) -> float`, sync or async. `JudgeServer` is the
Serve deployment body that hosts one instance per replica; Serve scales replicas between
`judge.min_replicas` and `judge.max_replicas` to keep about `judge.target_ongoing_requests`
per replica, and never gives a replica more than `judge.max_ongoing_requests` at once (the
rest queue at the caller's handle). Only deployment handles call it: Serve runs without an
HTTP proxy. `judge_scorer` is the reward path's side: an async function of one sample, to be
wrapped in RewardRunner for the judge's timeout and bounded retries.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle

from rl_async.algo.judging import DEPLOYMENT_NAME, JudgeDeployment
from rl_async.algo.rewards import load_callable
from rl_async.algo.successor import successor_reward
from rl_async.base.types import Sample


class JudgeError(RuntimeError):
    """A judge replica raised; the message carries the judge's own exception."""


class RuleJudge:
    """CPU judge for the built-in tasks: 1.0 when the response starts with the prompt's
    `answer_ids` (the successor task's rule), else 0.0.

    `latency_s` sleeps (never computes) before answering, standing in for a model judge's
    service time so autoscaling can be shown on a laptop without burning CPU."""

    def __init__(self, latency_s: float = 0.0):
        if latency_s < 0:
            raise ValueError(f"judge.kwargs.latency_s = {latency_s}: must be >= 0")
        self.latency_s = latency_s

    async def grade(self, sample: Sample) -> float:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if "answer_ids" not in sample.metadata:
            raise KeyError(f"prompt {sample.prompt_id!r} has no 'answer_ids' metadata for "
                           f"RuleJudge; use a task whose prompts carry answers")
        return successor_reward(sample)


class JudgeServer:
    """One replica: hosts one judge instance. `judge_class` is a 'module:Class' path (as in
    the run file) or the class itself."""

    def __init__(self, judge_class: str | type, kwargs: dict[str, Any]):
        cls = (load_callable(judge_class, "judge.judge_class") if isinstance(judge_class, str)
               else judge_class)
        self.judge = cls(**kwargs)
        self._grade = getattr(self.judge, "grade", None)
        if not callable(self._grade):
            raise TypeError(f"judge.judge_class = {judge_class!r}: instances have no "
                            f"grade(sample) -> float method")

    async def grade(self, sample: Sample) -> float:
        if inspect.iscoroutinefunction(self._grade):
            return await self._grade(sample)
        # A sync grader runs in a thread so one slow call never blocks the replica's loop.
        return await asyncio.to_thread(self._grade, sample)


def deploy_judge(dep: JudgeDeployment, judge_class: str | type | None = None
                 ) -> DeploymentHandle:
    """Deploy (or update) the judge application and return its handle once min_replicas are
    running. `judge_class` overrides `dep.judge_class` with a class object (tests)."""
    if isinstance(dep.judge_class, str) and judge_class is None:
        # Fail here with the key named, not after Serve's replica-constructor retries.
        load_callable(dep.judge_class, "judge.judge_class")
    # Handles only: no HTTP proxy, no port to collide with other runs on the cluster.
    serve.start(proxy_location="Disabled")
    app = serve.deployment(JudgeServer).options(
        name=DEPLOYMENT_NAME,
        max_ongoing_requests=dep.max_ongoing_requests,
        autoscaling_config=dict(dep.autoscaling),
        ray_actor_options=dict(dep.ray_actor_options),
    ).bind(judge_class or dep.judge_class, dep.judge_kwargs)
    return serve.run(app, name=dep.app_name, route_prefix=None)


def delete_judge(app_name: str) -> None:
    """Remove the run's judge application (its replicas); Serve itself stays for other apps."""
    if app_name in serve.status().applications:
        serve.delete(app_name)


def judge_replicas(app_name: str) -> int:
    """Replicas of the judge deployment now RUNNING (0 when the app does not exist)."""
    app = serve.status().applications.get(app_name)
    if app is None or DEPLOYMENT_NAME not in app.deployments:
        return 0
    states = app.deployments[DEPLOYMENT_NAME].replica_states
    return sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")


def judge_scorer(app_name: str) -> Callable[[Sample], Awaitable[float]]:
    """The reward path's call into the judge: `await scorer(sample)` -> the grade."""
    handle = serve.get_app_handle(app_name)

    async def score(sample: Sample) -> float:
        response = handle.grade.remote(sample)
        try:
            return await response
        except asyncio.CancelledError:
            # RewardRunner's timeout cancelled us: free the replica's slot too.
            response.cancel()
            raise
        except RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise JudgeError(f"judge replica of {app_name!r} raised "
                             f"{type(cause).__name__}: {cause}") from None

    return score
