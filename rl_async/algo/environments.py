"""Multi-turn environments (SPEC §12): the protocol, loading one from `task.env`, and its rows.

An environment is any object with

    async reset(row) -> (messages, state)          the conversation to start from
    async step(messages, state) -> (new, done)     after every assistant turn: tool results or
                                                   the next user turn; done ends the trajectory
    async score(messages, state) -> float          the trajectory's reward
    max_turns: int                                 assistant turns at most

or, for an environment that runs its own loop and calls the model through an OpenAI client
(the gateway, rl_async.loop.agent), any object with

    async rollout(row, endpoint) -> float          the whole episode, and its reward
    max_turns: int (optional)                      model calls at most

made by `factory(**task.env_args)`, where `task.env` is "package.module:factory" or
"path/to/file.py:factory". The methods must be `async def`: a call past `task.env_timeout_s`
is cancelled, and so stops (a plain function would have to run in a worker thread, which a
timeout can only abandon, running on forever; such an environment is refused at load with
the fix). Whatever an environment raises or returns wrong becomes an `EnvironmentFailure`
quoting the call, the row and the cause, which fails that group only (the failure budget
decides whether the run goes on).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any

from rl_async.algo.tasks import ROLES, DatasetError, Prompt, jsonl_rows


class EnvironmentFailure(RuntimeError):
    """An environment call raised, timed out or returned something outside the protocol."""


class InfrastructureError(RuntimeError):
    """A failure outside the policy (a refused or lost model call, a sandbox or tool service
    down): the trajectory is aborted and regenerated from its row, never scored. An
    environment raises it for a tool failure that is not the policy's doing."""


class EnvironmentLoadError(ValueError):
    """`task.env` does not name a usable environment factory."""


def import_target(spec: str):
    """The object named by "pkg.module:attr" or "path/to/file.py:attr"."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(f"task.env = {spec!r}: expected 'package.module:factory' or "
                                   f"'path/to/file.py:factory'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise EnvironmentLoadError(f"task.env = {spec!r}: file {str(path)!r} not found")
        name = f"rl_async_env_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module  # dataclasses and pickling look modules up by name
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EnvironmentLoadError(f"task.env = {spec!r}: cannot import {module_name!r} "
                                       f"({exc})") from None
    if not hasattr(module, attr):
        raise EnvironmentLoadError(f"task.env = {spec!r}: {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def load_environment(spec: str, args: dict[str, Any] | None = None):
    """`factory(**args)` of `task.env`, checked against the protocol."""
    factory = import_target(spec)
    try:
        env = factory(**(args or {}))
    except Exception as exc:
        raise EnvironmentLoadError(f"task.env = {spec!r}: the factory raised "
                                   f"{type(exc).__name__}: {exc} (task.env_args = {args!r})"
                                   ) from exc
    missing = [m for m in ("reset", "step", "score") if not callable(getattr(env, m, None))]
    if missing and not is_agent(env):
        raise EnvironmentLoadError(f"task.env = {spec!r}: the environment lacks {missing} "
                                   f"(SPEC §12: reset, step, score and max_turns; or rollout "
                                   f"for one that calls the model through the gateway)")
    for method in (("rollout",) if is_agent(env) else ("reset", "step", "score")):
        if not inspect.iscoroutinefunction(getattr(env, method)):
            raise EnvironmentLoadError(f"task.env = {spec!r}: {method} is a plain function; "
                                       f"{SYNC_FIX}")
    turns = getattr(env, "max_turns", None)
    if is_agent(env) and turns is None:
        return env  # a gateway environment may leave turns to the token budget
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
        raise EnvironmentLoadError(f"task.env = {spec!r}: max_turns = {turns!r}; the "
                                   f"environment must say how many assistant turns it allows "
                                   f"(an int >= 1)")
    return env


def is_agent(env) -> bool:
    """An environment that drives the model itself through the gateway (`rollout`)."""
    return callable(getattr(env, "rollout", None))


SYNC_FIX = ("environment methods must be `async def`, so that task.env_timeout_s stops a "
            "call that runs past it (a blocking function in a worker thread cannot be stopped, "
            "only abandoned); await async clients, and run blocking tools in a subprocess "
            "(asyncio.create_subprocess_exec), which cancellation kills")


async def call_env(env, method: str, args: tuple, timeout_s: float, where: str) -> Any:
    """`env.method(*args)` under the timeout, which cancels the call (its coroutine stops at
    its next await); any failure is an EnvironmentFailure naming `where` (the row) and the
    call."""
    fn = getattr(env, method)
    if not inspect.iscoroutinefunction(fn):
        raise EnvironmentFailure(f"environment {method} for {where} is a plain function; "
                                 f"{SYNC_FIX}")
    try:
        return await asyncio.wait_for(fn(*args), timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentFailure(f"environment {method} for {where} took more than "
                                 f"task.env_timeout_s = {timeout_s:g} s (the call was "
                                 f"cancelled)") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise EnvironmentFailure(f"environment {method} for {where} raised "
                                 f"{type(exc).__name__}: {exc}") from exc


def check_messages(messages: Any, where: str, roles: tuple[str, ...] = ROLES) -> list[dict]:
    if not isinstance(messages, list):
        raise EnvironmentFailure(f"{where}: expected a list of messages, got "
                                 f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in roles
                and isinstance(m.get("content"), str)):
            raise EnvironmentFailure(f"{where}: message {i} = {m!r}: needs a role in {roles} "
                                     f"and a string content")
    return messages


def check_step(result: Any, where: str) -> tuple[list[dict], bool]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bool)):
        raise EnvironmentFailure(f"environment step for {where} returned {result!r}: expected "
                                 f"(new_messages, done: bool)")
    return check_messages(result[0], f"environment step for {where}", ("user", "tool")), \
        result[1]


def check_score(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvironmentFailure(f"environment score for {where} returned {value!r}: expected a "
                                 f"finite number")
    return float(value)


def env_rows(path: str | Path) -> list[Prompt]:
    """The rows of `task.path` for an environment: each JSON object is handed to `reset` as
    is (a deep copy per trajectory). `id` names the row; otherwise its file and line do."""
    p = Path(path)
    prompts = []
    for where, row in jsonl_rows(p):
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompts.append(Prompt(prompt_id=str(row.get("id", where)), prompt_ids=[],
                              metadata={"row": row, "where": where}))
    if not prompts:
        raise DatasetError(f"task.path = {str(p)!r}: no rows in the file")
    return prompts


def row_of(metadata: dict) -> dict:
    """A private copy of a sample's row: an environment may mutate what it is handed."""
    return copy.deepcopy(metadata["row"])
