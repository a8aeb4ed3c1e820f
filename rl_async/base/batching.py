"""Fewer actor calls per sample: coalesce the calls made in one event-loop tick.

The producer's core stays per sample (each sample holds its own producer permit and HTTP
permit, and frees them when its own result arrives), so every SPEC §4 limit stays exact. The
actor shell sends those per-sample requests through a `MicroBatcher`: every request submitted
in the same event-loop tick (a group's siblings admitted together, samples backfilled at the
same moment) goes out as ONE batched call, and its results come back as a stream, so each
sample resolves as soon as it is finished, not when the slowest of its batch is.

    submit(item) -> pending (this tick) --call_soon flush--> send_batch(items)
        --> async stream of [(index, result | exception), ...] --> each item's future

`send_batch` yields lists of `(index, value)`; a value that is an exception fails only its
item (a rejected request fails its group, not the batch). An exception raised by the stream
itself (a dead actor) fails every unfinished item of the batch with it. Work per item is O(1).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable


class BatchIncomplete(RuntimeError):
    """A batched call ended without a result for an item: a bug in the callee."""


class MicroBatcher:
    def __init__(self, send_batch: Callable[[list], AsyncIterator[list[tuple[int, Any]]]],
                 max_batch: int = 512):
        self._send = send_batch
        self.max_batch = max_batch
        self._items: list = []
        self._futures: list[asyncio.Future] = []
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0
        self.items = 0

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._items.append(item)
        self._futures.append(future)
        if len(self._items) == 1:
            loop.call_soon(self._flush)  # after every request of this tick is queued
        elif len(self._items) >= self.max_batch:
            self._flush()
        return await future

    def _flush(self) -> None:
        if not self._items:
            return
        items, futures = self._items, self._futures
        self._items, self._futures = [], []
        self.batches += 1
        self.items += len(items)
        task = asyncio.get_running_loop().create_task(self._run(items, futures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list, futures: list[asyncio.Future]) -> None:
        try:
            async for results in self._send(items):
                for index, value in results:
                    future = futures[index]
                    if future.done():  # the submitter was cancelled
                        continue
                    if isinstance(value, BaseException):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
        except BaseException as exc:  # noqa: BLE001 -- not swallowed: every waiter gets it
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for i, future in enumerate(futures):
            if not future.done():
                future.set_exception(BatchIncomplete(
                    f"batched call returned no result for item {i} of {len(items)}"))

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/batches": float(self.batches), f"{prefix}/batched_items": float(self.items)}


async def as_finished(calls: list, forward: tuple[type[BaseException], ...] = (Exception,)
                      ) -> AsyncIterator[list[tuple[int, Any]]]:
    """Run awaitables concurrently; yield `(index, result)` lists as they finish, coalescing
    the ones that finish in the same tick. An exception of a `forward` type is yielded as that
    item's value (it belongs to the item); any other propagates. Leaving early cancels the
    rest (the callee frees their resources, e.g. an engine aborts the requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def one(index: int, call) -> None:
        try:
            value = await call
        except forward as exc:  # the item's own failure: forwarded to its waiter
            value = exc
        except BaseException as exc:  # noqa: BLE001 -- re-raised below by the consumer
            queue.put_nowait((index, exc, True))
            return
        queue.put_nowait((index, value, False))

    tasks = [asyncio.ensure_future(one(i, c)) for i, c in enumerate(calls)]
    try:
        remaining = len(tasks)
        while remaining:
            first = await queue.get()
            batch = [first]
            while not queue.empty():
                batch.append(queue.get_nowait())
            for _, value, fatal in batch:
                if fatal:
                    raise value
            remaining -= len(batch)
            yield [(i, v) for i, v, _ in batch]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
