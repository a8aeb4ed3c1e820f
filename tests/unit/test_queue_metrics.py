"""Queue metrics: names, bins, fractions, windows, prefixes (SPEC §7), via the buffer and alone."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.loop.buffer import CompletedBuffer
from rl_async.observe.queue_metrics import (
    AGE_BIN_LABELS, COMPLETED_QUEUE_PREFIX, FULLY_ASYNC_PREFIX, LENGTH_BIN_LABELS, QueueMetrics,
    age_bin, length_bin, metric_names, with_prefix,
)
from rl_async.base.types import Group, Sample


def grp(gid: str, lens: list[int], version: int | None) -> Group:
    samples = [Sample(gid, response_ids=[0] * n,
                      token_versions=[] if version is None else [version] * n) for n in lens]
    return Group(gid, samples)


def run(coro):
    return asyncio.run(coro)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bins_are_exactly_the_spec_bins():
    assert LENGTH_BIN_LABELS == ("0-255", "256-511", "512-1023", "1024-2047", "2048-4095",
                                 "4096-8191", "8192-16383", "16384+")
    assert AGE_BIN_LABELS == ("0", "1", "2", "3", "4", "5-8", "9-16", "17+", "unknown")


@pytest.mark.parametrize("n, label", [
    (0, "0-255"), (255, "0-255"), (256, "256-511"), (1023, "512-1023"), (1024, "1024-2047"),
    (4095, "2048-4095"), (8191, "4096-8191"), (16383, "8192-16383"), (16384, "16384+"),
    (10**6, "16384+"),
])
def test_length_bin_edges(n, label):
    assert length_bin(n) == label


@pytest.mark.parametrize("age, label", [
    (0, "0"), (4, "4"), (5, "5-8"), (8, "5-8"), (9, "9-16"), (16, "9-16"), (17, "17+"),
    (None, "unknown"),
])
def test_age_bin_edges(age, label):
    assert age_bin(age) == label


def test_empty_window_reports_every_name_as_explicit_zero():
    m = QueueMetrics().snapshot(queue_size=0)
    assert tuple(m) == metric_names()
    assert all(v == 0 for v in m.values())
    assert len(m) == 8 + 3 * 8 + 3 * 9 + 1 + 8 + 1  # + rollout/length_ks


def test_buffer_decisions_feed_counts_bins_and_fractions():
    async def main():
        clock = FakeClock()
        buf = CompletedBuffer(8, max_lag=1, clock=clock)
        await buf.put(grp("stale", [300, 10], 0))  # age 3 at version 3: dropped
        await buf.put(grp("ok", [20, 20, 5000], 2))  # age 1: delivered
        await buf.put(grp("unknown", [1], None))  # unknown age: delivered
        getter = asyncio.create_task(buf.get(3, 3))
        await asyncio.sleep(0)  # takes "ok" and "unknown", drops "stale", then waits
        clock.now = 2.5
        await buf.put(grp("last", [7], 3))
        await getter
        await buf.put(grp("rest", [7], 3))  # stays resident
        return buf.metrics(), buf.metrics()
    m, after = run(main())
    assert (m["dropped_groups"], m["dropped_samples"], m["dropped_response_tokens"]) == (1, 2, 310)
    assert (m["delivered_groups"], m["delivered_samples"], m["delivered_response_tokens"]) \
        == (3, 5, 5048)
    assert m["dropped_samples_fraction"] == pytest.approx(2 / 7)
    assert m["dropped_response_tokens_fraction"] == pytest.approx(310 / 5358)
    assert m["dropped_samples_by_length/256-511"] == 1
    assert m["dropped_samples_by_length/0-255"] == 1
    assert m["delivered_samples_by_length/0-255"] == 4
    assert m["delivered_samples_by_length/4096-8191"] == 1
    assert m["dropped_samples_fraction_by_length/0-255"] == pytest.approx(1 / 5)
    assert m["dropped_samples_fraction_by_length/256-511"] == 1.0
    assert m["dropped_samples_fraction_by_length/4096-8191"] == 0.0
    assert m["dropped_samples_by_age/3"] == 2 and m["delivered_samples_by_age/1"] == 3
    assert m["delivered_samples_by_age/0"] == 1
    assert m["delivered_samples_by_age/unknown"] == 1
    assert m["dropped_samples_fraction_by_age/3"] == 1.0
    assert m["consumer_wait_seconds"] == 2.5
    # Consumed staleness leaves the unknown-age group out of the average.
    assert (m["avg_staleness"], m["max_staleness"]) == (0.5, 1)
    # Resident after the drain: nothing ("rest" arrives later), so zeros, not the delivered.
    assert m["buffer_avg_staleness"] == 0.0 and m["buffer_max_staleness"] == 0
    assert m["queue_size"] == 1
    # The window resets; length_ks is the run's and does not.
    assert all(v == 0 for k, v in after.items() if k not in ("queue_size", "length_ks"))
    assert after["queue_size"] == 1 and after["length_ks"] == m["length_ks"]


def test_buffer_staleness_describes_groups_left_after_the_drain():
    """The miles peer suite's case: puts at versions 4, 6, 8; a get of one group at version
    10 delivers the version-4 group; the resident 6 and 8 are aged 4 and 2."""
    async def main():
        buf = CompletedBuffer(8, max_lag=10)
        for gid, v in (("a", 4), ("b", 6), ("c", 8)):
            await buf.put(grp(gid, [3], v))
        [got] = await buf.get(1, 10)
        return got, buf.metrics()
    got, m = run(main())
    assert got.group_id == "a"
    assert m["buffer_max_staleness"] == 4 and m["buffer_avg_staleness"] == 3.0
    assert m["max_staleness"] == 6  # the delivered group's age is reported separately


def test_evictions_have_their_own_counters_and_rate():
    async def main():
        buf = CompletedBuffer(2, max_lag=1, overflow="evict")
        buf.set_version(4)
        for gid, v in (("a", 1), ("b", 4), ("c", 4), ("d", 4)):
            await buf.put(grp(gid, [3], v))
        return buf.metrics()
    m = run(main())
    assert (m["evicted_stale_groups"], m["evicted_overflow_groups"]) == (1, 1)
    assert m["evict_rate"] == 0.5 and m["dropped_groups"] == 0 and m["queue_size"] == 2


def test_with_prefix_adds_each_namespace_in_one_place():
    named = with_prefix(QueueMetrics().snapshot(queue_size=3))
    assert named[f"{COMPLETED_QUEUE_PREFIX}dropped_samples_by_age/17+"] == 0
    assert named[f"{COMPLETED_QUEUE_PREFIX}consumer_wait_seconds"] == 0
    assert named[f"{FULLY_ASYNC_PREFIX}queue_size"] == 3
    assert f"{FULLY_ASYNC_PREFIX}evict_rate" in named
    assert "rollout/fully_async/completed_queue/queue_size" not in named
    assert len(named) == len(metric_names())
    with pytest.raises(KeyError, match="no W&B namespace"):
        with_prefix({"made_up": 1})


def test_negative_inputs_refused():
    with pytest.raises(ValueError, match="response_len"):
        length_bin(-1)
    with pytest.raises(ValueError, match="age"):
        age_bin(-1)
