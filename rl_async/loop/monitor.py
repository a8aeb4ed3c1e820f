"""Where an actor's time goes: event-loop lag and busy fraction (pure, no Ray).

An asyncio actor serves every call from one event loop. When the loop is busy, calls queue
behind each other and every limit looks "full" while GPUs idle. Two numbers tell it apart
from a slow GPU:

- lag: how late a probe that sleeps `interval_s` wakes up (mean and max over the window). A
  loop that keeps up has lag near 0; a saturated one has lag of the order of its backlog.
- busy fraction: CPU seconds of the loop's thread / wall seconds, over the window. Near 1
  means this actor is the bottleneck (one Python thread cannot go faster).

`LoopMonitor.metrics(prefix)` returns the window and starts a new one. `CpuMeter` gives the
busy fraction of a synchronous actor (its calls run on one thread) from process CPU time.
"""

from __future__ import annotations

import asyncio
import time


class LoopMonitor:
    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._reset(time.monotonic(), time.thread_time())

    def _reset(self, now: float, cpu: float) -> None:
        self._lag_sum, self._lag_max, self._probes = 0.0, 0.0, 0
        self._t0 = self._t_last = now
        self._cpu0 = self._cpu_last = cpu

    def ensure_started(self) -> None:
        """Start probing on the running loop (call from any coroutine of the actor)."""
        if self._task is None or self._task.done():
            self._reset(time.monotonic(), time.thread_time())
            self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            lag = max(0.0, now - start - self.interval_s)
            self._lag_sum += lag
            self._lag_max = max(self._lag_max, lag)
            self._probes += 1
            # thread_time() here is the loop thread's CPU clock (the probe runs on it).
            self._t_last, self._cpu_last = now, time.thread_time()

    def metrics(self, prefix: str) -> dict[str, float]:
        wall = self._t_last - self._t0
        out = {f"{prefix}/loop_lag_mean_s": self._lag_sum / self._probes if self._probes else 0.0,
               f"{prefix}/loop_lag_max_s": self._lag_max,
               f"{prefix}/busy_fraction": ((self._cpu_last - self._cpu0) / wall
                                           if wall > 0 else 0.0)}
        self._lag_sum, self._lag_max, self._probes = 0.0, 0.0, 0
        self._t0, self._cpu0 = self._t_last, self._cpu_last
        return out

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class CpuMeter:
    """Busy fraction of a process whose calls run on one thread: CPU seconds / wall seconds."""

    def __init__(self) -> None:
        self._t0, self._cpu0 = time.monotonic(), time.process_time()

    def metrics(self, prefix: str) -> dict[str, float]:
        now, cpu = time.monotonic(), time.process_time()
        wall = now - self._t0
        busy = (cpu - self._cpu0) / wall if wall > 0 else 0.0
        self._t0, self._cpu0 = now, cpu
        return {f"{prefix}/busy_fraction": busy}


def aggregate(per_actor: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Many actors of one role (engines) -> mean and max of each of their metrics."""
    by_name: dict[str, list[float]] = {}
    for metrics in per_actor:
        for key, value in metrics.items():
            by_name.setdefault(key.rsplit("/", 1)[-1], []).append(value)
    out: dict[str, float] = {}
    for name, values in by_name.items():
        out[f"{prefix}/{name}_mean"] = sum(values) / len(values)
        out[f"{prefix}/{name}_max"] = max(values)
    return out
