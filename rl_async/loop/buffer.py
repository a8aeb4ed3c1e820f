"""The completed-group buffer between the producers and training (SPEC §4, §6, §7).

    producer --put--> [ resident groups ] --get(n, v)--> consumer (training)
       ^  block: waits for room  |  age > max_lag when reached --> on_discard(g, "stale")
       |  evict: never waits     +- stalest first when over --> on_discard(g, "evicted_*")
       +------- the ledger regenerates discarded and evicted prompts -------+

Rules:
- Capacity counts whole groups. `reserve(n)` adds room for lifecycle drains (evaluation,
  shutdown) so completions a producer already owns can be inserted; `release_reserve()`
  takes it back (resident groups above the limit stay, new puts wait or evict).
- Order `fifo` (oldest arrival first) or `lifo` (freshest first).
- `get(n, v)` takes groups one by one in order while it waits, so a collection larger than
  the capacity still completes; groups of age > max_lag are discarded when reached, never
  earlier (except by evict). Age is `Group.age(v)`; unknown age (None) is never stale.
- Eviction rank (stalest first): oldest min token version, then the smaller sum of per-sample
  oldest versions (larger summed staleness), then earlier arrival; unknown ages last. Beyond-lag
  groups, judged against the latest version seen (`set_version` or the last `get`), go first.
- Cancellation-safe: a cancelled put inserts nothing; a get that is cancelled or fails puts
  every group it had taken back at its original arrival position. `close(reason)` makes every
  waiting and later put/get raise `BufferClosedError`; `drain_all()` hands back all groups,
  including those held by pending gets.

Cost: a put and a get are O(log n): two heaps (order and eviction rank) with lazy deletion,
compacted when dead entries outnumber live ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from rl_async.base.waiters import Waiters as _Waiters
from rl_async.loop.admission import AdmissionBound, AdmissionGate, admission_for
from rl_async.loop.buffer_index import ResidentGroups
from rl_async.base.clock import now as clock_now
from rl_async.observe.queue_metrics import QueueMetrics
from rl_async.base.types import Group

ORDERS = ("fifo", "lifo")
OVERFLOWS = ("block", "evict")
# `on_discard(group, reason)` reasons.
DISCARD_STALE = "stale"
EVICT_STALE = "evicted_stale"
EVICT_OVERFLOW = "evicted_overflow"

class BufferClosedError(RuntimeError):
    """put/get on a closed buffer; the message carries the reason given to `close`."""


class _Take:
    """Groups a pending `get` has taken, with their ages; `drain_all` may reclaim them."""

    __slots__ = ("items", "wanted")

    def __init__(self, wanted: int = 0) -> None:
        self.items: list[tuple[Group, int | None]] = []
        self.wanted = wanted


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} = {value!r}: must be an int >= {minimum}")
    return value


class CompletedBuffer:
    """Bounded, ordered, staleness-aware store of completed groups (SPEC §6, §11)."""

    def __init__(
        self,
        capacity_groups: int,
        max_lag: int | None,
        order: str = "fifo",
        overflow: str = "block",
        on_discard: Callable[[Group, str], None] | None = None,
        *,
        on_insert: Callable[[Group], None] | None = None,
        on_deliver: Callable[[list[Group]], None] | None = None,
        clock: Callable[[], float] = clock_now,
        admission: AdmissionBound | None = None,
        hold_back_groups: int = 0,
    ) -> None:
        if isinstance(capacity_groups, int) and not isinstance(capacity_groups, bool) \
                and capacity_groups == 0:
            raise ValueError(
                "capacity_groups = 0: the completed buffer must hold at least one group; raise "
                "async.async_data_buffer_capacity_factor so that floor(factor x "
                "rollout_batch_size) >= 1"
            )
        self._capacity = _check_int("capacity_groups", capacity_groups, 1)
        self._max_lag = None if max_lag is None else _check_int("max_lag", max_lag, 0)
        if order not in ORDERS:
            raise ValueError(f"order = {order!r}: must be one of {ORDERS} (async.buffer_order)")
        if overflow not in OVERFLOWS:
            raise ValueError(
                f"overflow = {overflow!r}: must be one of {OVERFLOWS} (async.buffer_overflow)")
        self._order, self._overflow = order, overflow
        self._on_discard, self._on_insert, self._on_deliver = on_discard, on_insert, on_deliver
        self._clock = clock
        # async.hold_back_collections: a get leaves this many groups behind what it takes
        self._hold_back = _check_int("hold_back_groups", hold_back_groups, 0)
        self._groups = ResidentGroups(order)  # by arrival order and by eviction rank
        self._keys: set[tuple[str, int]] = set()  # (group_id, attempt) resident or taken
        self._seq = itertools.count()
        self._version = 0
        self._reserve = 0
        self._closed: str | None = None
        self._putters, self._getters = _Waiters(), _Waiters()
        self._takes: set[_Take] = set()
        self._metrics = QueueMetrics()
        # async.staleness_bound = "admission": producers take tickets here (loop/admission.py)
        self.admission = None if admission is None else AdmissionGate(
            admission, self._ahead, self._starving)

    # --- properties -----------------------------------------------------------------------
    def __len__(self) -> int:
        """Resident groups (not counting those a pending get has taken)."""
        return len(self._groups)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved(self) -> int:
        """Extra room added by reserve() for lifecycle drains."""
        return self._reserve

    @property
    def version(self) -> int:
        """The latest policy version this buffer has seen."""
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def held(self) -> int:
        """Groups taken by gets that have not returned yet."""
        return sum(len(take.items) for take in self._takes)

    # --- producer side --------------------------------------------------------------------
    async def put(self, group: Group) -> None:
        """Insert one completed group. `block`: waits for room; `evict`: never waits."""
        if not isinstance(group, Group):
            raise TypeError(
                f"put(group): expected rl_async.base.types.Group, got {type(group).__name__}")
        self._raise_if_closed("put")
        if self._overflow == "block":
            while len(self._groups) >= self._limit():
                await self._putters.wait()
                self._raise_if_closed("put")
        key = (group.group_id, group.attempt)
        if key in self._keys:
            raise ValueError(
                f"put: group {group.group_id!r} attempt {group.attempt} is already in the buffer; "
                f"a group attempt is inserted once (a retry must come from Group.fresh_attempt())"
            )
        # Told first: if the owner refuses the group, nothing has been inserted.
        if self._on_insert is not None:
            self._on_insert(group)
        self._keys.add(key)
        # engines never run ahead of the trainer; max() only guards a version not yet told
        group.version_at_insert = max(self._version, group.newest_version() or 0)
        if self.admission is not None:
            self.admission.bound.inserted()
        self._insert(group, next(self._seq))
        self._metrics.record_entered(group)
        self._getters.wake_all()
        if self._overflow == "evict":
            self._evict_to_limit()

    def room(self) -> float:
        """Groups a put can insert now without waiting (inf under `evict`: puts never wait)."""
        if self._overflow == "evict":
            return math.inf
        return max(0, self._limit() - len(self._groups))

    def set_version(self, version: int | None, engine_version: int | None = None) -> None:
        """The controller's latest policy version (the threshold of stale eviction; None:
        unchanged) and, when it knows, the version every engine now holds (the admission
        bound's floor). A landing publication sends only the engine version: it runs beside
        the training loop, and a trainer version read there could reach this actor after a
        newer one the loop sent (seen once in a benchmark: 31 after 32)."""
        if version is None:
            version = self._version
        self._advance_version(version, "set_version")
        if self.admission is not None:
            self.admission.bound.set_trainer_version(version)
            if engine_version is not None:
                self.admission.bound.set_engine_version(engine_version)
            self.admission.wake()

    # --- admission (async.staleness_bound = "admission") ---------------------------------
    async def admit(self, n_groups: int) -> int:
        """Tickets for up to `n_groups` new groups, waiting until one fits the lag."""
        return await self.admission.admit(n_groups, lambda: self._raise_if_closed("admit"))

    def release(self, n_groups: int) -> None:
        """Tickets of groups that will never be inserted (filtered, aborted, failed)."""
        self.admission.release(n_groups)

    def _ahead(self) -> int:
        return len(self._groups) + self.held + self.admission.bound.tickets

    def _starving(self) -> int:
        """Groups pending gets still miss with nothing buffered or in flight to fill them."""
        if self._groups or self.admission.bound.tickets:
            return 0
        return sum(max(0, t.wanted - len(t.items)) for t in self._takes)

    def reserve(self, n_groups: int) -> None:
        """Add room for `n_groups` MORE completions a producer already owns (lifecycle
        drains). Groups resident above the limit (left by an earlier drain's reserve) do not
        eat into it: otherwise those owned completions would block forever."""
        n = _check_int("reserve(n_groups)", n_groups, 0)
        self._reserve += n + max(0, len(self._groups) - self._limit())
        self._wake_putters()

    def release_reserve(self, n_groups: int | None = None) -> int:
        """Take back `n_groups` of reserved room (all when None); returns what stays reserved."""
        n = self._reserve if n_groups is None else _check_int("release_reserve", n_groups, 0)
        if n > self._reserve:
            raise ValueError(
                f"release_reserve({n}): only {self._reserve} groups are reserved; release at most "
                f"what reserve() added"
            )
        self._reserve -= n
        return self._reserve

    # --- consumer side --------------------------------------------------------------------
    async def get(self, n_groups: int, current_version: int) -> list[Group]:
        """Wait for and return `n_groups` eligible groups, discarding stale ones reached."""
        _check_int("get(n_groups)", n_groups, 1)
        self._advance_version(current_version, "get")
        self._raise_if_closed("get")
        start = self._clock()
        take = _Take(n_groups)
        self._takes.add(take)
        if self.admission is not None:
            self.admission.bound.get_started(current_version)
        try:
            while True:
                self._take_eligible(take, n_groups, current_version)
                if len(take.items) >= n_groups:
                    # what stays behind after this drain, aged at the get's version
                    self._record_resident_staleness(current_version)
                    groups = self._deliver(take)
                    if self.admission is not None:
                        self.admission.bound.get_returned(current_version)
                    return groups
                if self.admission is not None:
                    self.admission.wake()  # a starving get may unlock admission
                await self._getters.wait()
                self._raise_if_closed("get")
        except BaseException:
            self._restore(take.items)
            raise
        finally:
            self._takes.discard(take)
            self._metrics.record_wait(self._clock() - start)

    def metrics(self) -> dict[str, float]:
        """The §7 metrics of this window, without W&B prefix (see queue_metrics.with_prefix)."""
        return self._metrics.snapshot(queue_size=len(self._groups))

    # --- lifecycle ------------------------------------------------------------------------
    def close(self, reason: str | BaseException = "closed") -> None:
        """Refuse further put/get; waiting ones raise BufferClosedError naming `reason`."""
        if self._closed is not None:
            return
        if isinstance(reason, BaseException):
            reason = f"{type(reason).__name__}: {reason}"
        self._closed = str(reason)
        self._putters.wake_all()
        self._getters.wake_all()
        if self.admission is not None:
            self.admission.wake()

    def drain_all(self) -> list[Group]:
        """Remove and return every group, resident or held by a pending get, in arrival order."""
        out = list(self._groups.groups())
        for take in self._takes:
            out.extend(group for group, _ in take.items)
            take.items.clear()  # the pending get must not put them back
        for group in out:
            group.age_at_delivery = None
        self._groups.clear()
        self._keys.clear()
        self._wake_putters()
        return sorted(out, key=lambda g: g.arrival_seq)

    # --- internals ------------------------------------------------------------------------
    def _limit(self) -> int:
        return self._capacity + self._reserve

    def _raise_if_closed(self, op: str) -> None:
        if self._closed is not None:
            raise BufferClosedError(
                f"completed buffer {op} refused: the buffer is closed ({self._closed}); the "
                f"groups it held are returned by drain_all()"
            )

    def _advance_version(self, version: int, caller: str) -> None:
        _check_int(f"{caller}(version)", version, 0)
        if version < self._version:
            raise ValueError(
                f"{caller}: policy version {version} is older than version {self._version} "
                f"already seen by this buffer; pass the controller's latest version"
            )
        self._version = version

    def _insert(self, group: Group, seq: int) -> None:
        self._groups.insert(group, seq)

    def _wake_putters(self) -> None:
        self._putters.wake(max(0, self._limit() - len(self._groups)))
        if self.admission is not None:  # fewer groups ahead: maybe room to admit
            self.admission.wake()

    def _is_stale(self, age: int | None) -> bool:
        return self._max_lag is not None and age is not None and age > self._max_lag

    def _take_eligible(self, take: _Take, n_groups: int, version: int) -> None:
        try:
            while len(take.items) < n_groups and len(self._groups) > self._hold_back:
                seq = self._groups.peek_order()
                if seq is None:
                    return
                age = self._groups.group(seq).age(version)  # may raise: nothing moved yet
                group = self._groups.pop_order()
                if self._is_stale(age):
                    self._keys.discard((group.group_id, group.attempt))
                    self._metrics.record_dropped(group, age)
                    if self._on_discard is not None:
                        self._on_discard(group, DISCARD_STALE)
                else:
                    take.items.append((group, age))
        finally:
            self._groups.compact()
            self._wake_putters()

    def _deliver(self, take: _Take) -> list[Group]:
        groups = [group for group, _ in take.items]
        for group, age in take.items:
            group.age_at_delivery = age
        if self._on_deliver is not None:
            self._on_deliver(groups)  # if the owner refuses, get's except puts them back
        for group, age in take.items:
            self._keys.discard((group.group_id, group.attempt))
            self._metrics.record_delivered(group, age)
        take.items = []
        return groups

    def _restore(self, items: list[tuple[Group, int | None]]) -> None:
        for group, _ in items:
            group.age_at_delivery = None
            self._insert(group, group.arrival_seq)  # same seq: same place in the order
        if items:
            items.clear()
            self._getters.wake_all()

    def _evict_to_limit(self) -> None:
        limit = self._limit()
        if len(self._groups) <= limit:
            return
        if self._max_lag is not None:
            threshold = self._version - self._max_lag  # beyond the lag: oldest < threshold
            while ((top := self._groups.rank_top()) is not None and top[0] == 0
                   and top[1] < threshold):
                self._evict(stale=True)
        while len(self._groups) > limit:
            assert self._groups.rank_top() is not None, "over the limit with no live rank entry"
            self._evict(stale=False)
        self._groups.compact()

    def _evict(self, stale: bool) -> None:
        group = self._groups.pop_rank()
        self._keys.discard((group.group_id, group.attempt))
        self._metrics.record_evicted(stale)
        if self._on_discard is not None:
            self._on_discard(group, EVICT_STALE if stale else EVICT_OVERFLOW)

    def _record_resident_staleness(self, version: int) -> None:
        top, g = self._groups.rank_top(), self._groups
        if g.known_n == 0 or top is None or top[0] != 0:
            self._metrics.record_resident_staleness(0.0, 0)
            return
        avg = version - g.known_sum / g.known_n
        self._metrics.record_resident_staleness(max(0.0, avg), max(0, version - top[1]))


def buffer_options(cfg: Any, plan: Any) -> dict[str, Any]:
    """The CompletedBuffer settings of a run beyond its capacity and lag (each actor system,
    real or simulated, builds its buffer with these)."""
    return {"order": cfg.async_.buffer_order, "overflow": cfg.async_.buffer_overflow,
            "admission": admission_for(plan), "hold_back_groups": plan.hold_back_groups}
