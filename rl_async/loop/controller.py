"""The controller loop: owns the policy version, collections, publication, eval and drains.

    evaluate(v=0) --> start producer
      loop until run.max_steps optimizer updates:
        [sync: allow one collection]  get rollout_batch_size groups at version v  (trainer wait)
        train the collection (k optimizer updates)      v += k
        publish v to every engine (Publisher state machine)
        metrics -> logger;  [eval every N with a lifecycle drain];  [checkpoint]
      shutdown drain (nothing owned is lost) --> evaluate(final) --> summary

Everything remote goes through the `Fleet` protocol (Ray actor handles in actors/), so this
loop has no Ray in it. Failures are never waited out: the collection wait races the producer
task, and a dead producer, engine, reward or buffer actor ends the run with its cause.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

from rl_async.base import clock
from rl_async.observe.calibration import CalibrationStats
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.plan.schedule import generates_per_collection, publication_overlaps_training
from rl_async.loop.faults import quote
from rl_async.loop.health import health_for
from rl_async.loop.progress import (CUMULATIVE, Progress, cumulative_state,
                                    orchestration_metrics)
from rl_async.loop.run_summary import run_summary
from rl_async.observe.offpolicy import OffPolicyStats
from rl_async.observe.routing import RoutingStats
from rl_async.plan.memory import architecture
from rl_async.plan.moe import moe_dims, replay_for
from rl_async.observe.provenance import ProvenanceTotals
from rl_async.observe.staleness import StalenessSplit
from rl_async.loop.publish import PublicationOps, Publisher
from rl_async.loop.threads import balancer_for, usage_from
from rl_async.base.types import Group


class RunFailed(RuntimeError):
    """The run stopped on an error; the message names the component and the cause."""


class Fleet(PublicationOps, Protocol):
    async def producer_task(self) -> asyncio.Future: ...
    async def producer_set_target(self, groups: float) -> None: ...
    async def producer_pause_admission(self) -> None: ...
    async def producer_resume_admission(self) -> None: ...
    async def producer_wait_idle(self, timeout_s: float) -> bool: ...
    async def producer_stop(self) -> None: ...
    async def producer_set_budget(self, groups: int) -> None: ...
    async def get_groups(self, n: int, version: int) -> list[Group]: ...
    async def buffer_set_version(self, version: int | None,
                                 engine_version: int | None = None) -> None: ...
    async def buffer_reserve(self, n_groups: int) -> None: ...
    async def producer_groups_owned(self) -> int: ...
    async def train(self, groups: list[Group], version: int) -> dict[str, float]: ...
    async def set_threads(self, engine: int, trainer: int) -> None: ...
    async def evaluate(self) -> dict[str, float]: ...
    async def checkpoint(self, step: int, version: int, progress: dict | None = None) -> str: ...
    async def record_trained(self, step: int, version: int, groups: list[Group],
                             info: dict | None = None) -> None: ...
    async def metrics(self) -> dict[str, float]: ...
    async def ledger(self) -> dict[str, int]: ...
    async def progress_marker(self) -> int: ...
    async def diagnosis(self) -> dict: ...
    async def faults(self) -> dict: ...
    async def rollout(self) -> dict: ...


def canonical_order(groups: list[Group]) -> list[Group]:
    """A collection in (prompt cursor, attempt) order, not completion order: micro-batches and
    data-parallel shards (groups[rank::world]) are then functions of the data alone."""
    return sorted(groups, key=lambda g: (g.cursor, g.attempt))


class Controller:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, fleet: Fleet,
                 log: Callable[[dict[str, float], int], None], watchdog_s: float = 60.0,
                 start_step: int = 0, start_version: int = 0, resumed: dict | None = None):
        """`start_step` / `start_version`: a resumed run continues the counts of its
        checkpoint (run.max_steps is the run's total); `resumed`: the checkpoint's progress
        (rl_async.loop.progress.cumulative_state), so the summary counts the whole run."""
        self.cfg, self.plan, self.fleet, self.log = cfg, plan, fleet, log
        self.version = start_version
        self.publisher = Publisher(cfg.refresh.mode, cfg.publication.drain_timeout_s,
                                   cfg.publication.timeout_s)
        self.progress = Progress(step=start_step, version=start_version)
        self._resumed = dict(resumed or {})
        for name in CUMULATIVE:
            if name in self._resumed:
                setattr(self.progress, name, self._resumed[name])
        # What `rl-async simulate --calibrate` reads back from the summary.
        self.calibration = CalibrationStats()
        self.provenance = ProvenanceTotals()  # run.audit_fraction's findings
        self.offpolicy = OffPolicyStats(cfg.train.policy_loss, cfg.train.is_mask)
        self.routing = RoutingStats(moe=moe_dims(architecture(cfg)[0]) is not None,
                                    replay=replay_for(cfg, cfg.train.routing_replay))
        self.staleness = StalenessSplit()
        self.health = health_for(cfg, plan)  # async.health_control (loop/health.py)
        self.watchdog_s = watchdog_s
        self._producer: asyncio.Future | None = None
        self.started = 0.0
        # Set by a graceful stop request: finish the current collection, drain, summarise.
        self.stop_requested = False
        self._pub_task: asyncio.Future | None = None
        self._overlap_publication = publication_overlaps_training(cfg, plan)
        self._published = start_version  # the version the last publication started (engines')
        self.checkpoint_dir: str | None = None
        # a resumed run already holds the checkpoint of its start step
        self._checkpoint_step: int | None = start_step if start_step else None
        self.threads = balancer_for(cfg)  # None: threads stay as planned
        self._loop_s = 0.0  # collection + training + publication seconds, evaluations out

    async def run(self) -> dict[str, Any]:
        # a resumed run's clock continues where its checkpoint left it
        self.started = clock.now() - float(self._resumed.get("wall_seconds", 0.0))
        p = self.progress
        p.phase = "eval"
        started_at = await self._evaluate()
        if "initial_eval" not in self._resumed:
            p.initial_eval = started_at
        if generates_per_collection(self.cfg, self.plan):
            # Before the producer starts: with no target it would open groups up to its
            # whole budget, which may exceed one collection (then sampled ahead and stale).
            await self.fleet.producer_set_target(0)
        self._producer = await self.fleet.producer_task()
        p.phase = "training"
        try:
            while p.step < self.cfg.run.max_steps and not self.stop_requested:
                await self._one_collection()
        except BaseException:
            # No drain after a failure: the actor that failed may be the one a drain waits
            # on. The driver reports the cause and the ledger as it stands.
            p.phase = "failed"
            raise
        p.phase = "draining"
        await self._land_current_version()  # the final evaluation needs the final weights
        await self._shutdown_drain()
        p.phase = "eval"
        p.final_eval = await self._evaluate()
        p.phase = "checkpoint"
        await self._checkpoint()  # every run ends with a checkpoint and its HF export
        p.phase = "done"
        return await self.summary()

    async def _one_collection(self) -> None:
        p = self.progress
        if generates_per_collection(self.cfg, self.plan):
            await self.fleet.producer_set_target(self.plan.rollout_batch_size)
        wait_start = clock.now()
        groups = canonical_order(await self._get_collection())
        wait = clock.now() - wait_start
        train_start = clock.now()
        train_metrics = await self._bounded(self.fleet.train(groups, self.version),
                                            f"training the collection at version {self.version}")
        train_s = clock.now() - train_start
        self.provenance.observe(train_metrics)
        skipped = int(train_metrics.get("train/nonfinite_updates", 0))
        p.nonfinite_updates += skipped
        trained_at = self.version
        updates = self.plan.optimizer_steps_per_collection
        self.version += updates
        p.step += updates
        # a skipped update's samples reached no weights: the trained log says so
        p.trained_samples += sum(len(g.samples) for g in groups) * (updates - skipped) // updates
        info = {"skipped_updates": skipped} if skipped else {}
        if "trainer/threads" in train_metrics:  # CPU trainers report theirs (replay uses it)
            info["trainer_threads"] = int(train_metrics["trainer/threads"])
        await self.fleet.record_trained(p.step, trained_at, groups, info)
        # The buffer stamps each arriving group with the trainer's version (the in-flight /
        # in-queue split of its age): tell it the new one now, not at the next get.
        await self.fleet.buffer_set_version(self.version)
        health = await self._health(train_metrics, p.step)
        pub_start = clock.now()
        # Actor metrics are gathered while the publication snapshots (one round trip each,
        # slow when actors are busy): the loop does not pay for them in turn.
        fleet_metrics = asyncio.ensure_future(self._gather_metrics(pub_start))
        # publication.every_updates: publish once the trainer is that many updates past the
        # engines. Each publication drains the engines (no new request until in-flight ones
        # finish); validate keeps the spacing within the lag (plan/schedule.py).
        every = self.health.current_every if self.health else self.cfg.publication.every_updates
        due = self.version - self._published >= every
        pub_metrics = {"publish/skipped": float(not due), **health}
        if due:
            pub_metrics.update(await self._publish(self.version))
        pub_s = clock.now() - pub_start
        gathered, gather_s = await fleet_metrics
        updates = self.plan.optimizer_steps_per_collection
        metrics = {**train_metrics, **pub_metrics, **gathered,
                   # the gather's time, and what of it the loop waited beyond the publication
                   "perf/metrics_gather_seconds": gather_s,
                   "perf/metrics_wait_seconds_per_step": max(0.0, gather_s - pub_s) / updates}
        metrics.update(self.staleness.observe(groups))
        metrics.update(p.collection_metrics(groups, wait, self.version,
                                            clock.now() - self.started))
        p.count_discards(metrics)
        metrics.update(orchestration_metrics(clock.now() - wait_start, wait, train_s,
                                             pub_s, self.plan.optimizer_steps_per_collection))
        self.calibration.observe_collection(groups, train_s)
        self.calibration.observe_metrics(metrics)
        self.offpolicy.observe(metrics)
        self.routing.observe(metrics)
        self._loop_s += clock.now() - wait_start
        if self.threads is not None:
            await self._balance_threads(metrics)
        self.log(metrics, p.step)
        every = self.cfg.eval.every_steps
        if every and p.step % every == 0 and p.step < self.cfg.run.max_steps:
            await self._evaluate_mid_run()
        ce = self.cfg.run.checkpoint_every
        if ce and p.step % ce == 0:
            await self._checkpoint()

    async def _health(self, train_metrics: dict[str, float], step: int) -> dict[str, float]:
        """async.health_control: this collection's verdict and decisions (loop/health.py)."""
        if self.health is None:
            return {}
        decisions = self.health.observe(train_metrics, step)
        if any(d["action"] in ("lower_budget", "raise_budget") for d in decisions):
            await self._bounded(self.fleet.producer_set_budget(self.health.current_budget),
                                "setting the producer budget")
        return self.health.metrics(decisions)

    async def _balance_threads(self, metrics: dict[str, float]) -> None:
        split = self.threads.observe(usage_from(metrics, self.cfg.cluster.trainer_workers,
                                                self._loop_s, self.progress.step, clock.now()))
        if split is not None:
            await self._bounded(self.fleet.set_threads(split.engine, split.trainer),
                                "setting torch threads")
        self.progress.bound = self.threads.bound
        metrics.update(self.threads.metrics())

    async def _gather_metrics(self, start: float) -> tuple[dict[str, float], float]:
        metrics = await self.fleet.metrics()
        return metrics, clock.now() - start

    async def _publish(self, version: int) -> dict[str, float]:
        """Publish `version`. When overlap is allowed (publication_overlaps_training), only the
        snapshot is awaited: the drain and transfer overlap the next collection's training,
        and the next publication first waits for this one (one transfer at a time). Engines
        then lag the trainer by at most one publication, which the staleness filter accounts
        for."""
        previous = await self._finish_publication()
        self._published = version
        snapshotted = asyncio.Event()
        task = asyncio.ensure_future(self._publish_and_land(version, snapshotted))
        waiter = asyncio.ensure_future(snapshotted.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # a failure before the snapshot finished: raise it here
        self._pub_task = task
        if not self._overlap_publication:
            return await self._finish_publication()
        return previous

    async def _publish_and_land(self, version: int, snapshotted: asyncio.Event):
        """One publication; the moment it lands the buffer learns the engines' version (the
        admission bound's floor), not when the controller next awaits it (a collection
        later when publications overlap training)."""
        result = await self.publisher.publish(version, self.fleet, snapshotted)
        await self.fleet.buffer_set_version(None, version)
        return result

    async def _land_current_version(self) -> None:
        """Publish the trainer's version if a cadence skipped it (publication.every_updates),
        and wait until the engines hold it; logs each publication's metrics."""
        landed = [await self._publish(self.version)] if self._published != self.version else []
        landed.append(await self._finish_publication())
        for metrics in landed:  # the calibration counts these publications too
            self.calibration.observe_metrics(metrics)
            self.log(metrics, self.progress.step)

    async def _finish_publication(self) -> dict[str, float]:
        """Wait for the publication in flight, if any; its metrics (empty when none)."""
        task, self._pub_task = self._pub_task, None
        if task is None:
            return {}
        return (await task).metrics()

    async def _get_collection(self) -> list[Group]:
        """Wait for a collection while watching the producer: a dead producer (or an engine,
        reward or source actor it depends on) ends the wait with its cause."""
        get = asyncio.ensure_future(self.fleet.get_groups(self.plan.rollout_batch_size,
                                                          self.version))
        stall_s = self.cfg.run.stall_timeout_s
        tick = min(self.watchdog_s, stall_s / 4)
        marker, since = await self.fleet.progress_marker(), clock.now()
        while True:
            pub = self._pub_task
            if pub is not None and pub.done() and pub.exception() is not None:
                get.cancel()
                raise RunFailed(f"weight publication of version {self.version} failed: "
                                f"{pub.exception()}") from pub.exception()
            watched = {get, self._producer} | ({pub} if pub and not pub.done() else set())
            done, _ = await asyncio.wait(watched, timeout=tick,
                                         return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            if self._producer.done():
                get.cancel()
                exc = self._producer.exception() if not self._producer.cancelled() else None
                cause = getattr(exc, "cause", None) or exc  # a Ray error wraps the real one
                raise RunFailed(f"the producer stopped while the trainer waited for a "
                                f"collection: {type(cause).__name__}: {quote(str(cause))}"
                                ) from exc
            if done:
                continue  # the publication finished; keep waiting for the collection
            now, current = clock.now(), await self.fleet.progress_marker()
            if current != marker:
                marker, since = current, now
            elif now - since > stall_s:
                get.cancel()
                raise RunFailed(
                    f"stalled: no group reached the buffer and no optimizer step finished for "
                    f"{now - since:.0f} s (run.stall_timeout_s = {stall_s:g}); what each stage "
                    f"holds: {await self.fleet.diagnosis()}")
            self.log({"watchdog/no_progress_seconds": now - since}, self.progress.step)

    async def _evaluate_mid_run(self) -> None:
        """A mid-run evaluation of the current policy, once its publication has landed.
        With eval.drain (and always when nothing is generated ahead, as in sync runs) it is
        a lifecycle drain: open no new group, let owned groups land (in reserved buffer
        room), evaluate, resume. Without it, generation goes on beside the evaluation: no
        publication can start before it ends, so the engines hold the evaluated weights."""
        await self._land_current_version()
        if self.threads is not None:  # the evaluation's generation is not the loop's load
            self.threads.interrupt()
        if not self.cfg.eval.drain and not generates_per_collection(self.cfg, self.plan):
            await self._evaluate()
            return
        await self._reserve_for_owned()
        try:
            await self.fleet.producer_wait_idle(self.cfg.publication.drain_timeout_s)
            await self._evaluate()
        finally:
            await self.fleet.producer_resume_admission()
            await self.fleet.buffer_reserve(0)

    async def _bounded(self, coro, what: str):
        """A step that must finish within run.stall_timeout_s (a wedged trainer surfaces as
        an error naming what it was doing)."""
        try:
            return await asyncio.wait_for(coro, self.cfg.run.stall_timeout_s)
        except asyncio.TimeoutError:
            raise RunFailed(f"stalled: {what} did not finish within run.stall_timeout_s = "
                            f"{self.cfg.run.stall_timeout_s:g} s") from None

    async def _checkpoint(self) -> None:
        """A checkpoint at this step (once): trainer state, ledger and the HF export."""
        p = self.progress
        if self._checkpoint_step != p.step:
            if self.threads is not None:  # nor is the checkpoint's work
                self.threads.interrupt()
            self.checkpoint_dir = await self._bounded(
                self.fleet.checkpoint(p.step, self.version,
                                      cumulative_state(p, clock.now() - self.started)),
                f"the checkpoint of step {p.step}")
            self._checkpoint_step = p.step

    async def _evaluate(self) -> float:
        """Evaluate the engines' current policy; logs eval/* and extends the eval curve."""
        p = self.progress
        start = clock.now()
        try:  # every wait has a deadline: an evaluation that cannot finish is a stall
            result = await asyncio.wait_for(self.fleet.evaluate(), self.cfg.run.stall_timeout_s)
        except asyncio.TimeoutError:
            raise RunFailed(f"stalled: the evaluation at step {p.step} did not finish within "
                            f"run.stall_timeout_s = {self.cfg.run.stall_timeout_s:g} s; what "
                            f"each stage holds: {await self.fleet.diagnosis()}") from None
        seconds = clock.now() - start
        wall = clock.now() - self.started
        self.calibration.observe_eval(seconds)
        p.eval_curve.append([p.step, round(wall, 3), result["reward"]])
        p.eval_first = p.eval_first or dict(result)
        p.eval_last = dict(result)
        self.log({**{f"eval/{k}": v for k, v in result.items()}, "eval/wall_seconds": wall,
                  "eval/seconds": seconds}, p.step)
        return result["reward"]

    async def _reserve_for_owned(self) -> None:
        """Stop opening groups, then reserve buffer room for every group the producer owns:
        with admission closed that count can only fall, so every owned group fits."""
        await self.fleet.producer_pause_admission()
        await self.fleet.buffer_reserve(await self.fleet.producer_groups_owned())

    async def _shutdown_drain(self) -> None:
        """Graceful stop: no new groups; owned groups finish into reserved room or, past the
        drain timeout, are aborted (and counted). Nothing owned is lost."""
        await self._reserve_for_owned()
        if not await self.fleet.producer_wait_idle(self.cfg.publication.drain_timeout_s):
            await self.fleet.pause_engines("abort")
            await self.fleet.producer_wait_idle(self.cfg.publication.drain_timeout_s)
            await self.fleet.continue_engines()
        await self.fleet.producer_stop()

    async def summary(self) -> dict[str, Any]:
        return await run_summary(self)
