"""Windowed accounting of the completed-group buffer's decisions (SPEC §7).

The buffer records every decision here as it makes it; `QueueMetrics.snapshot()` returns one
report window as a flat dict of plain numbers and starts a new window. Only counts are kept:
no text, token ids or tensors, so the window's memory is bounded by the fixed set of names.

Names come without their W&B prefix; `with_prefix()` is the one place that adds it:

    completed-queue decisions   -> rollout/fully_async/completed_queue/<name>
    buffer state and evictions  -> rollout/fully_async/<name>

`dropped_*` count only the dequeue age filter. Evictions have their own counters; put-time
aborts, filters, interrupted requests and shutdown leftovers are not buffer decisions and are
counted by the ledger, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rl_async.observe.length_ks import LengthKS

if TYPE_CHECKING:
    from rl_async.base.types import Group

COMPLETED_QUEUE_PREFIX = "rollout/fully_async/completed_queue/"
FULLY_ASYNC_PREFIX = "rollout/fully_async/"

# (lowest response length in the bin, label); each bin runs up to the next one's start.
LENGTH_BINS: tuple[tuple[int, str], ...] = (
    (0, "0-255"), (256, "256-511"), (512, "512-1023"), (1024, "1024-2047"),
    (2048, "2048-4095"), (4096, "4096-8191"), (8192, "8192-16383"), (16384, "16384+"),
)
# (lowest age in the bin, label); "unknown" is for groups without recorded token versions.
AGE_BINS: tuple[tuple[int, str], ...] = (
    (0, "0"), (1, "1"), (2, "2"), (3, "3"), (4, "4"), (5, "5-8"), (9, "9-16"), (17, "17+"),
)
UNKNOWN_AGE_BIN = "unknown"
AGE_BIN_LABELS: tuple[str, ...] = tuple(label for _, label in AGE_BINS) + (UNKNOWN_AGE_BIN,)
LENGTH_BIN_LABELS: tuple[str, ...] = tuple(label for _, label in LENGTH_BINS)

_COUNTS = ("dropped_samples", "dropped_groups", "dropped_response_tokens",
           "delivered_samples", "delivered_groups", "delivered_response_tokens")
COMPLETED_QUEUE_NAMES: tuple[str, ...] = (
    _COUNTS
    + ("dropped_samples_fraction", "dropped_response_tokens_fraction")
    + tuple(f"{kind}_by_length/{b}" for kind in
            ("dropped_samples", "delivered_samples", "dropped_samples_fraction")
            for b in LENGTH_BIN_LABELS)
    + tuple(f"{kind}_by_age/{b}" for kind in
            ("dropped_samples", "delivered_samples", "dropped_samples_fraction")
            for b in AGE_BIN_LABELS)
    + ("consumer_wait_seconds",)
)
FULLY_ASYNC_NAMES: tuple[str, ...] = (
    "evicted_stale_groups", "evicted_overflow_groups", "evict_rate",
    "buffer_avg_staleness", "buffer_max_staleness", "avg_staleness", "max_staleness",
    "queue_size",
)
# Over the run so far, not windowed: rollout/length_ks (observe/length_ks.py).
ROLLOUT_PREFIX = "rollout/"
ROLLOUT_NAMES: tuple[str, ...] = ("length_ks",)
_PREFIX_BY_NAME: dict[str, str] = {
    **{name: COMPLETED_QUEUE_PREFIX for name in COMPLETED_QUEUE_NAMES},
    **{name: FULLY_ASYNC_PREFIX for name in FULLY_ASYNC_NAMES},
    **{name: ROLLOUT_PREFIX for name in ROLLOUT_NAMES},
}


def metric_names() -> tuple[str, ...]:
    """Every name `QueueMetrics.snapshot()` returns, in a stable order, without prefix."""
    return COMPLETED_QUEUE_NAMES + FULLY_ASYNC_NAMES + ROLLOUT_NAMES


def with_prefix(metrics: Mapping[str, float]) -> dict[str, float]:
    """The W&B names of a `snapshot()` dict. Unknown names are an error, not a guess."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        prefix = _PREFIX_BY_NAME.get(name)
        if prefix is None:
            raise KeyError(
                f"queue metric {name!r} has no W&B namespace: add it to COMPLETED_QUEUE_NAMES "
                f"or FULLY_ASYNC_NAMES in rl_async/observe/queue_metrics.py"
            )
        out[prefix + name] = value
    return out


def length_bin(response_len: int) -> str:
    """The response-length bin label of one sample."""
    if response_len < 0:
        raise ValueError(f"response_len = {response_len}: a length cannot be negative")
    label = LENGTH_BINS[0][1]
    for start, name in LENGTH_BINS:
        if response_len >= start:
            label = name
    return label


