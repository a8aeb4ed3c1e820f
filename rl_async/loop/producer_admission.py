"""How the producer opens groups (split out of loop/producer.py): the admission gate (paused
for drains), the synchronous-mode target, a full buffer holding back new groups, batched
fetches from the prompt source, and the staleness bound's tickets.

    wait: gate open, no put waiting for room, target not reached
      -> tickets (async.staleness_bound = "admission": the completed buffer grants only
         groups that fit the lag when the trainer reaches them; loop/admission.py)
      -> fetch that many groups from the prompt source (counted in flight from here)

Tickets are taken before a group counts as in flight, so a drain that pauses admission
never waits for a producer parked on the bound. They come `max_fetch` beyond the need and
are banked (one round trip to the buffer per several groups, not per group); tickets not
used (a paused gate, a short fetch) stay banked, and those of groups that end without
insertion (filtered, aborted, failed) are given back to the buffer.
"""

from __future__ import annotations

import asyncio
import math
from typing import Awaitable, Callable

from rl_async.loop.producer_types import OpenGroup


class AdmissionMixin:
    """Producer methods that open groups; the state lives on the Producer."""

    _admit: Callable[[int], Awaitable[int]] | None
    _release: Callable[[int], Awaitable[None]] | None
    _budget_cap: float = math.inf  # set_budget (async.health_control)
    _bank: int = 0  # admission tickets in hand (granted by the buffer, not yet used)

    def pause_admission(self) -> None:
        """Lifecycle drain: open no new group. Groups already opened still finish (their
        remaining siblings are submitted), so `wait_idle()` ends with nothing owned."""
        self._gate.clear()

    def resume_admission(self) -> None:
        self._gate.set()

    def set_budget(self, groups: int) -> None:
        """async.health_control: open new groups only while fewer than `groups` are in flight
        (at most the plan's budget, which the permits still enforce)."""
        if groups < 1:
            raise ValueError(f"set_budget({groups}): the producer needs at least one group")
        self._budget_cap = groups  # _wait_admissible polls it

    def set_target(self, groups: float) -> None:
        """Synchronous mode: insert exactly this many more groups than every earlier target
        asked for, then stop submitting. Cumulative, not relative to `inserted_groups`: the
        controller may ask for the next collection before this producer has seen the reply
        to the last put of the previous one."""
        base = self._target if math.isfinite(self._target) else self.stats.inserted_groups
        self._target = base + groups

    async def _wait_admissible(self) -> bool:
        """Gate open, no completed group waiting for buffer room, sync target not reached."""
        while True:
            await self._gate.wait()
            await self._no_pending_put.wait()
            if self._stopped or self._fatal is not None:
                return False
            if not self._gate.is_set():  # paused while waiting for buffer room
                continue
            if (self.stats.inserted_groups + self._groups_in_flight < self._target
                    and self._groups_in_flight < self._budget_cap):
                return True
            await asyncio.sleep(0.01)

    async def _tickets(self, want: int) -> int:
        """Up to `want` admissions the staleness bound allows (waiting for one); 0 when the
        producer stopped or its gate closed meanwhile. Tickets are asked for `max_fetch`
        at a time beyond the need and banked here, so most groups open without a round trip
        to the buffer (the bound counts banked tickets as groups ahead: a little tighter)."""
        if self._admit is None:
            return want
        if not self._bank:
            call = asyncio.ensure_future(self._admit(want + self._max_fetch))
            woken = asyncio.ensure_future(self._woken.wait())
            try:
                await asyncio.wait({call, woken}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
            if not call.done():  # stopped or failed while parked on the bound
                call.cancel()
                return 0
            self._bank += call.result()
        if self._stopped or self._fatal is not None or not self._gate.is_set():
            return 0  # banked for later
        take = min(want, self._bank)
        self._bank -= take
        return take

    async def _give_back(self, n: int) -> None:
        if n and self._release is not None:
            await self._release(n)

    async def _open_group(self) -> OpenGroup | None:
        if self._ready:  # fetched earlier, already owned: runs even while admission pauses
            return self._ready.popleft()
        while True:
            if not await self._wait_admissible():
                return None
            granted = await self._tickets(self._fetch_count(counted=False))
            if granted:
                break
            if self._stopped or self._fatal is not None:
                return None
        # Counted before the fetch: the ledger issues the group(s) during it, so a drain
        # that paused admission meanwhile waits for them too (not "idle" with a group half
        # submitted), even if every other group finishes during the fetch.
        self._groups_in_flight += 1
        self._idle.clear()
        groups = []
        try:
            k = min(self._fetch_count(counted=True), granted)
            start = self._now()
            groups = await self._next_groups(k) if k > 1 else [await self._next_group()]
            self.stats.fetch_seconds += self._now() - start
            self.stats.fetches += 1
            for group in groups:
                if group.size != self.limits.group_size:
                    raise ValueError(f"group {group.group_id!r} has {group.size} samples, "
                                     f"expected rollout.n_samples_per_prompt = "
                                     f"{self.limits.group_size}")
        except BaseException:
            self._group_done()
            raise
        finally:
            self._bank += granted - len(groups) if self._admit is not None else 0
        self._groups_in_flight += len(groups) - 1
        self._ready.extend(OpenGroup(g) for g in groups[1:])
        return OpenGroup(groups[0])

    def _fetch_count(self, counted: bool) -> int:
        """Groups to open now: one plus whole groups of free budget, within the target;
        `counted`: the one being fetched is already counted in flight."""
        if self._next_groups is None:
            return 1
        free = self._budget._value // self.limits.group_size  # CPython asyncio: free permits
        in_flight = self._groups_in_flight - (1 if counted else 0)
        room = min(self._target - self.stats.inserted_groups, self._budget_cap) - in_flight
        return int(max(1, min(self._max_fetch, 1 + free, room)))
