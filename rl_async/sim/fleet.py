"""The simulated fleet: the controller's `Fleet` built from the real core, on a virtual clock.

    PromptLedger --> Producer (budget, HTTP gate) --> Router --> SimEngine x engines
         ^                                                     (continuous batching)
         |                                                          |
         +-- retries <-- CompletedBuffer <-- rewarded groups <------+
                               |
    Controller --get--> collection --> train: sleep(TrainerTiming) --> Publisher:
        drain / abort (refresh off) or retract (mixed_policy) --> buckets of TransferTiming
        to every engine --> continue

Everything but the engines' arithmetic and the trainer's compute is the code a real run
executes (rl_async.loop.producer, buffer, ledger, publish, controller, engine.router): the limits,
drains, staleness filter, evictions and retries are therefore the real ones. The engines are
the synthetic engine (rl_async.engine.synthetic): a request waits for one of
`max_running_requests` slots, joins the batch between two steps, pays prefill (which samples
its first token), then one decode step per further token, where a step's time grows with the
running requests and KV tokens (rl_async.engine.timing). The HTTP gate
of `server_concurrency x engines` is the producer's semaphore, as in a real run.

Not modelled: rewards (0/1 coin flips, so `filter.zero_variance` is not simulated), judge
latency, checkpoint time, engine faults; actor round trips only where calibrated (a generate
call's, a collection's transport, the controller's own time per step, publication control).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from rl_async.base import clock
from rl_async.loop.buffer import CompletedBuffer, buffer_options
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.engine.base import GenerateOutput, SamplingParams
from rl_async.engine.router import Router
from rl_async.engine.synthetic import SyntheticEngine, SyntheticEngineConfig
from rl_async.engine.timing import bucket_sizes
from rl_async.loop.admission import admission_calls
from rl_async.loop.ledger import PromptLedger
from rl_async.loop.producer import Producer, ProducerLimits
from rl_async.observe.queue_metrics import AGE_BIN_LABELS, LENGTH_BIN_LABELS, age_bin, length_bin
from rl_async.sim.timings import SimTimings
from rl_async.sim.turns import SimTrajectory
from rl_async.base.types import Group, Sample

OUTCOMES = ("delivered", "dropped", "evicted", "aborted")


class SimEngine(SyntheticEngine):
    """The synthetic engine without token materialisation, plus time integrals of its load.

    A simulated response needs its length and the version of each token (age, staleness),
    not token values: ids and log-probs are constant lists, built at C speed."""

    def __init__(self, config: SyntheticEngineConfig):
        super().__init__(config)
        self.busy_seconds = 0.0       # time with at least one running request
        self.request_seconds = 0.0    # integral of running requests over time
        self._mark_t: float | None = None
        self._mark_running = 0

    def track(self) -> None:
        """Integrate the load since the last change up to now."""
        t = clock.now()
        if self._mark_t is not None:
            dt = t - self._mark_t
            self.request_seconds += self._mark_running * dt
            if self._mark_running:
                self.busy_seconds += dt
        self._mark_t, self._mark_running = t, len(self._running)

    def _admit(self) -> float:
        self.track()
        prefill = super()._admit()
        self._mark_running = len(self._running)
        return prefill

    def _leave(self, request) -> None:
        self.track()
        super()._leave(request)
        self._mark_running = len(self._running)

    def _emit(self, request, n: int) -> None:
        request.ids += [0] * n
        request.logprobs += [-1.0] * n
        request.versions += [self._version] * n


class LengthTally:
    """Samples per outcome and response-length bin (SPEC §7 bins), counted before a retry
    resets them."""

    def __init__(self) -> None:
        self.counts = {o: dict.fromkeys(LENGTH_BIN_LABELS, 0) for o in OUTCOMES}

    def add(self, outcome: str, group: Group) -> None:
        table = self.counts[outcome]
        for s in group.samples:
            table[length_bin(len(s.response_ids))] += 1

    def total(self, outcome: str) -> int:
        return sum(self.counts[outcome].values())


class Occupancy:
    """Time-weighted buffer occupancy (groups)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.t0: float | None = None
        self._t, self._n = 0.0, 0
        self.area = self.full_seconds = 0.0
        self.peak = 0
        self.samples: list[tuple[float, int]] = []  # (time, groups) at every change

    @property
    def span(self) -> float:
        """Seconds from the first mark to the last."""
        return self._t - self.t0 if self.t0 is not None else 0.0

    def mark(self, n: int) -> None:
        t = clock.now()
        if self.t0 is None:
            self.t0 = self._t = t
        dt = t - self._t
        self.area += self._n * dt
        if self._n >= self.capacity:
            self.full_seconds += dt
        self._t, self._n = t, n
        self.peak = max(self.peak, n)
        self.samples.append((t, n))


