"""Spread generate calls over engines: least outstanding work, with group affinity.

The routing decision is separate from the call, so the same router drives local `Engine`
objects (`generate`) and remote engines the caller wraps itself:

    index = router.pick(group_id, cost)      # decide and account the work
    ... call engine `index` ...
    router.release(index, cost, group_id)    # always, also when the call failed

Load of an engine = outstanding tokens + `request_weight` x outstanding requests, counting only
work assigned through this router (cost = prompt tokens + max_new_tokens is a good estimate).
Group affinity: siblings of one group go to the engine that got the group's first sample (the
prompt prefix is then hot there), unless that engine's load from OTHER work exceeds the least
loaded engine's by more than `max_imbalance` (relative) plus one request's worth (absolute);
then the group moves to the least loaded engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rl_async.engine.base import GenerateOutput, SamplingParams


@dataclass(frozen=True)
class RouterPolicy:
    affinity: bool = True
    max_imbalance: float = 0.5  # affinity tolerates this relative excess of other work
    request_weight: int = 32  # tokens one outstanding request counts for (per-request overhead)
    remembered_groups: int = 100_000  # LRU bound of the group -> engine map

    def __post_init__(self) -> None:
        if self.max_imbalance < 0:
            raise ValueError(f"router.max_imbalance = {self.max_imbalance!r}: must be >= 0")
        if self.request_weight < 0:
            raise ValueError(f"router.request_weight = {self.request_weight!r}: must be >= 0")
        if self.remembered_groups < 1:
            raise ValueError(f"router.remembered_groups = {self.remembered_groups!r}: >= 1")


class NoHealthyEngine(RuntimeError):
    """Every engine is out of routing; the caller waits for one to come back."""


class Router:
    def __init__(self, engines: list, policy: RouterPolicy | None = None):
        if not engines:
            raise ValueError("Router(engines=[]): needs at least one engine")
        self.engines = list(engines)
        self.policy = policy or RouterPolicy()
        n = len(self.engines)
        self._requests = [0] * n
        self._tokens = [0] * n
        self._assigned = [0] * n
        self._healthy = [True] * n  # fault tolerance: unhealthy engines get no new work
        self._affinity_hits = 0
        self._affinity_moves = 0
        # group_id -> [engine index, outstanding score of this group on it]
        self._groups: OrderedDict[str, list[int]] = OrderedDict()

    def _score(self, index: int) -> int:
        return self._tokens[index] + self.policy.request_weight * self._requests[index]

    def _least_loaded(self) -> int:
        candidates = [i for i in range(len(self.engines)) if self._healthy[i]]
        if not candidates:
            raise NoHealthyEngine("no engine is in routing: every engine is down or being "
                                  "restarted")
        return min(candidates, key=lambda i: (self._score(i), self._assigned[i], i))

    def add(self, engine, healthy: bool = False) -> int:
        """A new engine (`rl-async scale`); returns its index. Out of routing until it holds
        the current weights (`set_healthy`)."""
        self.engines.append(engine)
        for counts in (self._requests, self._tokens, self._assigned):
            counts.append(0)
        self._healthy.append(healthy)
        return len(self.engines) - 1

    def outstanding(self, index: int) -> int:
        """Requests routed to engine `index` that have not come back."""
        return self._requests[index]

    def set_healthy(self, index: int, healthy: bool) -> None:
        """Take an engine out of routing (dead, unresponsive, restarting) or back in."""
        self._healthy[index] = healthy

    @property
    def any_healthy(self) -> bool:
        return any(self._healthy)

    def pick(self, group_id: str | None = None, cost: int = 1, sticky: bool = False) -> int:
        """Choose an engine for one request of estimated `cost` tokens and account it.
        `sticky` (the turns of one multi-turn trajectory): stay on the engine of the key's
        earlier requests whatever the load, unless that engine is out of routing."""
        if cost < 0:
            raise ValueError(f"cost = {cost!r}: must be >= 0 (tokens of the request)")
        index = self._least_loaded()
        entry = self._groups.get(group_id) if group_id is not None else None
        if entry is not None and (self.policy.affinity or sticky) and self._healthy[entry[0]]:
            home, own = entry
            other_work = self._score(home) - own
            allowed = ((1 + self.policy.max_imbalance) * self._score(index)
                       + self.policy.request_weight + cost)
            if sticky or other_work <= allowed:
                index = home
                self._affinity_hits += 1
            else:
                self._affinity_moves += 1
        self._requests[index] += 1
        self._tokens[index] += cost
        self._assigned[index] += 1
        if group_id is not None:
            self._remember(group_id, index, cost)
        return index

    def _remember(self, group_id: str, index: int, cost: int) -> None:
        entry = self._groups.get(group_id)
        if entry is None or entry[0] != index:
            entry = [index, 0]
        entry[1] += cost + self.policy.request_weight
        self._groups[group_id] = entry
        self._groups.move_to_end(group_id)
        while len(self._groups) > self.policy.remembered_groups:
            self._groups.popitem(last=False)

    def release(self, index: int, cost: int = 1, group_id: str | None = None) -> None:
        """Undo one `pick(group_id, cost)` that returned `index` (pass the same values)."""
        if not 0 <= index < len(self.engines):
            raise ValueError(f"index = {index!r}: no such engine (have {len(self.engines)})")
        if self._requests[index] < 1 or self._tokens[index] < cost:
            raise ValueError(f"release(index={index}, cost={cost}): more than was picked "
                             f"({self._requests[index]} requests, {self._tokens[index]} "
                             f"tokens outstanding); release each pick exactly once")
        self._requests[index] -= 1
        self._tokens[index] -= cost
        entry = self._groups.get(group_id) if group_id is not None else None
        if entry is not None and entry[0] == index:
            entry[1] = max(0, entry[1] - cost - self.policy.request_weight)

    def loads(self) -> list[dict]:
        """Per engine: outstanding requests and tokens, load score, requests assigned so far."""
        return [{"engine": i, "outstanding_requests": self._requests[i],
                 "outstanding_tokens": self._tokens[i], "score": self._score(i),
                 "assigned_total": self._assigned[i]} for i in range(len(self.engines))]

    def stats(self) -> dict:
        return {"affinity_hits": self._affinity_hits, "affinity_moves": self._affinity_moves,
                "remembered_groups": len(self._groups)}

    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       group_id: str | None = None, request_id: str | None = None,
                       sticky: bool = False) -> tuple[int, GenerateOutput]:
        """Route one request to a local `Engine`; returns (engine index, output)."""
        cost = len(input_ids) + sampling_params.max_new_tokens
        index = self.pick(group_id, cost, sticky)
        try:
            out = await self.engines[index].generate(input_ids, sampling_params, request_id)
        finally:
            self.release(index, cost, group_id)
        return index, out
