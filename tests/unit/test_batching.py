"""MicroBatcher: one batched call per tick, per-item results as they stream, errors per item."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.base.batching import BatchIncomplete, MicroBatcher, as_finished


def test_requests_of_one_tick_share_one_call_and_resolve_as_they_finish():
    calls: list[list] = []

    async def send(items):
        calls.append(list(items))
        # finish in reverse order, one per tick: each waiter resolves on its own result
        for i in reversed(range(len(items))):
            await asyncio.sleep(0)
            yield [(i, items[i] * 10)]

    async def main():
        b = MicroBatcher(send)
        order = []

        async def one(x):
            order.append(await b.submit(x))

        await asyncio.gather(*(one(x) for x in range(5)))
        await b.submit(7)  # a later tick: a new call
        return order

    order = asyncio.run(main())
    assert calls == [[0, 1, 2, 3, 4], [7]]
    assert order == [40, 30, 20, 10, 0]


def test_an_item_error_fails_that_item_only_and_a_stream_error_fails_the_rest():
    async def send(items):
        yield [(0, ValueError("bad request 0")), (1, "ok")]
        raise ConnectionError("actor died")

    async def main():
        b = MicroBatcher(send)
        return await asyncio.gather(*(b.submit(x) for x in range(3)), return_exceptions=True)

    r0, r1, r2 = asyncio.run(main())
    assert isinstance(r0, ValueError) and r1 == "ok" and isinstance(r2, ConnectionError)


def test_a_missing_result_is_an_error_not_a_hang():
    async def send(items):
        yield [(0, "a")]

    async def main():
        b = MicroBatcher(send)
        return await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)

    a, missing = asyncio.run(main())
    assert a == "a" and isinstance(missing, BatchIncomplete)


def test_as_finished_coalesces_forwards_item_errors_and_raises_others():
    async def value(x, ticks):
        for _ in range(ticks):
            await asyncio.sleep(0)
        if x == "err":
            raise KeyError("item")
        if x == "fatal":
            raise RuntimeError("bug")
        return x

    async def collect(calls, forward):
        return [batch async for batch in as_finished(calls, forward)]

    batches = asyncio.run(collect([value("a", 0), value("b", 0), value("err", 3)], (KeyError,)))
    assert sorted(i for i, _ in batches[0]) == [0, 1]  # the same tick: one list
    assert isinstance(batches[-1][0][1], KeyError)
    with pytest.raises(RuntimeError, match="bug"):
        asyncio.run(collect([value("fatal", 0)], (KeyError,)))
