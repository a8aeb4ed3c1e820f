"""Event-loop lag and busy fraction: a blocked loop shows lag, an idle one does not."""

from __future__ import annotations

import asyncio
import time

from rl_async.loop.monitor import CpuMeter, LoopMonitor, aggregate


def test_a_blocked_loop_shows_lag_and_busy_time_an_idle_one_does_not():
    async def main():
        mon = LoopMonitor(interval_s=0.01)
        mon.ensure_started()
        await asyncio.sleep(0.1)
        idle = mon.metrics("x")
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # hog the loop thread: one long block
            pass
        await asyncio.sleep(0.05)
        busy = mon.metrics("x")
        mon.stop()
        return idle, busy

    idle, busy = asyncio.run(main())
    # the block shows as lag of at least its length; no bound on the idle lag itself (a
    # loaded machine delays an idle loop too)
    lag, idle_lag = busy["x/loop_lag_max_s"], idle["x/loop_lag_max_s"]
    assert lag >= 0.45 and lag > idle_lag
    assert busy["x/busy_fraction"] > idle["x/busy_fraction"]
    assert set(idle) == {"x/loop_lag_mean_s", "x/loop_lag_max_s", "x/busy_fraction"}


def test_cpu_meter_and_aggregate():
    meter = CpuMeter()
    end = time.monotonic() + 0.05
    while time.monotonic() < end:
        pass
    assert meter.metrics("s")["s/busy_fraction"] > 0
    agg = aggregate([{"e/0/busy_fraction": 0.2}, {"e/1/busy_fraction": 0.6}], "engines")
    assert agg == {"engines/busy_fraction_mean": 0.4, "engines/busy_fraction_max": 0.6}
