"""Cancellation-safe FIFO waiters for asyncio (the wakeup pattern of asyncio.Queue).

Split out of rl_async.loop.buffer: the completed buffer parks its waiting putters and getters here.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Waiters:
    """FIFO waiters whose wakeups survive cancellation (the pattern of asyncio.Queue)."""

    def __init__(self) -> None:
        self._futures: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._futures)

    async def wait(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Woken, then cancelled before running: hand the wakeup to the next waiter,
                # or the room it announced would go unused while others keep waiting.
                self.wake(1)
            elif fut in self._futures:
                self._futures.remove(fut)
            raise

    def wake(self, n: int) -> None:
        while n > 0 and self._futures:
            fut = self._futures.popleft()
            if not fut.done():
                fut.set_result(None)
                n -= 1

    def wake_all(self) -> None:
        self.wake(len(self._futures))
