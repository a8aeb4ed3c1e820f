"""CompletedBuffer: construction, order, blocking, staleness at dequeue, cancellation (SPEC §6)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rl_async.loop.buffer import BufferClosedError, CompletedBuffer
from rl_async.base.types import Group, Sample


def grp(gid: str, *versions: list[int] | None, attempt: int = 0) -> Group:
    """A group with one sample per `versions` entry; each token gets the listed version."""
    samples = [Sample(gid, response_ids=list(range(len(v or []))), token_versions=list(v or []))
               for v in (versions or ([0],))]
    return Group(gid, samples, attempt=attempt)


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


# --- construction ---------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_capacity_must_be_positive_int(cap):
    with pytest.raises(ValueError, match="capacity_groups"):
        CompletedBuffer(cap, max_lag=1)


def test_zero_capacity_error_names_the_config_fix():
    with pytest.raises(ValueError, match="async_data_buffer_capacity_factor"):
        CompletedBuffer(0, max_lag=1)


@pytest.mark.parametrize("kwargs, key", [
    ({"order": "random"}, "order"), ({"overflow": "drop"}, "overflow"),
    ({"max_lag": -1}, "max_lag"),
])
def test_bad_settings_name_the_key(kwargs, key):
    args = {"capacity_groups": 2, "max_lag": 1, **kwargs}
    with pytest.raises(ValueError, match=key):
        CompletedBuffer(**args)


# --- order ----------------------------------------------------------------------------------
@pytest.mark.parametrize("order, expected", [("fifo", ["a", "b", "c"]), ("lifo", ["c", "b", "a"])])
def test_order(order, expected):
    async def main():
        buf = CompletedBuffer(5, max_lag=3, order=order)
        for gid in "abc":
            await buf.put(grp(gid))
        return [g.group_id for g in await buf.get(3, 0)]
    assert run(main()) == expected


def test_arrival_seq_and_len():
    async def main():
        buf = CompletedBuffer(5, max_lag=3)
        a, b = grp("a"), grp("b")
        await buf.put(a)
        await buf.put(b)
        assert len(buf) == 2 and a.arrival_seq < b.arrival_seq
        await buf.get(1, 0)
        assert len(buf) == 1
    run(main())


# --- blocking -------------------------------------------------------------------------------
def test_block_put_waits_for_room_then_inserts():
    async def main():
        buf = CompletedBuffer(1, max_lag=3)
        await buf.put(grp("a"))
        pending = asyncio.create_task(buf.put(grp("b")))
        await settle()
        assert not pending.done() and len(buf) == 1
        assert [g.group_id for g in await buf.get(1, 0)] == ["a"]
        await settle()
        assert pending.done() and len(buf) == 1
        assert [g.group_id for g in await buf.get(1, 0)] == ["b"]
    run(main())


def test_cancelled_put_inserts_nothing():
    async def main():
        inserted = []
        buf = CompletedBuffer(1, max_lag=3, on_insert=inserted.append)
        await buf.put(grp("a"))
        pending = asyncio.create_task(buf.put(grp("b")))
        await settle()
        pending.cancel()
        await settle()
        assert pending.cancelled()
        await buf.get(1, 0)
        await settle()
        assert len(buf) == 0 and [g.group_id for g in inserted] == ["a"]
    run(main())


def test_woken_then_cancelled_putter_passes_its_wakeup_on():
    async def main():
        buf = CompletedBuffer(1, max_lag=3)
        await buf.put(grp("a"))
        first = asyncio.create_task(buf.put(grp("b")))
        second = asyncio.create_task(buf.put(grp("c")))
        await settle()
        await buf.get(1, 0)  # wakes `first` only (one slot of room)
        first.cancel()  # cancelled after being woken, before it ran
        await settle()
        assert first.cancelled() and second.done()
        assert [g.group_id for g in await buf.get(1, 0)] == ["c"]
    run(main())


def test_get_larger_than_capacity_completes_as_producer_refills():
    async def main():
        buf = CompletedBuffer(2, max_lag=3)
        consumer = asyncio.create_task(buf.get(5, 0))
        for i in range(5):
            await buf.put(grp(f"g{i}"))  # never blocks for long: the get takes as they come
        return await consumer
    assert [g.group_id for g in run(main())] == [f"g{i}" for i in range(5)]


def test_get_waits_until_n_groups():
    async def main():
        buf = CompletedBuffer(4, max_lag=3)
        await buf.put(grp("a"))
        consumer = asyncio.create_task(buf.get(2, 0))
        await settle()
        assert not consumer.done() and buf.held == 1 and len(buf) == 0
        await buf.put(grp("b"))
        return await consumer
    assert [g.group_id for g in run(main())] == ["a", "b"]


@pytest.mark.parametrize("n", [0, -2])
def test_get_needs_positive_n(n):
    with pytest.raises(ValueError, match="n_groups"):
        run(CompletedBuffer(2, max_lag=1).get(n, 0))


# --- cancellation of get --------------------------------------------------------------------
@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_cancelled_get_returns_groups_in_order(order):
    async def main():
        buf = CompletedBuffer(5, max_lag=3, order=order)
        for gid in "abc":
            await buf.put(grp(gid))
        consumer = asyncio.create_task(buf.get(5, 0))
        await settle()
        assert buf.held == 3 and len(buf) == 0
        await buf.put(grp("d"))  # arrives while the get waits; the get takes it too
        await settle()
        consumer.cancel()
        await settle()
        assert consumer.cancelled() and len(buf) == 4 and buf.held == 0
        out = await buf.get(4, 0)
        assert all(g.age_at_delivery == 0 for g in out)
        return [g.group_id for g in out]
    expected = {"fifo": list("abcd"), "lifo": list("dcba")}[order]
    assert run(main()) == expected


def test_cancelled_get_restores_position_among_later_arrivals_lifo():
    async def main():
        buf = CompletedBuffer(5, max_lag=3, order="lifo")
        await buf.put(grp("a"))
        consumer = asyncio.create_task(buf.get(2, 0))
        await settle()
        consumer.cancel()
        await buf.put(grp("b"))  # arrives after the cancel is requested, before it runs
        await settle()
        return [g.group_id for g in await buf.get(2, 0)]
    assert run(main()) == ["b", "a"]  # freshest first: "a" is back in its arrival place


def test_refused_delivery_puts_groups_back():
    async def main():
        def refuse(groups):
            raise RuntimeError("owner refused")
        buf = CompletedBuffer(3, max_lag=3, on_deliver=refuse)
        await buf.put(grp("a"))
        with pytest.raises(RuntimeError, match="owner refused"):
            await buf.get(1, 0)
        assert len(buf) == 1
        (g,) = buf.drain_all()
        assert g.group_id == "a" and g.age_at_delivery is None
    run(main())


# --- staleness at dequeue -------------------------------------------------------------------
def test_stale_groups_discarded_when_reached_and_fresh_delivered():
    async def main():
        discarded = []
        buf = CompletedBuffer(5, max_lag=2,
                              on_discard=lambda g, r: discarded.append((g.group_id, r)))
        await buf.put(grp("old", [1, 1], [3]))  # oldest 1 -> age 4 at version 5
        await buf.put(grp("edge", [3]))  # age 2 == lag: kept
        await buf.put(grp("unknown", []))  # no versions: never stale
        await buf.put(grp("new", [5]))
        out = await buf.get(3, 5)
        return [(g.group_id, g.age_at_delivery) for g in out], discarded, len(buf)
    out, discarded, left = run(main())
    assert out == [("edge", 2), ("unknown", None), ("new", 0)]
    assert discarded == [("old", "stale")] and left == 0


def test_stale_group_not_discarded_before_a_get_reaches_it():
    async def main():
        discarded = []
        buf = CompletedBuffer(5, max_lag=0, order="lifo",
                              on_discard=lambda g, r: discarded.append(g.group_id))
        await buf.put(grp("old", [0]))
        await buf.put(grp("new", [3]))
        out = await buf.get(1, 3)
        return [g.group_id for g in out], discarded, len(buf)
    assert run(main()) == (["new"], [], 1)


def test_no_lag_limit_never_discards():
    async def main():
        buf = CompletedBuffer(2, max_lag=None)
        await buf.put(grp("a", [0]))
        return [g.age_at_delivery for g in await buf.get(1, 100)]
    assert run(main()) == [100]


def test_token_newer_than_version_is_an_error_and_moves_nothing():
    async def main():
        buf = CompletedBuffer(2, max_lag=3)
        await buf.put(grp("a", [4]))
        with pytest.raises(ValueError, match="newer than the current version 2"):
            await buf.get(1, 2)
        assert len(buf) == 1 and buf.held == 0
    run(main())


def test_version_regression_refused():
    async def main():
        buf = CompletedBuffer(2, max_lag=3)
        buf.set_version(4)
        with pytest.raises(ValueError, match="older than version 4"):
            await buf.get(1, 3)
        with pytest.raises(ValueError, match="older than version 4"):
            buf.set_version(2)
    run(main())


def test_duplicate_attempt_refused_but_a_new_attempt_accepted():
    async def main():
        buf = CompletedBuffer(3, max_lag=3)
        g = grp("a", [0])
        await buf.put(g)
        with pytest.raises(ValueError, match="already in the buffer"):
            await buf.put(grp("a", [0]))
        await buf.put(g.fresh_attempt())
        assert len(buf) == 2
    run(main())


def test_put_rejects_non_groups():
    with pytest.raises(TypeError, match="Group"):
        run(CompletedBuffer(2, max_lag=1).put("not a group"))


# --- close ----------------------------------------------------------------------------------
def test_close_fails_waiting_put_and_get_with_reason():
    async def main():
        full = CompletedBuffer(1, max_lag=3)
        await full.put(grp("a"))
        putter = asyncio.create_task(full.put(grp("b")))
        empty = CompletedBuffer(1, max_lag=3)
        getter = asyncio.create_task(empty.get(1, 0))
        await settle()
        full.close(RuntimeError("producer 3 died"))
        empty.close("shutdown")
        with pytest.raises(BufferClosedError, match="producer 3 died"):
            await putter
        with pytest.raises(BufferClosedError, match="shutdown"):
            await getter
        assert len(full) == 1
        with pytest.raises(BufferClosedError):
            await full.put(grp("c"))
        with pytest.raises(BufferClosedError):
            await full.get(1, 0)
    run(main())


def test_closed_get_returns_taken_groups_and_drain_all_gets_everything():
    async def main():
        buf = CompletedBuffer(4, max_lag=3)
        for gid in "ab":
            await buf.put(grp(gid))
        getter = asyncio.create_task(buf.get(3, 0))
        await settle()
        await buf.put(grp("c"))  # the get takes it when it runs next
        buf.close("shutdown")
        drained = buf.drain_all()  # held groups included even before the get has run
        with pytest.raises(BufferClosedError):
            await getter
        return [g.group_id for g in drained], len(buf), buf.held
    assert run(main()) == (["a", "b", "c"], 0, 0)


def test_buffer_closed_error_pickles():
    err = pickle.loads(pickle.dumps(BufferClosedError("closed (shutdown)")))
    assert isinstance(err, BufferClosedError) and "shutdown" in str(err)
