"""The core's clock: the running event loop's time, so one core runs under two clocks.

A real run's loop is asyncio's default, whose `time()` is `time.monotonic()`; the simulator
(`rl-async simulate`) runs the same classes on rl_async.sim.virtual_loop, whose `time()` is
virtual and jumps to the next timer when every task is blocked. Reading the loop's time
instead of `time.monotonic()` is what lets the controller's trainer wait, the producer's
generation time and the publication's pause seconds come out in simulated seconds there,
unchanged in a real run. Outside a loop (plain synchronous callers) it is `time.monotonic()`.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # no running loop: a synchronous caller
        return time.monotonic()