class SimFleet:
    """A `Fleet` (rl_async.loop.controller) of the real core with simulated engines and trainer."""

    def __init__(self, cfg: RunConfig, plan: CapacityPlan, timings: SimTimings, seed: int = 0):
        self.cfg, self.plan, self.timings = cfg, plan, timings
        self.rng = random.Random(seed)
        self.engines = [SimEngine(SyntheticEngineConfig(
            max_running_requests=plan.max_running_requests, timing=timings.engine,
            lengths=timings.lengths, transfer=timings.transfer, time_scale=1.0,
            sampling_seed=seed * 1000 + i)) for i in range(plan.engines)]
        self.router = Router(self.engines)
        r = cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_response_len, temperature=r.temperature,
                                       top_p=r.top_p, top_k=r.top_k)
        prompt = [1] * timings.prompt_tokens
        n = plan.group_size
        self.book = PromptLedger(
            lambda c: Group(f"p{c}", [Sample(f"p{c}", prompt_ids=prompt) for _ in range(n)]),
            max_retries=cfg.async_.max_retries, handler=cfg.async_.unused_samples_handler)
        self.tally = LengthTally()
        self.ages = dict.fromkeys(AGE_BIN_LABELS, 0)  # delivered groups by age (staleness)
        self.occupancy = Occupancy(plan.completed_buffer_groups)
        self.buffer = CompletedBuffer(
            plan.completed_buffer_groups, cfg.max_weight_staleness, **buffer_options(cfg, plan),
            on_discard=self._on_discard, on_insert=self.book.mark_buffered,
            on_deliver=self._on_deliver)
        trajectory = None if timings.turns is None else SimTrajectory(
            timings.turns, self.rng, r.max_response_len, r.max_trajectory_tokens)
        self.producer = Producer(
            ProducerLimits(plan.submission_granularity, plan.producer_samples, n,
                           plan.http_slots),
            next_group=self._next_group, generate=self._generate, score=self._score,
            put=self._put, on_aborted=self._on_aborted, on_failed=self._on_failed,
            next_groups=self._next_groups, trajectory=trajectory,
            **admission_calls(self.buffer))
        self.trained_samples = 0
        self.eval_seconds = 0.0
        self.publications = 0

    # ---- ledger / buffer callbacks -----------------------------------------------------------
    def _on_discard(self, group: Group, reason: str) -> None:
        self.tally.add("dropped" if reason == "stale" else "evicted", group)
        self.book.record_buffer_discard(group, reason)

    def _on_deliver(self, groups: list[Group]) -> None:
        for g in groups:
            self.tally.add("delivered", g)
            self.ages[age_bin(g.age_at_delivery)] += 1
        self.book.mark_delivered_all(groups)

    async def _on_aborted(self, group: Group) -> None:
        self.tally.add("aborted", group)
        self.book.mark_aborted(group, "publication or shutdown")

    async def _on_failed(self, group: Group, error: str) -> None:
        self.book.mark_failed(group, error)

    async def _next_group(self) -> Group | None:
        return (await self._next_groups(1))[0]

    async def _next_groups(self, n: int) -> list[Group]:
        """As a real run: one call to the prompt source for `n` groups, whose round trip
        (calibrated) holds up admission."""
        if self.timings.fetch_latency_s:
            await asyncio.sleep(self.timings.fetch_latency_s)
        return [self.book.next_group() for _ in range(n)]

    async def _generate(self, sample: Sample, group_id: str,
                        max_new_tokens: int | None = None) -> GenerateOutput:
        return await self._call_engine(sample.prompt_ids, group_id, max_new_tokens)

    async def _call_engine(self, prompt: list[int], key: str,
                           max_new_tokens: int | None = None) -> GenerateOutput:
        """One generate call; a calibrated round trip outside the engine (actor calls, the
        producer's loop) is paid half on the way there, half on the way back. A turn of a
        trajectory (`max_new_tokens` given) stays on the trajectory's engine."""
        half = self.timings.request_transit_s / 2
        if half:
            await asyncio.sleep(half)
        params = self.sampling if max_new_tokens is None else dataclasses.replace(
            self.sampling, max_new_tokens=max_new_tokens)
        _index, out = await self.router.generate(prompt, params, key,
                                                 sticky=max_new_tokens is not None)
        if half:
            await asyncio.sleep(half)
        return out

    async def _score(self, sample: Sample) -> float:
        if self.timings.score_latency_s:  # a real run's reward call, which holds the permit
            await asyncio.sleep(self.timings.score_latency_s)
        return float(self.rng.random() < 0.5)

    async def _put(self, group: Group):
        room = await self.buffer.put(group)
        self.occupancy.mark(len(self.buffer))
        return room

    # ---- Fleet: producer ----------------------------------------------------------------------
    async def producer_task(self) -> asyncio.Future:
        self.occupancy.mark(len(self.buffer))
        return asyncio.ensure_future(self.producer.run())

    async def producer_set_target(self, groups: float) -> None:
        self.producer.set_target(groups)

    async def producer_pause_admission(self) -> None:
        self.producer.pause_admission()

    async def producer_resume_admission(self) -> None:
        self.producer.resume_admission()

    async def producer_wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.producer.wait_idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def producer_stop(self) -> None:
        self.producer.stop()

    async def producer_set_budget(self, groups: int) -> None:
        self.producer.set_budget(groups)

    async def producer_groups_owned(self) -> int:
        return self.producer.groups_owned

    # ---- Fleet: buffer, trainer, eval -----------------------------------------------------------
    async def get_groups(self, n: int, version: int) -> list[Group]:
        groups = await self.buffer.get(n, version)
        self.occupancy.mark(len(self.buffer))
        if self.timings.collection_transport_s:  # a real run's actor round trip (calibrated)
            await asyncio.sleep(self.timings.collection_transport_s)
        return groups

    async def buffer_set_version(self, version: int | None,
                                 engine_version: int | None = None) -> None:
        await self._control()
        self.buffer.set_version(version, engine_version)
        await self._control()

    async def buffer_reserve(self, n_groups: int) -> None:
        if self.buffer.reserved:
            self.buffer.release_reserve()
        if n_groups:
            self.buffer.reserve(n_groups)

    async def train(self, groups: list[Group], version: int) -> dict[str, float]:
        samples = sum(g.size for g in groups)
        await asyncio.sleep(self.timings.trainer.collection_seconds(samples))
        self.trained_samples += samples
        return {}

    async def record_trained(self, step: int, version: int, groups: list[Group],
                             info: dict | None = None) -> None:
        # The controller's own per-collection time (a real run's actor round trips and
        # logging), measured by --calibrate; it sits here, between training and publishing.
        plan, t = self.plan, self.timings
        overhead = t.controller_seconds_per_step * plan.optimizer_steps_per_collection
        if overhead:
            await asyncio.sleep(overhead)

    async def evaluate(self) -> dict[str, float]:
        """The eval prompts go to the same engines as rollouts (one greedy response each,
        plus eval.n_samples sampled ones), competing with them, as in a real run."""
        start = clock.now()
        e = self.cfg.eval
        count = self.cfg.task.num_eval_prompts * (1 + e.n_samples)
        prompt = [1] * self.timings.prompt_tokens
        await asyncio.gather(*(self._call_engine(prompt, f"eval{i}") for i in range(count)))
        rest = self.timings.eval_seconds - (clock.now() - start)
        if rest > 0:  # the calibrated run's evaluation took longer than its generation
            await asyncio.sleep(rest)
        self.eval_seconds += clock.now() - start
        return {"reward": 0.0}

    async def checkpoint(self, step: int, version: int, progress: dict | None = None) -> str:
        return f"simulated/step_{step}"  # checkpoint time is not modelled

    async def metrics(self) -> dict[str, float]:
        if self.timings.metrics_gather_s:  # a real run's round trips to every actor
            await asyncio.sleep(self.timings.metrics_gather_s)
        return {}

    async def ledger(self) -> dict[str, int]:
        return self.book.counts()

    async def progress_marker(self) -> int:
        return self.producer.stats.inserted_groups

    async def diagnosis(self) -> dict:
        return self.state()

    def state(self) -> dict:
        """What each stage holds (for stall and deadlock errors)."""
        return {"producer": self.producer.load(), "buffer_groups": len(self.buffer),
                "engines": [{"running": e.load().running, "waiting": e.load().waiting}
                            for e in self.engines]}

    async def faults(self) -> dict:
        return {"engine_restarts": 0, "retried_requests": 0,
                "failed_groups": self.producer.stats.failed_groups}

    async def rollout(self) -> dict:
        return self.producer.stats.rollout_summary()

    # ---- PublicationOps -------------------------------------------------------------------------
    async def _control(self) -> None:
        """Half of a control call's measured round trip (0 unless calibrated)."""
        await asyncio.sleep(self.timings.control_call_s / 2)

    async def snapshot(self) -> None:
        await asyncio.sleep(self.timings.snapshot_s)  # 0 unless calibrated

    async def stop_submissions(self) -> None:
        await self._control()
        self.producer.pause_generation()
        await self._control()

    async def drain(self, timeout_s: float) -> bool:
        await self._control()
        drained = await self.producer.drain_generation(timeout_s)
        await self._control()
        return drained

    async def pause_engines(self, mode: str) -> None:
        await self._control()
        await asyncio.gather(*(e.pause_generation(mode) for e in self.engines))
        await self._control()

    async def send(self, version: int, progress=None) -> int:
        """Every bucket reaches every engine at once (one broadcast); the last one carries
        the version, as in a real publication."""
        sizes = bucket_sizes(self.timings.publish_bytes, self.cfg.publication.bucket_bytes)
        for i, nbytes in enumerate(sizes):
            last = i == len(sizes) - 1
            await asyncio.gather(*(e.update_weights_from_distributed(
                [f"bucket{i}"], ["uint8"], [[nbytes]], "sim", version if last else None)
                for e in self.engines))
            if progress is not None:
                progress(i + 1, len(sizes))
        self.publications += 1
        return sum(sizes)

    async def continue_engines(self) -> None:
        if self.timings.publication_overhead_s:
            await asyncio.sleep(self.timings.publication_overhead_s)
        await asyncio.gather(*(e.continue_generation() for e in self.engines))

    async def resume_submissions(self) -> None:
        self.producer.resume_generation()

    async def start(self) -> None:
        """Join the publication group: before the controller's loop, as in a real run, so
        its `group_init_s` is not part of the simulated wall time."""
        n = len(self.engines)
        await asyncio.gather(*(e.init_weights_update_group("sim", 0, 1 + i, n + 1, "sim", "nccl")
                               for i, e in enumerate(self.engines)))
