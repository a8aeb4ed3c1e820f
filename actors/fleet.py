"""RayFleet: the controller's `Fleet` over Ray actor handles, and the actor system's wiring.

Creates every role as a named actor (the dashboard's actor list reads as the architecture),
places engines and trainers with placement groups, joins the weight-publication collective
group, and publishes version 0 so every engine provably starts from the trainer's weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.buffer import BufferActor
from actors.engines import EngineActor
from actors.producer import ProducerActor
from actors.prompt_source import PromptSourceActor
from actors.rewards import RewardActor
from actors.trainer import PUBLICATION_GROUP, TrainerWorker
from rl_async.capacity import CapacityPlan
from rl_async.config import RunConfig
from rl_async.loop_monitor import LoopMonitor, aggregate
from rl_async.types import Group

PLACEMENT_TIMEOUT_S = 120


def _placement(bundles: list[dict], what: str, key: str):
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"the cluster cannot place the {what}: {len(bundles)} bundles of {bundles[0]} not "
            f"available after {PLACEMENT_TIMEOUT_S}s (cluster resources: "
            f"{ray.cluster_resources()}); lower {key} or add nodes")
    return pg


class RayFleet:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan):
        self.cfg, self.plan = cfg, plan
        self.prefix = cfg.run.name
        self.pgs: list = []
        self.actors: list = []
        self._producer_ref = None
        self.monitor = LoopMonitor()  # the controller actor's own event loop

    def _named(self, cls, name: str, *args, pg=None, bundle=0, **options):
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle)
        actor = cls.options(name=f"{self.prefix}/{name}", max_concurrency=options.pop(
            "max_concurrency", 1000), **options).remote(*args)
        self.actors.append(actor)
        return actor

    async def start(self) -> None:
        cfg, plan, c = self.cfg, self.plan, self.cfg.cluster
        self.monitor.ensure_started()
        gpu = c.inference_gpus > 0
        engine_bundle = {"CPU": c.engine_cpus, **({"GPU": c.gpus_per_engine} if gpu else {})}
        self.pgs.append(_placement([engine_bundle] * plan.engines, "engines",
                                   "cluster.inference_gpus / cluster.cpu_engines"))
        self.engines = [self._named(EngineActor, f"engine-{i}", cfg, i, pg=self.pgs[-1],
                                    bundle=i, num_cpus=c.engine_cpus,
                                    num_gpus=c.gpus_per_engine if gpu else 0)
                        for i in range(plan.engines)]
        tgpu = c.trainer_gpus > 0
        trainer_bundle = {"CPU": c.trainer_cpus, **({"GPU": 1} if tgpu else {})}
        self.pgs.append(_placement([trainer_bundle] * c.trainer_workers, "trainer workers",
                                   "cluster.trainer_workers / cluster.trainer_gpus"))
        trainer_cls = TrainerWorker
        if cfg.train.backend == "synthetic":  # dry runs: no torch, no GPUs
            from actors.synthetic import SyntheticTrainerWorker as trainer_cls
        self.trainers = [self._named(trainer_cls, f"trainer-{r}", cfg, plan, r,
                                     c.trainer_workers, pg=self.pgs[-1], bundle=r,
                                     num_cpus=c.trainer_cpus, num_gpus=1 if tgpu else 0,
                                     # two threads: a publication's broadcast can run
                                     # while the next collection trains (see controller)
                                     max_concurrency=2)
                         for r in range(c.trainer_workers)]
        # A sync actor: ledger transitions from one caller run in the order they were sent.
        self.source = self._named(PromptSourceActor, "prompt-source", cfg, num_cpus=0,
                                  max_concurrency=1)
        if cfg.judge.enabled:  # the reward actor grades through it, so it comes first
            await self._start_judge()
        self.reward = self._named(RewardActor, "reward", cfg, num_cpus=0)
        self.buffer = self._named(BufferActor, "completed-buffer", cfg, plan, self.source,
                                  num_cpus=0)
        self.producer = self._named(ProducerActor, "producer", cfg, plan, self.source,
                                    self.engines, self.reward, self.buffer, num_cpus=0)
        await asyncio.gather(*(e.start.remote() for e in self.engines))
        addr, port = await self.trainers[0].address.remote()
        await asyncio.gather(*(t.setup.remote(addr, port) for t in self.trainers))
        self.dp_ranks = await asyncio.gather(*(t.data_parallel_rank.remote() for t in self.trainers))
        await self._init_publication_group()
        self.eval_prompts = await self.source.get_eval_prompts.remote()
        await self.transfer(0)  # engines start from exactly the trainer's weights

    async def _init_publication_group(self) -> None:
        addr, port = await self.trainers[0].address.remote()
        # Every tensor-parallel rank of an engine joins: engine i holds group ranks
        # 1 + i*tp ... (i+1)*tp; the trainer's rank 0 is the source.
        tp = self.cfg.cluster.gpus_per_engine if self.cfg.cluster.inference_gpus else 1
        world = 1 + len(self.engines) * tp
        backend = "nccl" if self.cfg.cluster.trainer_gpus else "gloo"
        await asyncio.gather(
            self.trainers[0].init_publication_group.remote(addr, port, world, backend),
            *(e.init_weights_update_group.remote(addr, port, 1 + i * tp, world,
                                                 PUBLICATION_GROUP, backend)
              for i, e in enumerate(self.engines)))

    async def _start_judge(self) -> None:
        from actors.judges import deploy_judge  # imports Ray Serve only when judging
        from rl_async.judging import judge_deployment

        dep = judge_deployment(self.cfg.judge, self.cfg.run.name)
        self.judge_app = dep.app_name
        # serve.run blocks until min_replicas are up; keep the driver's loop free meanwhile.
        await asyncio.to_thread(deploy_judge, dep)

    async def shutdown(self) -> None:
        if getattr(self, "engines", None):
            await asyncio.gather(*(e.shutdown.remote() for e in self.engines),
                                 return_exceptions=True)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for pg in self.pgs:
            remove_placement_group(pg)
        if getattr(self, "judge_app", None):
            from actors.judges import delete_judge

            await asyncio.to_thread(delete_judge, self.judge_app)

    # ---- producer ----------------------------------------------------------------------------
    async def producer_task(self) -> asyncio.Future:
        self._producer_ref = self.producer.run.remote()
        return asyncio.ensure_future(self._producer_ref)

    async def producer_set_target(self, groups: float) -> None:
        await self.producer.set_target.remote(groups)

    async def producer_pause_admission(self) -> None:
        await self.producer.pause_admission.remote()

    async def producer_resume_admission(self) -> None:
        await self.producer.resume_admission.remote()

    async def producer_wait_idle(self, timeout_s: float) -> bool:
        return await self.producer.wait_idle.remote(timeout_s)

    async def producer_stop(self) -> None:
        await self.producer.stop.remote()

    # ---- buffer and training -----------------------------------------------------------------
    async def get_groups(self, n: int, version: int) -> list[Group]:
        return await self.buffer.get.remote(n, version)

    async def buffer_set_version(self, version: int) -> None:
        await self.buffer.set_version.remote(version)

    async def buffer_reserve(self, n_groups: int) -> None:
        await self.buffer.reserve.remote(n_groups)

    async def producer_groups_owned(self) -> int:
        return await self.producer.groups_owned.remote()

    async def train(self, groups: list[Group], version: int) -> dict[str, float]:
        # One shard per data-parallel rank; tensor/pipeline ranks of a replica share it.
        results = await asyncio.gather(*(t.train.remote(groups[dp::size], version)
                                         for t, (dp, size) in zip(self.trainers, self.dp_ranks)))
        return results[0]

    async def evaluate(self) -> float:
        return await self.producer.evaluate.remote(self.eval_prompts)

    async def checkpoint(self, step: int, version: int) -> None:
        directory = Path(self.cfg.run.output_dir) / self.cfg.run.name / f"step_{step:06d}"
        ledger = await self.source.state_dict.remote()
        await asyncio.gather(*(t.save_checkpoint.remote(str(directory),
                                                        {"ledger": ledger, "version": version})
                               for t in self.trainers))

    async def metrics(self) -> dict[str, float]:
        parts = await asyncio.gather(self.buffer.metrics.remote(), self.producer.metrics.remote(),
                                     self.reward.metrics.remote(), self.source.counts.remote(),
                                     self.source.busy.remote(),
                                     *(e.metrics.remote() for e in self.engines))
        out = {**parts[0], **parts[1], **parts[2], **parts[4]}
        out.update({f"ledger/{k}": float(v) for k, v in parts[3].items()})
        out.update(aggregate(list(parts[5:]), "engines"))  # mean and max over engines
        out.update(self.monitor.metrics("controller"))
        return out

    async def ledger(self) -> dict[str, int]:
        return await self.source.counts.remote()

    # ---- publication (PublicationOps) --------------------------------------------------------
    async def stop_submissions(self) -> None:
        await self.producer.pause_generation.remote()

    async def drain(self, timeout_s: float) -> bool:
        return await self.producer.drain_generation.remote(timeout_s)

    async def pause_engines(self, mode: str) -> None:
        await asyncio.gather(*(e.pause_generation.remote(mode) for e in self.engines))

    async def continue_engines(self) -> None:
        await asyncio.gather(*(e.continue_generation.remote() for e in self.engines))

    async def resume_submissions(self) -> None:
        await self.producer.resume_generation.remote()

    async def snapshot(self) -> None:
        """Trainer rank 0 copies the weights into its publication buckets."""
        flat = self.cfg.engine.backend == "embedded"
        bucket_bytes = self.cfg.publication.bucket_bytes
        ranks = self.trainers if self.cfg.train.backend == "megatron" else self.trainers[:1]
        self._metas = (await asyncio.gather(*(t.prepare_publication.remote(bucket_bytes, flat)
                                              for t in ranks)))[0]

    async def send(self, version: int) -> int:
        """Broadcast the snapshot bucket by bucket; the last bucket carries the version."""
        publisher = self.trainers[0]
        sent = 0
        for i, (names, dtypes, shapes, nbytes) in enumerate(self._metas):
            last = i == len(self._metas) - 1
            await asyncio.gather(
                publisher.broadcast_bucket.remote(i),
                *(e.update_weights_from_distributed.remote(
                    names, dtypes, shapes, PUBLICATION_GROUP, version if last else None)
                  for e in self.engines))
            sent += nbytes
        if self.cfg.publication.verify_checksum:
            await self.verify_weights()
        return sent

    async def transfer(self, version: int) -> int:
        """snapshot + send (start-up, and tests that publish by hand)."""
        await self.snapshot()
        return await self.send(version)

    async def verify_weights(self) -> None:
        want = await self.trainers[0].weights_checksum.remote()
        got = await asyncio.gather(*(e.weights_checksum.remote() for e in self.engines))
        bad = [i for i, g in enumerate(got) if g != want]
        if bad:
            raise RuntimeError(f"engines {bad} do not hold the trainer's weights after "
                               f"publication (checksum mismatch)")
