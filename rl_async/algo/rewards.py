"""Reward functions by import path, sync or async, with timeouts and bounded retries.

A reward function takes a `Sample` and returns a float (or an awaitable of one). Loading is
by `module:function` so a run file can name user code. A function that raises, times out
or returns a non-number is retried `max_retries` times (exponential backoff with jitter), then
`RewardError` names the function, the prompt and the last cause; the producer marks that group
failed with the error (it is never dropped silently).

Where a call runs decides what a timeout can stop: an async function is cancelled on its
event loop; a sync one runs in a worker process that the timeout kills
(`reward.isolation = "process"`, rl_async.algo.reward_pool), or in a worker thread
(`"thread"`: for functions that must share the process's state; the timeout then stops only
the wait, and the thread runs on).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import random
from typing import Any, Callable

from rl_async.base.types import Sample


class RewardError(RuntimeError):
    """A reward function failed after its retries."""


def load_callable(path: str, key: str = "reward.function") -> Callable[..., Any]:
    """`module:function` -> the function; errors name the key and what is wrong."""
    if ":" not in path:
        raise ValueError(f"{key} = {path!r}: expected 'module:function'")
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key} = {path!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{key} = {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{key} = {path!r}: {attr!r} is not callable")
    return fn


def inline_safe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward function as pure, CPU-light and non-blocking (microseconds: comparing
    tokens or strings). It is then called directly on the caller's event loop (no worker-thread
    hop; a call that cannot block needs no timeout) and, under reward.placement = "auto",
    inside the producer rather than the reward actor: no actor round trip per batch of samples.
    Never mark a function that does I/O, calls a model or may take milliseconds. An `async
    def` is refused: it may await, so it is never called inline, and a mark that did nothing
    would be silently lost."""
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"@inline_safe on {getattr(fn, '__qualname__', fn)!r}, an async "
                        f"function: only a plain def (pure, microseconds, no I/O) can run "
                        f"inline; remove @inline_safe or make it a plain def")
    fn.rl_async_inline_safe = True
    return fn


def is_inline_safe(fn: Callable[..., Any]) -> bool:
    return (bool(getattr(fn, "rl_async_inline_safe", False))
            and not inspect.iscoroutinefunction(fn))


def backoff_s(attempt: int, base: float = 0.1, cap: float = 5.0) -> float:
    """Exponential backoff with full jitter before retry `attempt + 1`: a judge service that
    is down is not hammered in lockstep by every sample (a new call to a Serve handle also
    goes to another replica when the last one died)."""
    return random.uniform(0, min(cap, base * 2 ** attempt))


class RewardRunner:
    """Runs one reward function with a timeout and bounded retries, under a concurrency cap."""

    def __init__(self, fn: Callable[..., Any], name: str, timeout_s: float, max_retries: int,
                 concurrency: int, pool=None):
        self.fn = fn
        self.pool = pool  # a ProcessCallPool of `name` for a sync function, or None (thread)
        self.inline = is_inline_safe(fn)
        self.name = name
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._sem = asyncio.Semaphore(concurrency)
        self.calls = 0
        self.retries = 0
        self.failures = 0

    async def _call_once(self, sample: Sample) -> float:
        if self.inline:  # marked pure and microseconds: the thread hop costs 50x the call
            value = self.fn(sample)
        elif inspect.iscoroutinefunction(self.fn):
            value = await asyncio.wait_for(self.fn(sample), self.timeout_s)
        elif self.pool is not None:  # a worker process that a timeout kills
            value = await self.pool.call(sample, self.timeout_s)
        else:
            # A sync function runs in a worker thread so a slow grader never blocks the loop.
            value = await asyncio.wait_for(asyncio.to_thread(self.fn, sample), self.timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"returned {value!r}; a reward must be a finite number")
        return float(value)

    async def score(self, sample: Sample) -> float:
        last: BaseException | None = None
        async with self._sem:
            for attempt in range(self.max_retries + 1):
                self.calls += 1
                try:
                    return await self._call_once(sample)
                except asyncio.TimeoutError:
                    last = TimeoutError(f"timed out after {self.timeout_s}s")
                except Exception as exc:  # user code: any failure is retried, then reported
                    last = exc
                if attempt < self.max_retries:
                    self.retries += 1
                    await asyncio.sleep(backoff_s(attempt))
        self.failures += 1
        raise RewardError(
            f"reward function {self.name} failed on prompt {sample.prompt_id!r} after "
            f"{self.max_retries + 1} attempt(s): {type(last).__name__}: {last}")

    def metrics(self) -> dict[str, float]:
        return {"reward/calls": self.calls, "reward/retries": self.retries,
                "reward/failures": self.failures,
                **(self.pool.metrics() if self.pool is not None else {})}
