"""Producer limits (SPEC §4) with in-process fakes for the source, engines, reward and buffer."""

import asyncio
import itertools

import pytest

from rl_async.engine.base import EngineError, GenerateOutput
from rl_async.loop.producer import Producer, ProducerLimits
from rl_async.algo.rewards import RewardError
from rl_async.base.types import Group, Sample


class World:
    def __init__(self, group_size=2, buffer_room=1000, gen_delay=0.001, abort_ids=()):
        self.group_size = group_size
        self.cursor = 0
        self.inflight = 0
        self.max_inflight = 0
        self.buffer: list[Group] = []
        self.buffer_room = buffer_room
        self.room = asyncio.Condition()
        self.aborted: list[Group] = []
        self.failed: list[tuple[Group, str]] = []
        self.gen_delay = gen_delay
        self.abort_ids = set(abort_ids)
        self.version = 0
        self.opened: list[str] = []

    async def next_group(self):
        c = self.cursor
        self.cursor += 1
        self.opened.append(f"g{c}")
        return Group(f"g{c}", [Sample(prompt_id=f"p{c}", prompt_ids=[1, 2]) for _ in range(self.group_size)])

    async def generate(self, sample, group_id):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(self.gen_delay)
        finally:
            self.inflight -= 1
        reason = "abort" if group_id in self.abort_ids else "stop"
        return GenerateOutput(request_id="r", output_ids=[5, 6], output_logprobs=[-0.1, -0.2],
                              token_versions=[self.version] * 2, finish_reason=reason)

    async def score(self, sample):
        return 1.0

    async def put(self, group):
        async with self.room:
            await self.room.wait_for(lambda: len(self.buffer) < self.buffer_room)
            self.buffer.append(group)

    async def take(self, n):
        async with self.room:
            out, self.buffer = self.buffer[:n], self.buffer[n:]
            self.room.notify_all()
            return out

    async def on_aborted(self, g):
        self.aborted.append(g)

    async def on_failed(self, g, err):
        self.failed.append((g, err))

    def producer(self, granularity="sample", budget=4, http=100, **kw):
        return Producer(ProducerLimits(granularity, budget, self.group_size, http),
                        next_group=self.next_group, generate=self.generate, score=self.score,
                        put=self.put, on_aborted=self.on_aborted, on_failed=self.on_failed,
                        group_errors=(EngineError, RewardError), **kw)


