"""The core's clock: wall time in a real run, virtual time inside the simulator.

A real run reads `time.monotonic()`, exactly as before this module existed (Ray's async
actors run on uvloop, whose `loop.time()` is libuv's cached, millisecond-resolution loop
time: not what the core's measurements should depend on). The simulator (`rl-async
simulate`) runs the same classes on rl_async.sim.virtual_loop, whose `time()` is virtual and
jumps to the next timer when every task is blocked; there `now()` is that virtual time, so the
controller's trainer wait, the producer's generation time and the publication's pause
seconds come out in simulated seconds.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    loop = asyncio._get_running_loop()  # None outside a loop; never raises
    if loop is not None and getattr(loop, "virtual_clock", False):
        return loop.time()
    return time.monotonic()
