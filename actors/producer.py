"""Producer actor: the producer pool (rl_async.producer.Producer) plus the engine router.

One asyncio actor drives every in-flight request: the limits of SPEC §4 are asyncio
semaphores here, so "global" means global. A dead engine, reward, source or buffer actor
is fatal for `run()` (with the actor named); a bad request or reward fails only its group.
"""

from __future__ import annotations

import asyncio

import ray
from ray.exceptions import RayActorError

from actors.prompt_source import ref_of
from rl_async.batching import MicroBatcher
from rl_async.capacity import CapacityPlan
from rl_async.config import RunConfig
from rl_async.engine.base import EngineError, GenerateOutput, SamplingParams
from rl_async.engine.router import Router
from rl_async.loop_monitor import LoopMonitor
from rl_async.producer import Producer, ProducerLimits
from rl_async.rewards import RewardError
from rl_async.tasks import stop_token_ids
from rl_async.types import Sample


class ActorDied(RuntimeError):
    pass


def sampling_params(cfg: RunConfig, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    stop = stop_token_ids(cfg)
    return SamplingParams(max_new_tokens=r.max_response_len,
                          temperature=0.0 if greedy else r.temperature,
                          top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                          stop_token_ids=stop)


@ray.remote(num_cpus=0)
class ProducerActor:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, source, engines: list, reward, buffer):
        self.cfg, self.source, self.engines, self.reward, self.buffer = (
            cfg, source, engines, reward, buffer)
        self.router = Router(engines)
        self.monitor = LoopMonitor()
        self.ray_calls = 0  # actor calls this actor made (orchestration cost per sample)
        # One batched, streamed call per engine per event-loop tick, one reward call per tick.
        self.gen_batchers = [MicroBatcher(self._engine_stream(i)) for i in range(len(engines))]
        self.score_batcher = MicroBatcher(self._score_batch)
        self.sampling = sampling_params(cfg)
        self.core = Producer(
            ProducerLimits(plan.submission_granularity, plan.producer_samples, plan.group_size,
                           plan.http_slots),
            next_group=self._call(source, "prompt source", "next_group"),
            generate=self._generate, score=self.score_batcher.submit,
            put=self._call(buffer, "completed buffer", "put"),
            on_aborted=lambda g: self._call(source, "prompt source", "mark_aborted")(
                ref_of(g), "aborted by publication or shutdown"),
            on_failed=lambda g, err: self._call(source, "prompt source", "mark_failed")(
                ref_of(g), err),
            group_errors=(EngineError, RewardError),
            next_groups=self._call(source, "prompt source", "next_groups"))

    def _call(self, handle, role: str, method: str):
        async def call(*args):
            self.ray_calls += 1
            try:
                return await getattr(handle, method).remote(*args)
            except RayActorError as exc:
                raise ActorDied(f"the {role} actor died during {method}: {exc}") from None
        return call

    async def _generate(self, sample: Sample, group_id: str, params=None) -> GenerateOutput:
        params = params or self.sampling
        cost = len(sample.prompt_ids) + params.max_new_tokens
        index = self.router.pick(group_id, cost)
        try:
            return await self.gen_batchers[index].submit((sample.prompt_ids, params))
        finally:
            self.router.release(index, cost, group_id)

    def _engine_stream(self, index: int):
        async def send(requests: list):
            self.ray_calls += 1
            stream = self.engines[index].generate_batch.remote(requests)
            try:
                async for ref in stream:
                    yield await ref
            except RayActorError as exc:
                raise ActorDied(f"engine actor {self.cfg.run.name}/engine-{index} died: "
                                f"{exc}") from None
        return send

    async def _score_batch(self, samples: list):
        self.ray_calls += 1
        try:
            scores = await self.reward.score_batch.remote(samples)
        except RayActorError as exc:
            raise ActorDied(f"the reward actor died during score_batch: {exc}") from None
        yield list(enumerate(scores))

    async def run(self) -> None:
        self.monitor.ensure_started()
        await self.core.run()

    def set_target(self, groups: float) -> None:
        self.core.set_target(groups)

    def pause_admission(self) -> None:
        self.core.pause_admission()

    def resume_admission(self) -> None:
        self.core.resume_admission()

    def pause_generation(self) -> None:
        self.core.pause_generation()

    def resume_generation(self) -> None:
        self.core.resume_generation()

    async def drain_generation(self, timeout_s: float) -> bool:
        return await self.core.drain_generation(timeout_s)

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.core.wait_idle(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def stop(self) -> None:
        self.core.stop()

    def groups_owned(self) -> int:
        return self.core.groups_owned

    async def evaluate(self, prompts: list) -> float:
        """Greedy responses to held-out prompts, scored by the reward actor: mean reward."""
        greedy = sampling_params(self.cfg, greedy=True)

        async def one(i, p) -> float:
            sample = Sample(prompt_id=p.prompt_id, prompt_ids=list(p.prompt_ids),
                            metadata=dict(p.metadata))
            out = await self._generate(sample, f"eval{i}", greedy)
            sample.response_ids = list(out.output_ids)
            return await self.reward.score.remote(sample)

        scores = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return sum(scores) / max(1, len(scores))

    def metrics(self) -> dict[str, float]:
        s = self.core.stats
        out = {f"producer/{k}": float(v) for k, v in vars(s).items() if k != "extra"}
        out.update({f"producer/{k}": float(v) for k, v in self.core.load().items()})
        for load in self.router.loads():
            out[f"engine/{load['engine']}/outstanding_requests"] = load["outstanding_requests"]
        out.update(self.monitor.metrics("producer"))
        out["producer/ray_calls"] = float(self.ray_calls)
        out.update(self.score_batcher.metrics("producer/reward"))
        for b in self.gen_batchers:
            for k, v in b.metrics("producer/generate").items():
                out[k] = out.get(k, 0.0) + v
        return out
