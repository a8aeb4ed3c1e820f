"""The Ray-free core wired in one event loop: the real PromptLedger, CompletedBuffer, Producer,
Publisher and Controller, with a fake engine (short random delays, abortable) and a fake
trainer that records what it trained. A "crash" cancels everything and keeps only what a
checkpoint wrote; `resume` builds a new fleet from it, as `rl-async run --resume` does."""

from __future__ import annotations

import asyncio
import copy
import random
from dataclasses import dataclass, field

from rl_async.loop.buffer import CompletedBuffer, buffer_options
from rl_async.engine.base import GenerateOutput
from rl_async.loop.admission import admission_calls
from rl_async.loop.ledger import PromptLedger
from rl_async.observe.queue_metrics import with_prefix
from rl_async.loop.producer import Producer, ProducerLimits
from rl_async.base.types import Group, Sample


@dataclass
class Disk:
    """What survives a crash: complete checkpoints and the trained log (as in rl_async.state.checkpoints)."""
    checkpoints: list[dict] = field(default_factory=list)
    trained: list[tuple[int, list[str]]] = field(default_factory=list)  # (step, group ids)
    info: list[dict] = field(default_factory=list)  # each trained line's info

    def trim(self, step: int) -> None:
        kept = [i for i, t in enumerate(self.trained) if t[0] <= step]
        self.trained = [self.trained[i] for i in kept]
        self.info = [self.info[i] for i in kept]


class FakeEngine:
    def __init__(self, rng: random.Random, version: int):
        self.rng, self.version = rng, version
        self.aborting = False
        self.running: set[asyncio.Future] = set()

    async def generate(self, sample: Sample, group_id: str) -> GenerateOutput:
        version = self.version
        done = asyncio.get_running_loop().create_future()
        self.running.add(done)
        try:
            await asyncio.wait({done}, timeout=self.rng.uniform(0, 0.004))
        finally:
            self.running.discard(done)
        reason = "abort" if done.done() else "stop"
        return GenerateOutput("r", [1, 2], [-0.5, -0.5], [version, version], reason)

    def abort_all(self) -> None:
        for f in self.running:
            if not f.done():
                f.set_result(None)


class InProcessFleet:
    def __init__(self, cfg, plan, disk: Disk, seed: int, resume: dict | None = None):
        self.cfg, self.plan, self.disk = cfg, plan, disk
        self.rng = random.Random(seed)
        n = plan.group_size
        self.book = PromptLedger(
            lambda c: Group(f"c{c}", [Sample(f"p{c}", prompt_ids=[1, c % 7 + 2])
                                      for _ in range(n)]),
            cfg.async_.max_retries, cfg.async_.unused_samples_handler)  # as the prompt source
        version = 0
        if resume is not None:
            self.book.load_state_dict(copy.deepcopy(resume["ledger"]))
            version = resume["version"]
            disk.trim(resume["step"])
        self.engine = FakeEngine(self.rng, version)
        self.buffer = CompletedBuffer(plan.completed_buffer_groups, plan.max_weight_staleness,
                                      **self.book.buffer_callbacks(),
                                      **buffer_options(cfg, plan))
        self.buffer.set_version(version, version)  # the engines start on it

        async def aborted(g):
            self.book.mark_aborted(g, "publication or shutdown")

        async def failed(g, err):
            self.book.mark_failed(g, err)

        async def next_group():
            await asyncio.sleep(0)
            return self.book.next_group()

        async def score(sample):
            return float(self.rng.random() < 0.5)

        self.producer = Producer(
            ProducerLimits(plan.submission_granularity, plan.producer_samples, n,
                           plan.http_slots),
            next_group=next_group, generate=self.engine.generate, score=score,
            put=self.buffer.put, on_aborted=aborted, on_failed=failed,
            **admission_calls(self.buffer))

    # ---- Fleet -------------------------------------------------------------------------------
    async def producer_task(self):
        return asyncio.ensure_future(self.producer.run())

    async def producer_set_target(self, groups):
        self.producer.set_target(groups)

    async def producer_pause_admission(self):
        self.producer.pause_admission()

    async def producer_resume_admission(self):
        self.producer.resume_admission()

    async def producer_wait_idle(self, timeout_s):
        try:
            await asyncio.wait_for(self.producer.wait_idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def producer_stop(self):
        self.producer.stop()

    async def producer_set_budget(self, groups):
        self.producer.set_budget(groups)

    async def get_groups(self, n, version):
        return await self.buffer.get(n, version)

    async def buffer_set_version(self, version, engine_version=None):
        self.buffer.set_version(version, engine_version)

    async def buffer_reserve(self, n_groups):
        if self.buffer.reserved:
            self.buffer.release_reserve()
        if n_groups:
            self.buffer.reserve(n_groups)

    async def producer_groups_owned(self):
        return self.producer.groups_owned

    async def train(self, groups, version):
        await asyncio.sleep(self.rng.uniform(0, 0.004))
        return {}

    async def record_trained(self, step, version, groups, info=None):
        self.disk.trained.append((step, [g.group_id for g in groups]))
        self.disk.info.append(dict(info or {}))

    async def evaluate(self):
        await asyncio.sleep(self.rng.uniform(0, 0.002))
        return {"reward": 0.0}

    async def checkpoint(self, step, version, progress=None):
        state = self.book.state_dict()  # the ledger first, as RayFleet.checkpoint ...
        await asyncio.sleep(self.rng.uniform(0, 0.002))  # ... then the trainer writes ...
        self.disk.checkpoints.append({"step": step, "version": version, "ledger": state,
                                      "progress": progress})
        return f"step_{step}"

    async def metrics(self):
        return with_prefix(self.buffer.metrics())

    async def ledger(self):
        return self.book.counts()

    async def progress_marker(self):
        return self.producer.stats.inserted_groups

    async def diagnosis(self):
        return {"producer": self.producer.load(), "buffer_groups": len(self.buffer)}

    async def faults(self):
        return {"failed_groups": self.producer.stats.failed_groups}

    async def rollout(self):
        return self.producer.stats.rollout_summary()

    # ---- PublicationOps ----------------------------------------------------------------------
    async def snapshot(self):
        await asyncio.sleep(0)

    async def stop_submissions(self):
        self.producer.pause_generation()

    async def drain(self, timeout_s):
        return await self.producer.drain_generation(timeout_s)

    async def pause_engines(self, mode):
        self.engine.abort_all()

    async def send(self, version, progress=None):
        await asyncio.sleep(self.rng.uniform(0, 0.002))
        self.engine.version = version
        return 1

    async def continue_engines(self):
        pass

    async def resume_submissions(self):
        self.producer.resume_generation()
