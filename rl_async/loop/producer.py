"""The producer: turns prompts into completed, rewarded groups under the SPEC §4 limits.

    source.next_group --[producer budget]--> per-sample tasks --[generation semaphore]-->
        engine.generate --(release semaphore)--> reward --> all siblings done --> buffer.put

Limits, all read from the capacity plan (never recomputed here):
- producer budget, in whole groups: `group` granularity holds `group_size` permits until the
  group is inserted into the buffer (ownership passes on insertion); `sample` granularity
  frees each sample's permit as soon as that sample is generated and rewarded (backfill).
- one global generation semaphore of `http_slots` = server_concurrency x engines, held only
  around the generation call; rewards run after releasing it.
- a full buffer blocks insertion, hence new submissions: no new group is opened while a
  completed group waits for room. Requests already submitted still finish.

Group lifecycle here: opened -> generating -> rewarded -> inserted | filtered | aborted | failed.
An aborted sample (publication drain past its timeout, shutdown) aborts its group attempt; a
reward error or a rejected request fails the group with the error. Both are reported to
the ledger, which regenerates aborted prompts from the original prompt. Any other exception
(a dead engine or buffer actor) is fatal: `run()` raises it, so the controller stops with
the cause instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import deque
from typing import Any, Awaitable, Callable

from rl_async.base import clock
from rl_async.engine.base import EngineError, GenerateOutput
from rl_async.loop.faults import FailureBudget
from rl_async.algo.seeding import sample_seed
from rl_async.loop.trajectory import GroupSlot, TrajectoryRunner, turn_request
# Re-exported: callers import the limits, stats and filter from here.
from rl_async.loop.producer_types import ProducerLimits, ProducerStats, zero_variance  # noqa: F401
from rl_async.loop.producer_types import OpenGroup
from rl_async.loop.producer_admission import AdmissionMixin
from rl_async.base.types import Group, Sample

# Tries of one multi-turn trajectory's turn after an engine aborted it, before the trajectory
# (and its group) is aborted and regenerated from its row.
TURN_RETRIES = 3


class Producer(AdmissionMixin):
    def __init__(self, limits: ProducerLimits, *,
                 next_group: Callable[[], Awaitable[Group]],
                 generate: Callable[[Sample, str], Awaitable[GenerateOutput]],
                 score: Callable[[Sample], Awaitable[float]],
                 put: Callable[[Group], Awaitable[None]],
                 on_aborted: Callable[[Group], Awaitable[None]],
                 on_failed: Callable[[Group, str], Awaitable[None]],
                 group_errors: tuple[type[BaseException], ...] = (),
                 filter_group: Callable[[Group], str | None] | None = None,
                 on_filtered: Callable[[Group, str], Awaitable[None]] | None = None,
                 failure_budget: FailureBudget | None = None,
                 next_groups: Callable[[int], Awaitable[list[Group]]] | None = None,
                 max_fetch_groups: int = 8,
                 engine_ready: Callable[[], Awaitable[None]] | None = None,
                 seed: int | None = None, trajectory: TrajectoryRunner | None = None,
                 admit: Callable[[int], Awaitable[int]] | None = None,
                 release: Callable[[int], Awaitable[None]] | None = None):
        if limits.producer_samples < limits.group_size or limits.producer_samples % limits.group_size:
            raise ValueError(f"producer budget {limits.producer_samples} must be a positive whole "
                             f"number of groups of {limits.group_size}")
        self.limits = limits
        self._next_group, self._generate, self._score, self._put = next_group, generate, score, put
        self._on_aborted, self._on_failed = on_aborted, on_failed
        self._group_errors = group_errors
        if (filter_group is None) != (on_filtered is None):
            raise ValueError("Producer: pass both filter_group and on_filtered, or neither")
        self._filter_group, self._on_filtered = filter_group, on_filtered
        self._budget_of_failures = failure_budget
        self._engine_ready = engine_ready
        # async.staleness_bound = "admission": tickets from the completed buffer before a
        # group opens, given back for groups never inserted (loop/producer_admission.py)
        if (admit is None) != (release is None):
            raise ValueError("Producer: pass both admit and release, or neither")
        self._admit, self._release = admit, release
        self._woken = asyncio.Event()  # stop or a fatal error: leave a wait on the bound
        self._now = clock.now
        # With a run seed, every sample carries its own sampling seed (rl_async.algo.seeding), so
        # its tokens do not depend on arrival order; None leaves it to the engine's stream.
        self._seed = seed
        # Multi-turn environments (SPEC §12): a sample is a trajectory of turns, each turn
        # one gated generation request (routed to the trajectory's engine), scored by the
        # environment instead of `score`.
        self._trajectory = trajectory
        # Opening groups k at a time saves k - 1 round trips to the prompt source; k never
        # exceeds the free budget (in whole groups) or a sync-mode target, so no more groups
        # are owned than could be submitted now. Fetched groups are opened (in flight) at once.
        self._next_groups, self._max_fetch = next_groups, max(1, max_fetch_groups)
        self._ready: deque[OpenGroup] = deque()
        self._budget = asyncio.Semaphore(limits.producer_samples)
        self._gen_sem = asyncio.Semaphore(limits.http_slots)
        self._gate = asyncio.Event()        # admission of new groups
        self._gate.set()
        self._gen_gate = asyncio.Event()    # submission of generation requests
        self._gen_gate.set()
        self._gen_idle = asyncio.Event()    # no generation request outstanding
        self._gen_idle.set()
        self._no_pending_put = asyncio.Event()  # no put may be waiting for buffer room
        self._no_pending_put.set()
        self._pending_puts = 0
        # Buffer room the last finished put reported (a `put` that returns None reports
        # nothing: 0, every pending put may be waiting). Pending puts beyond it may be
        # waiting for room, and then no new group is opened (SPEC §4).
        self._known_room: float = 0
        self._open: OpenGroup | None = None
        self._groups_in_flight = 0
        self._samples_in_flight = 0
        self._busy_since = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._target: float = math.inf  # groups to insert before stopping (sync mode)
        self._tasks: set[asyncio.Task] = set()
        self._fatal: BaseException | None = None
        self._stopped = False
        self.stats = ProducerStats()

    # ---- control (called by the controller) -------------------------------------------
    def pause_generation(self) -> None:
        """Publication drain (refresh off): send no new generation request to any engine.
        Requests already sent finish under the weights they started with."""
        self._gen_gate.clear()

    def resume_generation(self) -> None:
        self._gen_gate.set()

    def resize(self, producer_samples: int, http_slots: int) -> None:
        """New limits for a fleet that changed size (`rl-async scale`). A larger limit frees
        its new permits at once; a smaller one takes permits back as work in flight
        returns them (nothing in flight is cut short)."""
        g = self.limits.group_size
        if producer_samples < g or producer_samples % g:
            raise ValueError(f"producer budget {producer_samples} must be a positive whole "
                             f"number of groups of {g}")
        for sem, old, new in ((self._budget, self.limits.producer_samples, producer_samples),
                              (self._gen_sem, self.limits.http_slots, http_slots)):
            for _ in range(new - old):
                sem.release()
            if new < old:
                self._spawn(self._take_back(sem, old - new))
        self.limits = dataclasses.replace(self.limits, producer_samples=producer_samples,
                                          http_slots=http_slots)

    @staticmethod
    async def _take_back(sem: asyncio.Semaphore, permits: int) -> None:
        for _ in range(permits):
            await sem.acquire()

    async def drain_generation(self, timeout_s: float) -> bool:
        """Wait until no generation request is outstanding; False if `timeout_s` passed."""
        try:
            await asyncio.wait_for(self._gen_idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_idle(self) -> None:
        """Wait until no group is in flight (all inserted, aborted or failed)."""
        await self._idle.wait()
        self._raise_fatal()

    def stop(self) -> None:
        self._stopped = True
        self._gate.set()
        self._gen_gate.set()
        self._woken.set()

    @property
    def groups_owned(self) -> int:
        """Groups opened (or being fetched) and not yet inserted, filtered, aborted or
        failed."""
        return self._groups_in_flight

    def load(self) -> dict[str, float]:
        return {"groups_in_flight": self._groups_in_flight,
                "samples_in_flight": self._samples_in_flight,
                "pending_puts": self._pending_puts,
                "paused": float(not self._gate.is_set())}

    # ---- main loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """Submit work until stopped. Raises the first fatal error (e.g. a dead actor)."""
        try:
            while not self._stopped:
                self._raise_fatal()
                if self.limits.granularity == "group":
                    await self._admit_group()
                else:
                    await self._admit_sample()
        finally:
            self._raise_fatal()

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    async def _admit_group(self) -> None:
        for _ in range(self.limits.group_size):
            await self._budget.acquire()
        og = await self._open_group()
        if og is None:
            self._release_budget(self.limits.group_size)
            return
        self._spawn(self._run_group(og))

    async def _admit_sample(self) -> None:
        await self._budget.acquire()
        if self._open is None or self._open.next_index >= self.limits.group_size:
            self._open = await self._open_group()
            if self._open is None:
                self._release_budget(1)
                return
        og = self._open
        index = og.next_index
        og.next_index += 1
        self._spawn(self._run_sample_backfill(og, index))

    def _release_budget(self, n: int) -> None:
        for _ in range(n):
            self._budget.release()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()
            self._gate.set()  # wake the admission loop so run() raises
            self._woken.set()

    # ---- per-group / per-sample work ------------------------------------------------------
    async def _run_group(self, og: OpenGroup) -> None:
        try:
            og.next_index = self.limits.group_size
            await asyncio.gather(*(self._run_sample(og, i) for i in range(self.limits.group_size)))
            await self._finish(og)
        finally:
            self._release_budget(self.limits.group_size)

    async def _run_sample_backfill(self, og: OpenGroup, index: int) -> None:
        try:
            await self._run_sample(og, index)
        finally:
            self._release_budget(1)
        if og.done == self.limits.group_size:
            await self._finish(og)

    async def _run_sample(self, og: OpenGroup, index: int) -> None:
        sample = og.group.samples[index]
        try:
            if not (og.aborted or og.error):
                if self._seed is not None:
                    g = og.group
                    sample.seed = sample_seed(self._seed, g.cursor, g.attempt, index)
                if self._trajectory is not None:
                    await self._run_trajectory(og, sample, index)
                else:
                    await self._generate_sample(og, sample)
            if not (og.aborted or og.error) and self._trajectory is None:
                start = clock.now()
                sample.reward = await self._score(sample)
                self.stats.score_seconds += clock.now() - start
                self.stats.scored_samples += 1
        except self._group_errors as exc:
            og.error = og.error or exc
        finally:
            og.done += 1

    async def _run_trajectory(self, og: OpenGroup, sample: Sample, index: int) -> None:
        key = f"{og.group.group_id}/{index}"  # all turns on one engine (prefix reuse)

        async def turn(input_ids: list[int], max_new_tokens: int, t: int) -> GenerateOutput:
            # An aborted turn (an engine lost, a publication drain past its timeout) costs
            # that turn, not the trajectory: the same tokens are sent again (the router moves
            # a lost engine's trajectory to another one), up to TURN_RETRIES times.
            request = turn_request(sample, input_ids, t)
            for _ in range(TURN_RETRIES):
                out = await self._request(request, key, max_new_tokens)
                if out.finish_reason != "abort" or self._stopped:
                    return out
                self.stats.retried_turns += 1
                self.stats.aborted_tokens += len(out.output_ids)
            return await self._request(request, key, max_new_tokens)

        slot = GroupSlot(og.group.group_id, index, self.limits.group_size)
        result = await self._trajectory.run(sample, turn, slot)
        self.stats.record_trajectory(result)
        if result.finish == "abort":
            og.aborted = True
            og.abort_reason = og.abort_reason or result.reason

    async def gated(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()` (an evaluation request) under the generation semaphore rollouts use, so
        evaluations count against the same `server_concurrency x engines` permits; outside
        the rollout statistics."""
        async with self._gen_sem:
            return await call()

    async def _request(self, sample: Sample, key: str, max_new_tokens: int | None = None
                       ) -> GenerateOutput:
        """One generation request under the semaphore and the publication gate."""
        async with self._gen_sem:
            # Re-check the gate after getting a permit: a publication may have started while
            # this sample waited, and no request may reach an engine during the transfer.
            # With every engine down (fault tolerance), wait for one here, NOT counted in
            # flight: a publication's drain must not wait for requests that no engine holds
            # (the replacement gets its weights from that very publication).
            while True:
                while not self._gen_gate.is_set():
                    await self._gen_gate.wait()
                if self._engine_ready is not None:
                    await self._engine_ready()
                if self._gen_gate.is_set():
                    break
            if self._samples_in_flight == 0:
                self._busy_since = clock.now()
            self._samples_in_flight += 1
            self._gen_idle.clear()
            self.stats.submitted_samples += 1
            start = clock.now()
            try:
                out = await (self._generate(sample, key) if max_new_tokens is None
                             else self._generate(sample, key, max_new_tokens))
            finally:
                self._samples_in_flight -= 1
                if self._samples_in_flight == 0:
                    self._gen_idle.set()
                    self.stats.generation_busy_seconds += clock.now() - self._busy_since
                self.stats.generation_seconds += clock.now() - start
            inside = getattr(out, "engine_seconds", None)
            if inside is not None:  # the round trip outside the engine
                self.stats.transit_seconds += max(0.0, clock.now() - start - inside)
                self.stats.transit_samples += 1
        return out

    async def _generate_sample(self, og: OpenGroup, sample: Sample) -> None:
        out = await self._request(sample, og.group.group_id)
        out.check(f"group {og.group.group_id!r}")
        sample.response_ids = list(out.output_ids)
        sample.behavior_logprobs = list(out.output_logprobs)
        sample.token_versions = list(out.token_versions)
        sample.finish_reason = out.finish_reason
        sample.routed_experts = out.routed_experts
        self.stats.refreshed_requests += int(out.refreshes > 0)
        if out.token_versions and min(out.token_versions) != max(out.token_versions):
            self.stats.mixed_version_responses += 1
        if out.finish_reason == "abort":
            og.aborted = True
            self.stats.aborted_samples += 1
            self.stats.aborted_tokens += len(out.output_ids)
        else:
            self.stats.generated_tokens += len(out.output_ids)

    async def _finish(self, og: OpenGroup) -> None:
        try:
            if og.error is not None:
                self.stats.failed_groups += 1
                await self._on_failed(og.group, f"{type(og.error).__name__}: {og.error}")
                if self._budget_of_failures is not None:  # may stop the run (RunStopped)
                    self._budget_of_failures.record(True, type(og.error).__name__,
                                                    str(og.error))
            elif og.aborted:
                self.stats.aborted_groups += 1
                # The cause, where one was given (an agent's refused call): the ledger's
                # record, and its failure message once the retries run out.
                await self._on_aborted(og.group, *([og.abort_reason] if og.abort_reason else []))
            elif self._filter_group is not None and (reason := self._filter_group(og.group)):
                # A put-time filter: the prompt is done (counted as filtered); admission
                # opens a new prompt in its place, so collections still fill.
                self.stats.filtered_groups += 1
                await self._on_filtered(og.group, reason)
            else:
                og.inserted = await self._insert(og.group)
            if not og.inserted:
                await self._give_back(1)  # never inserted: its admission ticket goes back
            if og.error is None and not og.aborted and self._budget_of_failures is not None:
                self._budget_of_failures.record(False)
        finally:
            self._group_done()

    def _group_done(self) -> None:
        self._groups_in_flight -= 1
        if self._groups_in_flight == 0:
            self._idle.set()

    async def _insert(self, group: Group) -> bool:
        self._pending_puts += 1
        self._update_put_gate()
        start = clock.now()
        try:
            room = await self._put(group)
            self._known_room = room if isinstance(room, (int, float)) else 0
            self.stats.inserted_groups += 1
            return True
        finally:
            self.stats.put_wait_seconds += clock.now() - start
            self._pending_puts -= 1
            self._update_put_gate()

    def _update_put_gate(self) -> None:
        if self._pending_puts <= self._known_room:  # every pending put fits: none waits
            self._no_pending_put.set()
        else:
            self._no_pending_put.clear()