async def until(condition, timeout_s: float = 30.0):
    """Wait for a condition (a deadline, not a timing assertion: a loaded machine is slow)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {timeout_s} s")


async def run_for(producer, seconds):
    task = asyncio.create_task(producer.run())
    await asyncio.sleep(seconds)
    return task


@pytest.mark.parametrize("granularity", ["group", "sample"])
def test_budget_and_semaphore_bound_in_flight(granularity):
    async def main():
        w = World(group_size=2)
        p = w.producer(granularity, budget=4, http=3)
        task = await run_for(p, 0.2)
        p.stop()
        await task
        assert w.max_inflight <= 3          # generation semaphore
        assert len(w.buffer) > 4            # it produced, and whole groups arrived
        assert all(g.size == 2 and all(s.reward == 1.0 for s in g.samples) for g in w.buffer)
    asyncio.run(main())


def test_budget_bounds_when_semaphore_is_wide():
    async def main():
        w = World(group_size=2)
        p = w.producer("group", budget=4, http=100)
        task = await run_for(p, 0.1)
        p.stop()
        await task
        assert w.max_inflight <= 4
    asyncio.run(main())


def test_full_buffer_blocks_new_submissions():
    async def main():
        w = World(group_size=2, buffer_room=2)
        p = w.producer("sample", budget=4, http=100)
        task = await run_for(p, 0.0)
        await until(lambda: len(w.buffer) == 2)
        opened = len(w.opened)
        await asyncio.sleep(0.1)
        # Buffer full: one completed group waits for room; no new group opened meanwhile.
        assert len(w.buffer) == 2 and len(w.opened) == opened <= 4
        await w.take(2)
        await until(lambda: len(w.opened) > opened)
        p.stop()
        await w.take(100)
        await task
    asyncio.run(main())


def test_sync_target_inserts_exactly_n_groups():
    async def main():
        w = World(group_size=2)
        p = w.producer("sample", budget=4, http=100)
        p.set_target(3)
        task = await run_for(p, 0.2)
        await p.wait_idle()
        assert len(w.buffer) == 3
        p.set_target(2)
        await asyncio.sleep(0.2)
        await p.wait_idle()
        assert len(w.buffer) == 5
        p.stop()
        await task
    asyncio.run(main())


def test_sync_target_is_cumulative_and_zero_before_the_first_collection():
    """A budget larger than a collection must not open groups before the first target
    (they would be sampled ahead and go stale in a synchronous run), and two targets asked
    back to back add up (the second may come before the first's last put was counted)."""
    async def main():
        w = World(group_size=2)
        p = w.producer("sample", budget=16, http=100)  # room for 8 groups
        p.set_target(0)
        task = await run_for(p, 0.1)
        assert not w.opened and not w.buffer
        p.set_target(2)
        p.set_target(1)
        await asyncio.sleep(0.2)
        await p.wait_idle()
        assert len(w.buffer) == len(w.opened) == 3
        p.stop()
        await task
    asyncio.run(main())


def test_aborted_group_reported_not_inserted():
    async def main():
        w = World(group_size=2, abort_ids={"g0"})
        p = w.producer("group", budget=2, http=100)
        p.set_target(2)
        task = await run_for(p, 0.2)
        await p.wait_idle()
        assert [g.group_id for g in w.aborted] == ["g0"]
        assert [g.group_id for g in w.buffer] == ["g1", "g2"]  # target counts inserted groups
        p.stop()
        await task
    asyncio.run(main())


def test_reward_error_fails_group_with_cause():
    async def main():
        w = World(group_size=2)

        async def bad_score(sample):
            raise RewardError("reward function f failed on prompt 'p0': boom")
        w.score = bad_score
        p = w.producer("group", budget=2, http=100)
        p.set_target(1)
        task = await run_for(p, 0.05)
        p.stop()
        await task
        assert w.failed and "boom" in w.failed[0][1]
        assert not w.buffer
    asyncio.run(main())


def test_fatal_error_surfaces_from_run():
    async def main():
        w = World(group_size=2)

        async def dead(sample, gid):
            raise RuntimeError("engine-0 died")
        w.generate = dead
        p = w.producer("sample", budget=2, http=100)
        with pytest.raises(RuntimeError, match="engine-0 died"):
            await asyncio.wait_for(p.run(), 5)
    asyncio.run(main())


def test_generation_gate_drains_and_blocks_requests():
    async def main():
        w = World(group_size=2, gen_delay=0.05)
        p = w.producer("sample", budget=4, http=100)
        task = await run_for(p, 0.02)
        p.pause_generation()
        assert await p.drain_generation(5.0)
        assert w.inflight == 0
        before = len(w.buffer)
        await asyncio.sleep(0.15)
        assert w.inflight == 0 and len(w.buffer) <= before + 2
        p.resume_generation()
        await asyncio.sleep(0.2)
        assert len(w.buffer) > before
        p.stop()
        await task
    asyncio.run(main())


@pytest.mark.parametrize("reply, needle", [
    (GenerateOutput("r", [1, 2], [-0.1], [0, 0], "stop"), "2 tokens, 1 log-probs"),
    # one NaN behaviour log-prob used to reach the optimizer and skip the whole step
    (GenerateOutput("r", [1, 2], [-0.1, float("nan")], [0, 0], "stop"), "log-prob nan at token 1"),
])
def test_malformed_engine_reply_fails_the_group_with_its_cause(reply, needle):
    async def main():
        w = World(group_size=1)

        async def bad(sample, gid):
            return reply
        w.generate = bad
        p = w.producer("sample", budget=1, http=1)
        p.set_target(1)
        task = await run_for(p, 0.05)
        p.stop()
        await task
        assert not w.buffer
        assert "malformed" in w.failed[0][1] and needle in w.failed[0][1]
    asyncio.run(main())


@pytest.mark.parametrize("granularity", ["group", "sample"])
def test_zero_variance_groups_are_filtered_and_replaced(granularity):
    from rl_async.loop.producer import zero_variance

    world = World(group_size=3)
    filtered: list[tuple[str, str]] = []

    calls = itertools.count()

    async def score(sample):  # every third prompt is solved by all its samples
        return 1.0 if int(sample.prompt_id[1:]) % 3 == 0 else float(next(calls) % 2)

    async def on_filtered(g, reason):
        filtered.append((g.group_id, reason))

    async def main():
        p = Producer(ProducerLimits(granularity, 6, 3, 100), next_group=world.next_group,
                     generate=world.generate, score=score, put=world.put,
                     on_aborted=world.on_aborted, on_failed=world.on_failed,
                     filter_group=zero_variance, on_filtered=on_filtered)
        p.set_target(6)  # sync mode: exactly six groups must land in the buffer
        task = asyncio.create_task(p.run())
        while len(world.buffer) < 6:
            await asyncio.sleep(0.005)
        await p.wait_idle()
        p.stop()
        await task
        return p

    p = asyncio.run(main())
    assert len(world.buffer) == 6  # collections still fill: filtered prompts were replaced
    assert all(len({s.reward for s in g.samples}) > 1 for g in world.buffer)
    assert filtered and all("zero reward variance" in r for _, r in filtered)
    assert p.stats.filtered_groups == len(filtered)
    assert len(world.opened) == 6 + len(filtered) + len(world.failed) + len(world.aborted)


def test_zero_variance_needs_equal_rewards():
    from rl_async.loop.producer import zero_variance

    same = Group("g", [Sample("p", reward=0.0), Sample("p", reward=0.0)])
    mixed = Group("g", [Sample("p", reward=0.0), Sample("p", reward=1.0)])
    assert zero_variance(same) == "zero reward variance (all 0.0)"
    assert zero_variance(mixed) is None


def test_eval_metrics_pass_and_mean_at_k():
    from rl_async.algo.evaluation import eval_metrics

    m = eval_metrics([1.0, 0.0], [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert m == {"reward": 0.5, "pass@3": 0.5, "mean@3": 1 / 6}
    assert eval_metrics([0.0, 1.0, 1.0]) == {"reward": 2 / 3}
    with pytest.raises(ValueError, match="same k"):
        eval_metrics([1.0], [[1.0], [1.0, 0.0]])


@pytest.mark.parametrize("granularity", ["group", "sample"])
def test_admission_paused_while_waiting_for_buffer_room_opens_no_group(granularity):
    """A drain pauses admission while the admission loop waits for a full buffer; when room
    appears, no new group may be opened (a stop would leave it half submitted)."""
    async def main():
        w = World(group_size=2, buffer_room=1)
        p = w.producer(granularity, budget=8)
        task = await run_for(p, 0.05)  # buffer full, a completed group waits for room
        assert p.load()["pending_puts"] >= 1
        p.pause_admission()
        opened = len(w.opened)
        w.buffer_room = 100
        await w.take(100)  # room: every pending put lands
        await asyncio.wait_for(p.wait_idle(), 1.0)
        await asyncio.sleep(0.02)
        assert len(w.opened) == opened and p.load()["groups_in_flight"] == 0
        p.stop()
        await w.take(100)
        await asyncio.wait_for(task, 1.0)
    asyncio.run(main())


def test_admission_goes_on_while_puts_are_in_transit_and_stops_when_one_may_wait():
    """Puts that have not reported stop admission (one may wait for room); once puts report
    room left, admission goes on while later puts are in transit."""
    async def main():
        w = World(group_size=2)
        release = asyncio.Event()
        async def slow_put(group):
            await release.wait()  # in transit until released
            w.buffer.append(group)
            return 100  # room left

        p = Producer(ProducerLimits("sample", 8, 2, 100), next_group=w.next_group,
                     generate=w.generate, score=w.score, put=slow_put,
                     on_aborted=w.on_aborted, on_failed=w.on_failed)
        task = await run_for(p, 0.05)
        # No put has reported yet: pending puts may be waiting, so admission stopped.
        stalled = len(w.opened)
        assert p.load()["pending_puts"] >= 1
        await asyncio.sleep(0.05)
        assert len(w.opened) == stalled
        release.set()  # puts land and report room: admission goes on beside later puts
        await asyncio.sleep(0.05)
        assert len(w.opened) > stalled + 2
        p.stop()
        await asyncio.wait_for(task, 1.0)
    asyncio.run(main())


@pytest.mark.parametrize("granularity", ["group", "sample"])
def test_groups_opened_several_per_fetch_within_budget_target_and_drain(granularity):
    async def main():
        w = World(group_size=2)
        fetches = []

        async def next_groups(n):
            fetches.append(n)
            return [await w.next_group() for _ in range(n)]

        p = Producer(ProducerLimits(granularity, 8, 2, 100), next_group=w.next_group,
                     generate=w.generate, score=w.score, put=w.put,
                     on_aborted=w.on_aborted, on_failed=w.on_failed, next_groups=next_groups)
        p.set_target(5)  # sync mode: exactly 5 groups, however many a fetch could take
        task = await run_for(p, 0.1)
        assert len(w.buffer) == 5 and len(w.opened) == 5
        assert max(fetches) > 1 and max(fetches) <= 4  # budget 8 samples = 4 groups
        p.set_target(float("inf"))
        await asyncio.sleep(0.05)
        p.pause_admission()  # a drain: groups already fetched still run to the end
        await asyncio.wait_for(p.wait_idle(), 1.0)
        assert len(w.buffer) == len(w.opened) and p.load()["groups_in_flight"] == 0
        p.stop()
        await asyncio.wait_for(task, 1.0)
    asyncio.run(main())


def test_evaluation_requests_share_the_rollouts_generation_gate():
    """Evaluation requests went straight to the engines, past the server_concurrency x engines
    permits rollouts wait for: `gated` takes a permit like a rollout request does."""
    async def main():
        w = World(group_size=2, gen_delay=10.0)  # rollouts hold their permits
        p = w.producer("sample", budget=2, http=2)
        p.set_target(1)
        task = await run_for(p, 0.05)
        assert w.inflight == 2  # both permits held by rollout requests
        started = []

        async def eval_request():
            started.append(w.inflight)
            return "done"
        pending = asyncio.ensure_future(p.gated(eval_request))
        await asyncio.sleep(0.05)
        assert not started  # waits for a permit
        p.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pending.cancel()
    asyncio.run(main())
