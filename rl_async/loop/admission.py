"""Bound staleness at admission (AReaL's rule, in the capacity plan's terms).

The producer asks for tickets before it opens groups; the completed buffer, which sees every
group that is buffered or taken by the trainer's pending collection, grants one only to a
group that will not be older than the lag when the trainer reaches it:

    ahead      = groups taken by the pending collection + buffered + tickets out (in flight)
    next       = version of the next collection the trainer completes (its pending get's,
                 else the last get's + optimizer_steps_per_collection)
    position p of a new group (1-based, from the start of that collection) is trained at
                 next + k * (ceil(p / rollout_batch_size) - 1)
    its tokens are at least the engines' version e, so its age is at most that minus e
    admit while  next + k * (ceil(p / B) - 1) - e <= max_weight_staleness,
    i.e. p <= B * (floor((e + lag - next) / k) + 1)          (the plan's admission horizon)

AReaL (Fu et al. 2025, arXiv 2505.24298, §5.1) caps the samples started at
(version + η + 1) x batch; here the cap moves with what the trainer still has to consume,
counted in whole groups, and with the engines' version, so a spaced-out publication
(publication.every_updates) is paid for at admission instead of by discards.

Not a hard guarantee: a long group can be overtaken by later, shorter ones and so reach the
trainer later than its position said. Those still meet the dequeue filter (SPEC §5), now a
fallback counted apart. A trainer that waits for a collection is never starved: with nothing
in flight, the groups it is missing are admitted whatever the estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rl_async.base.waiters import Waiters


@dataclass
class AdmissionBound:
    lag: int
    collection_groups: int          # rollout_batch_size: groups per collection (B)
    updates_per_collection: int     # optimizer_steps_per_collection (k): versions per get
    next_version: int = 0
    engine_version: int = 0
    tickets: int = 0                # granted, neither inserted nor released
    granted: int = 0                # counters for the summary and tests
    forced: int = 0

    def __post_init__(self) -> None:
        if self.lag < 1 or self.collection_groups < 1 or self.updates_per_collection < 1:
            raise ValueError(f"AdmissionBound(lag={self.lag}, collection_groups="
                             f"{self.collection_groups}, updates_per_collection="
                             f"{self.updates_per_collection}): all must be >= 1 (admission "
                             f"applies to async runs with async.max_weight_staleness >= 1)")

    def horizon(self) -> int:
        """How many groups, counted from the start of the next collection, can be admitted
        within the lag at the engines' current version."""
        span = self.engine_version + self.lag - self.next_version
        if span < 0:
            return 0
        return self.collection_groups * (span // self.updates_per_collection + 1)

    def allowed(self, ahead: int, starving: int = 0) -> int:
        """Groups that may be admitted now. `ahead`: taken + buffered + tickets out.
        `starving`: groups the trainer's pending collection still misses with none in
        flight (granted regardless, so a misconfigured trail never deadlocks a run)."""
        return max(self.horizon() - ahead, starving, 0)

    def grant(self, want: int, ahead: int, starving: int = 0) -> int:
        n = min(want, self.allowed(ahead, starving))
        if n > max(self.horizon() - ahead, 0):
            self.forced += n - max(self.horizon() - ahead, 0)
        self.tickets += n
        self.granted += n
        return n

    def returned(self, n: int) -> None:
        """Tickets given back: groups filtered, aborted, failed or never fetched."""
        if n > self.tickets:
            raise ValueError(f"returned({n}) with only {self.tickets} tickets out: a group "
                             f"was released twice or inserted after its ticket came back")
        self.tickets -= n

    def inserted(self) -> None:
        """A group entered the buffer: its ticket becomes a buffered group."""
        self.tickets = max(0, self.tickets - 1)

    def get_started(self, version: int) -> None:
        self.next_version = max(self.next_version, version)

    def get_returned(self, version: int) -> None:
        self.next_version = max(self.next_version, version + self.updates_per_collection)

    def set_trainer_version(self, version: int) -> None:
        self.next_version = max(self.next_version, version)

    def set_engine_version(self, version: int) -> None:
        self.engine_version = max(self.engine_version, version)

    def to_dict(self) -> dict[str, int]:
        return {"granted": self.granted, "forced": self.forced, "tickets_out": self.tickets}


class AdmissionGate:
    """The bound plus its waiting producers, for the completed buffer: `admit(n)` waits until
    at least one group may be admitted, then grants up to `n`; the buffer calls `wake()`
    whenever what is ahead or a version changes."""

    def __init__(self, bound: AdmissionBound, ahead: Callable[[], int],
                 starving: Callable[[], int]) -> None:
        self.bound = bound
        self._ahead, self._starving = ahead, starving
        self._waiters = Waiters()

    async def admit(self, n: int, check: Callable[[], None]) -> int:
        """Up to `n` tickets (at least one), waiting for room; `check` raises if the buffer
        closed meanwhile."""
        if n < 1:
            raise ValueError(f"admit({n}): ask for at least one group")
        while True:
            check()
            granted = self.bound.grant(n, self._ahead(), self._starving())
            if granted:
                return granted
            await self._waiters.wait()

    def release(self, n: int) -> None:
        self.bound.returned(n)
        self.wake()

    def wake(self) -> None:
        self._waiters.wake_all()


def admission_for(plan) -> AdmissionBound | None:
    """The bound of a capacity plan whose staleness_bound resolved to "admission"."""
    if plan.staleness_bound != "admission":
        return None
    return AdmissionBound(plan.max_weight_staleness, plan.rollout_batch_size,
                          plan.optimizer_steps_per_collection)


def admission_calls(buffer) -> dict:
    """The Producer's `admit` / `release` for a buffer in the same event loop (simulator,
    tests); none when the buffer has no admission bound."""
    if buffer.admission is None:
        return {}

    async def release(n: int) -> None:
        buffer.release(n)
    return {"admit": buffer.admit, "release": release}
