"""The batched put path on real actors: `BufferActor.put_many` streams each group back once the
prompt source's ledger acknowledged it, and a group that must wait for room does not hold the
ones already inserted (their producer permits are released before it blocks)."""

import asyncio

import pytest
import ray

from test_end_to_end import small

pytestmark = pytest.mark.ray


def generated(group, version=0):
    for s in group.samples:
        s.response_ids, s.token_versions = [5, 6], [version] * 2
        s.behavior_logprobs, s.reward, s.finish_reason = [-0.1, -0.2], 1.0, "stop"
    return group


async def next_or_none(stream, timeout_s):
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout_s)
    except asyncio.TimeoutError:
        return None


def test_put_many_streams_each_group_after_the_ledger_and_blocks_only_the_overflow(ray_cluster):
    from actors.buffer import BufferActor
    from actors.prompt_source import PromptSourceActor

    # capacity floor(1 x 2) = 2 groups, block on overflow
    cfg, report = small("cluster_configs/local.toml", "rollout.rollout_batch_size=2",
                        "train.global_batch_size=8", "train.micro_batch_size=8",
                        "async.async_data_buffer_capacity_factor=1",
                        "async.async_max_concurrent_samples=8", name="put-many")
    assert report.ok, report.errors
    assert report.plan.completed_buffer_groups == 2
    source = PromptSourceActor.remote(cfg)
    buffer = BufferActor.remote(cfg, report.plan, source)
    groups = [generated(g) for g in ray.get(source.next_groups.remote(3))]

    async def main():
        stream = buffer.put_many.remote(groups)
        ref = await next_or_none(stream, 30)
        assert ref is not None, "the two groups that fit never came back"
        first = await ref
        assert [i for i, _ in first] == [0, 1] and first[-1][1] == 0  # in, buffer now full
        counts = await source.counts.remote()
        assert counts["buffered_groups"] == 2 and counts["in_flight_groups"] == 1
        assert await next_or_none(stream, 1.0) is None  # the third waits for room
        taken = await buffer.get.remote(2, 0)
        assert [g.group_id for g in taken] == [g.group_id for g in groups[:2]]
        ref = await next_or_none(stream, 30)
        assert ref is not None, "the third group was never inserted after room was made"
        assert [i for i, _ in await ref] == [2]
        with pytest.raises(StopAsyncIteration):  # every group answered: the stream ends
            await asyncio.wait_for(stream.__anext__(), 30)
        return await source.counts.remote()

    counts = asyncio.run(main())
    assert counts["delivered_groups"] == 2 and counts["buffered_groups"] == 1
    assert counts["unaccounted"] == 0
    for actor in (buffer, source):
        ray.kill(actor)


def test_a_cancelled_get_stops_waiting_in_the_buffer_and_takes_nothing(ray_cluster):
    """The controller cancels its collection wait when the run fails; the buffer's own get
    used to wait on, and took the next groups to deliver them to nobody."""
    from actors.buffer import BufferActor
    from actors.fleet import RayFleet
    from actors.prompt_source import PromptSourceActor

    cfg, report = small("cluster_configs/local.toml", "rollout.rollout_batch_size=2",
                        "train.global_batch_size=8", "train.micro_batch_size=8",
                        "async.async_max_concurrent_samples=8", name="cancel-get")
    source = PromptSourceActor.remote(cfg)
    buffer = BufferActor.remote(cfg, report.plan, source)
    fleet = RayFleet.__new__(RayFleet)  # only get_groups: the buffer is all it touches
    fleet.buffer = buffer
    groups = [generated(g) for g in ray.get(source.next_groups.remote(2))]

    async def main():
        waiting = asyncio.ensure_future(fleet.get_groups(2, 0))
        await asyncio.sleep(1.0)  # the get is waiting inside the buffer
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.sleep(1.0)  # the cancellation reaches the buffer actor
        async for ref in buffer.put_many.remote(groups):
            await ref
        await asyncio.sleep(1.0)  # a get still waiting would take them now
        return await buffer.size.remote(), await source.counts.remote()

    size, counts = asyncio.run(main())
    assert size == 2 and counts["delivered_groups"] == 0 and counts["buffered_groups"] == 2
    for actor in (buffer, source):
        ray.kill(actor)