def age_bin(age: int | None) -> str:
    """The age bin label of a group's age (None = unknown)."""
    if age is None:
        return UNKNOWN_AGE_BIN
    if age < 0:
        raise ValueError(f"age = {age}: an age cannot be negative")
    label = AGE_BINS[0][1]
    for start, name in AGE_BINS:
        if age >= start:
            label = name
    return label


def _fraction(dropped: float, delivered: float) -> float:
    total = dropped + delivered
    return dropped / total if total else 0.0


class QueueMetrics:
    """Counts of one report window. The buffer calls `record_*`; the actor calls `snapshot`."""

    def __init__(self) -> None:
        self._reset()
        self.lengths = LengthKS()  # the run's, never reset

    def _reset(self) -> None:
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._by_length = {kind: dict.fromkeys(LENGTH_BIN_LABELS, 0)
                           for kind in ("dropped", "delivered")}
        self._by_age = {kind: dict.fromkeys(AGE_BIN_LABELS, 0)
                        for kind in ("dropped", "delivered")}
        self._wait_seconds = 0.0
        self._evicted = {"stale": 0, "overflow": 0}
        self._entered = 0
        self._consumed_age_sum = 0
        self._consumed_age_n = 0
        self._consumed_age_max = 0
        # Resident staleness measured at the latest drain (get) of this window.
        self._resident_avg = 0.0
        self._resident_max = 0

    # --- recording ------------------------------------------------------------------------
    def _record(self, kind: str, group: Group, age: int | None) -> None:
        self._counts[f"{kind}_groups"] += 1
        self._counts[f"{kind}_samples"] += group.size
        self._counts[f"{kind}_response_tokens"] += group.response_tokens
        # Lengths are read now, before a retry could reset them (SPEC §7).
        for sample in group.samples:
            self._by_length[kind][length_bin(sample.response_len)] += 1
        self._by_age[kind][age_bin(age)] += group.size

    def record_dropped(self, group: Group, age: int | None) -> None:
        """A group discarded by the dequeue age filter."""
        self._record("dropped", group, age)

    def record_delivered(self, group: Group, age: int | None) -> None:
        """A group handed to the consumer; known ages feed avg/max_staleness."""
        self._record("delivered", group, age)
        self.lengths.add_trained(s.response_len for s in group.samples)
        if age is not None:
            self._consumed_age_sum += age
            self._consumed_age_n += 1
            self._consumed_age_max = max(self._consumed_age_max, age)

    def record_evicted(self, stale: bool) -> None:
        """An eviction: `stale` when the group was beyond the lag, else an overflow eviction."""
        self._evicted["stale" if stale else "overflow"] += 1

    def record_entered(self, group: Group | None = None) -> None:
        """A group inserted by `put` (the denominator of `evict_rate`; its lengths are the
        generated side of `length_ks`)."""
        self._entered += 1
        if group is not None:
            self.lengths.add_generated(s.response_len for s in group.samples)

    def record_wait(self, seconds: float) -> None:
        """Time a consumer spent inside `get`, filtering included."""
        self._wait_seconds += max(0.0, seconds)

    def record_resident_staleness(self, avg: float, max_: int) -> None:
        """Staleness of the groups resident when a consumer drains the buffer."""
        self._resident_avg = float(avg)
        self._resident_max = int(max_)

    # --- reporting ------------------------------------------------------------------------
    def snapshot(self, queue_size: int) -> dict[str, float]:
        """The window's metrics (every name of `metric_names()`, zeros explicit); resets it."""
        c = self._counts
        out: dict[str, float] = dict(c)
        out["dropped_samples_fraction"] = _fraction(c["dropped_samples"], c["delivered_samples"])
        out["dropped_response_tokens_fraction"] = _fraction(
            c["dropped_response_tokens"], c["delivered_response_tokens"])
        for axis, table in (("length", self._by_length), ("age", self._by_age)):
            for label in table["dropped"]:
                dropped, delivered = table["dropped"][label], table["delivered"][label]
                out[f"dropped_samples_by_{axis}/{label}"] = dropped
                out[f"delivered_samples_by_{axis}/{label}"] = delivered
                out[f"dropped_samples_fraction_by_{axis}/{label}"] = _fraction(dropped, delivered)
        out["consumer_wait_seconds"] = self._wait_seconds
        evictions = self._evicted["stale"] + self._evicted["overflow"]
        out["evicted_stale_groups"] = self._evicted["stale"]
        out["evicted_overflow_groups"] = self._evicted["overflow"]
        out["evict_rate"] = evictions / self._entered if self._entered else 0.0
        out["buffer_avg_staleness"] = self._resident_avg
        out["buffer_max_staleness"] = self._resident_max
        n = self._consumed_age_n
        out["avg_staleness"] = self._consumed_age_sum / n if n else 0.0
        out["max_staleness"] = self._consumed_age_max
        out["queue_size"] = queue_size
        out["length_ks"] = self.lengths.distance()
        self._reset()
        # Same names, same order, every window: sinks never see a key appear or vanish.
        return {name: out[name] for name in metric_names()}
