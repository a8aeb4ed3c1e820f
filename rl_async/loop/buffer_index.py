"""The completed buffer's resident groups, indexed two ways (split out of loop/buffer.py).

- arrival order (`fifo`: oldest first; `lifo`: newest first), for `get`;
- eviction rank (stalest first: oldest min token version, then the smaller sum of per-sample
  oldest versions, then earlier arrival; groups of unknown age last), for `evict`.

Both are heaps with lazy deletion, compacted when dead entries outnumber live ones, so an
insert and a removal are O(log n) amortised. The index also keeps the count and summed
oldest versions of the groups of known age: the resident mean age in O(1).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from rl_async.base.types import Group

# (1 if unknown age else 0, oldest version, summed oldest versions, arrival seq)
Rank = tuple[int, int, int, int]
_COMPACT_SLACK = 64


def rank_key(group: Group, seq: int) -> Rank:
    oldest = group.oldest_version()
    if oldest is None:
        return (1, 0, 0, seq)
    return (0, oldest, group.summed_oldest_versions(), seq)


class ResidentGroups:
    def __init__(self, order: str) -> None:
        self._fifo = order == "fifo"
        self._groups: dict[int, tuple[Group, Rank]] = {}  # arrival seq -> resident group
        self._order_heap: list[int] = []  # seq (fifo) or -seq (lifo); lazily deleted
        self._rank_heap: list[Rank] = []  # lazily deleted
        self.known_n = 0  # resident groups of known age, and the sum of their oldest versions
        self.known_sum = 0

    def __len__(self) -> int:
        return len(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def groups(self) -> Iterator[Group]:
        return (group for group, _ in self._groups.values())

    def group(self, seq: int) -> Group:
        return self._groups[seq][0]

    def _order_key(self, seq: int) -> int:
        return seq if self._fifo else -seq

    def insert(self, group: Group, seq: int) -> None:
        group.arrival_seq = seq
        rank = rank_key(group, seq)
        self._groups[seq] = (group, rank)
        heapq.heappush(self._order_heap, self._order_key(seq))
        heapq.heappush(self._rank_heap, rank)
        if rank[0] == 0:
            self.known_n += 1
            self.known_sum += rank[1]

    def remove(self, seq: int) -> Group:
        group, rank = self._groups.pop(seq)
        if rank[0] == 0:
            self.known_n -= 1
            self.known_sum -= rank[1]
        return group

    def peek_order(self) -> int | None:
        """The seq `get` takes next, or None."""
        heap = self._order_heap
        while heap and abs(heap[0]) not in self._groups:
            heapq.heappop(heap)
        return abs(heap[0]) if heap else None

    def pop_order(self) -> Group:
        """Remove and return the group `peek_order` named."""
        return self.remove(abs(heapq.heappop(self._order_heap)))

    def rank_top(self) -> Rank | None:
        """The stalest resident group's rank, or None."""
        heap = self._rank_heap
        # A live seq may appear twice after a restore; either entry ranks it identically.
        while heap and heap[0][3] not in self._groups:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop_rank(self) -> Group:
        """Remove and return the group `rank_top` named."""
        return self.remove(heapq.heappop(self._rank_heap)[3])

    def compact(self) -> None:
        """Rebuild a heap once dead entries outnumber live ones (amortised O(1) per removal)."""
        live = len(self._groups)
        if len(self._order_heap) > 2 * live + _COMPACT_SLACK:
            self._order_heap = [self._order_key(seq) for seq in self._groups]
            heapq.heapify(self._order_heap)
        if len(self._rank_heap) > 2 * live + _COMPACT_SLACK:
            self._rank_heap = [rank for _, rank in self._groups.values()]
            heapq.heapify(self._rank_heap)

    def clear(self) -> None:
        self._groups.clear()
        self._order_heap.clear()
        self._rank_heap.clear()
        self.known_n = self.known_sum = 0
