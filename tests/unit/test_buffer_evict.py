"""CompletedBuffer: evict overflow, eviction rank and tie-breaks, reserved room (SPEC §4, §6)."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.loop.buffer import EVICT_OVERFLOW, EVICT_STALE, CompletedBuffer
from rl_async.base.types import Group, Sample


def grp(gid: str, *versions: list[int]) -> Group:
    samples = [Sample(gid, response_ids=list(range(len(v))), token_versions=list(v))
               for v in (versions or ([0],))]
    return Group(gid, samples)


def run(coro):
    return asyncio.run(coro)


def evicting(cap: int, max_lag: int | None = 100, **kwargs):
    log: list[tuple[str, str]] = []
    buf = CompletedBuffer(cap, max_lag, overflow="evict",
                          on_discard=lambda g, r: log.append((g.group_id, r)), **kwargs)
    return buf, log


async def put_all(buf: CompletedBuffer, *groups: Group) -> None:
    for g in groups:
        await buf.put(g)


async def ids(buf: CompletedBuffer, version: int) -> list[str]:
    return [g.group_id for g in await buf.get(len(buf), version)]


def test_evict_put_never_waits_and_evicts_oldest_version_first():
    async def main():
        buf, log = evicting(2)
        await put_all(buf, grp("v3", [3]), grp("v1", [1]), grp("v2", [2]))
        return log, await ids(buf, 3)
    log, left = run(main())
    assert log == [("v1", EVICT_OVERFLOW)] and left == ["v3", "v2"]


def test_min_token_version_of_the_whole_group_ranks():
    async def main():
        buf, log = evicting(1)
        # "mixed" has a token of version 0 inside a mostly fresh sample: it is the stalest.
        await put_all(buf, grp("mixed", [5, 0, 5]), grp("steady", [1, 1]))
        return log
    assert run(main()) == [("mixed", EVICT_OVERFLOW)]


def test_tie_break_larger_summed_staleness_first():
    async def main():
        buf, log = evicting(1)
        # Same min version 1; sums of per-sample oldest versions: 1+5=6 vs 1+2=3 (staler).
        await put_all(buf, grp("sum6", [1], [5]), grp("sum3", [1], [2]))
        return log
    assert run(main()) == [("sum3", EVICT_OVERFLOW)]


def test_tie_break_earlier_arrival_first():
    async def main():
        buf, log = evicting(2)
        await put_all(buf, grp("first", [2], [2]), grp("second", [2], [2]), grp("third", [2], [2]))
        return log
    assert run(main()) == [("first", EVICT_OVERFLOW)]


def test_unknown_age_ranks_after_every_known_age():
    async def main():
        buf, log = evicting(2)
        await put_all(buf, grp("unknown", []), grp("fresh", [9]), grp("fresh2", [9]))
        await buf.put(grp("unknown2", []))
        return log
    # Known ages go first (earlier arrival breaks the tie); then unknowns by arrival.
    assert run(main()) == [("fresh", EVICT_OVERFLOW), ("fresh2", EVICT_OVERFLOW)]


def test_beyond_lag_groups_evicted_first_even_below_capacity():
    async def main():
        buf, log = evicting(3, max_lag=2)
        buf.set_version(5)  # threshold: oldest < 3 is beyond the lag
        await put_all(buf, grp("a", [1]), grp("b", [2]), grp("c", [4]))
        assert log == []  # under capacity: eviction waits for overflow
        await buf.put(grp("d", [5]))
        return log, await ids(buf, 5)
    log, left = run(main())
    assert log == [("a", EVICT_STALE), ("b", EVICT_STALE)] and left == ["c", "d"]


def test_stale_threshold_uses_last_get_version():
    async def main():
        buf, log = evicting(1, max_lag=1)
        await buf.put(grp("x", [4]))
        await buf.get(1, 4)  # the buffer has now seen version 4
        await put_all(buf, grp("old", [2]), grp("new", [4]))
        return log
    assert run(main()) == [("old", EVICT_STALE)]


def test_no_version_seen_means_nothing_is_beyond_the_lag():
    async def main():
        buf, log = evicting(1, max_lag=0)
        await put_all(buf, grp("a", [0]), grp("b", [0]))
        return log
    assert run(main()) == [("a", EVICT_OVERFLOW)]


def test_newly_put_group_can_be_the_one_evicted():
    async def main():
        inserted: list[str] = []
        buf, log = evicting(1, on_insert=lambda g: inserted.append(g.group_id))
        await put_all(buf, grp("fresh", [7]), grp("stale", [1]))
        return inserted, log
    assert run(main()) == (["fresh", "stale"], [("stale", EVICT_OVERFLOW)])


def test_many_evictions_stay_consistent_after_compaction():
    async def main():
        buf, log = evicting(4)
        for i in range(300):
            await buf.put(grp(f"g{i}", [i % 7], [i % 5]))
        left = await buf.get(4, 10)
        return len(log), sorted(g.oldest_version() for g in left)
    n, oldest = run(main())
    assert n == 296 and oldest == [4, 4, 4, 4]  # max of min(i % 7, i % 5)


# --- reserved room --------------------------------------------------------------------------
def test_reserve_lets_owned_completions_in_beyond_capacity():
    async def main():
        buf = CompletedBuffer(1, max_lag=3)
        await buf.put(grp("a"))
        pending = asyncio.create_task(buf.put(grp("b")))
        await asyncio.sleep(0)
        assert not pending.done()
        buf.reserve(2)  # an evaluation drain: the producer owns two completions
        await pending
        await buf.put(grp("c"))
        assert len(buf) == 3 and buf.reserved == 2
        assert buf.release_reserve() == 0
        blocked = asyncio.create_task(buf.put(grp("d")))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not blocked.done()  # 3 resident > capacity 1: waits until back under it
        await buf.get(3, 0)
        await blocked
        return await ids(buf, 0)
    assert run(main()) == ["d"]


def test_a_second_drain_reserves_room_above_groups_left_by_the_first():
    async def main():
        buf = CompletedBuffer(1, max_lag=3)
        await buf.put(grp("a"))
        buf.reserve(2)  # first drain: two owned completions land above capacity
        await buf.put(grp("b"))
        await buf.put(grp("c"))
        buf.release_reserve()
        buf.reserve(1)  # second drain, nothing consumed in between: one more must fit
        await asyncio.wait_for(buf.put(grp("d")), 1.0)
        return len(buf)
    assert run(main()) == 4


def test_reserve_raises_the_evict_limit():
    async def main():
        buf, log = evicting(1)
        buf.reserve(1)
        await put_all(buf, grp("a", [1]), grp("b", [2]))
        assert log == []
        buf.release_reserve(1)
        await buf.put(grp("c", [3]))
        return log
    assert run(main()) == [("a", EVICT_OVERFLOW), ("b", EVICT_OVERFLOW)]


def test_release_more_than_reserved_is_an_error():
    buf = CompletedBuffer(1, max_lag=1)
    buf.reserve(1)
    with pytest.raises(ValueError, match="only 1 groups are reserved"):
        buf.release_reserve(2)
    with pytest.raises(ValueError, match="reserve"):
        buf.reserve(-1)
