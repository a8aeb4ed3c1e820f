"""An asyncio event loop whose clock is virtual: when every task is blocked, time jumps to the
next timer instead of sleeping.

asyncio's own `_run_once` already computes "how long until the next timer" and passes it to
the selector as the select timeout. The virtual selector below has no file descriptors to
wait on: it advances the loop's clock by that timeout and returns no events, so the timer
that was due fires at once. Everything else (tasks, futures, `asyncio.wait_for`, events,
semaphores) is asyncio's own code, which is why the core's classes run unchanged.

    ready callbacks? --yes--> run them (time stands still)
          | no
    next timer at t --> clock := t --> run it
          | none
    deadlock: nothing can ever wake up -> SimulationDeadlock (a real run would hang here)

The core reads time through rl_async.base.clock.now(), i.e. this loop's `time()`, so trainer wait,
generation and publication seconds come out in simulated seconds. Threads, subprocesses and
sockets do not exist in simulated time: the simulated fleet uses none.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: the simulated system can never progress."""


class _VirtualSelector(selectors.BaseSelector):
    """Holds registrations (asyncio registers its self-pipe) but never waits on them."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualClockLoop | None = None

    def register(self, fileobj, events, data=None):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout=None):
        if timeout is None:
            raise SimulationDeadlock(
                "simulation deadlock: every task is waiting and no timer is scheduled (a real "
                "run would hang here)")
        if timeout > 0:
            self.loop.advance(timeout)
        return []

    def get_map(self):
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """`time()` starts at 0 and only moves when the loop would otherwise sleep."""

    virtual_clock = True  # rl_async.base.clock.now() reads this loop's time, not the wall clock

    def __init__(self) -> None:
        selector = _VirtualSelector()
        self._virtual_now = 0.0
        super().__init__(selector)
        selector.loop = self
        # Timers due within this much of "now" run in the same iteration; the virtual clock
        # lands exactly on a timer, so only float rounding has to be absorbed.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        # Land on the next timer exactly (now + (when - now) can round just below `when`).
        target = self._virtual_now + seconds
        if self._scheduled:
            target = max(target, min(target + 1e-9, self._scheduled[0]._when))
        self._virtual_now = target


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh virtual-clock loop; returns its result."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_all(loop)
        finally:
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
