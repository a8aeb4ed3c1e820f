"""Length bias of what is trained: the Kolmogorov-Smirnov distance between the response
lengths generated (every completed group that reached the buffer) and those trained.

Discarding old groups at dequeue is length-biased (long responses are the ones that grow
old: tinker-cookbook#822): the trained lengths then fall short of the generated ones and the
distance grows. Reported as `rollout/length_ks`, over the run so far; 0 when nothing
differs. Counts per exact length only: memory bounded by rollout.max_response_len.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class LengthKS:
    def __init__(self) -> None:
        self.generated: Counter = Counter()
        self.trained: Counter = Counter()

    def add_generated(self, lengths: Iterable[int]) -> None:
        self.generated.update(lengths)

    def add_trained(self, lengths: Iterable[int]) -> None:
        self.trained.update(lengths)

    def distance(self) -> float:
        """sup_x |F_generated(x) − F_trained(x)| over the empirical CDFs (0 when either is
        empty)."""
        n_gen, n_tr = sum(self.generated.values()), sum(self.trained.values())
        if not n_gen or not n_tr:
            return 0.0
        worst = cum_gen = cum_tr = 0.0
        for x in sorted(self.generated.keys() | self.trained.keys()):
            cum_gen += self.generated[x] / n_gen
            cum_tr += self.trained[x] / n_tr
            worst = max(worst, abs(cum_gen - cum_tr))
        return worst
