"""RayFleet: the controller's `Fleet` over Ray actor handles, and the actor system's wiring.

Creates every role as a named actor (the dashboard's actor list reads as the architecture),
places engines and trainers with placement groups, joins the weight-publication collective
group, and publishes version 0 so every engine provably starts from the trainer's weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.buffer import BufferActor
from actors.engine_supervisor import EngineSupervisor
from actors.engines import EngineActor
from actors.fleet_publication import FleetPublication
from actors.producer import ProducerActor
from actors.prompt_source import PromptSourceActor
from actors.rewards import RewardActor
from actors.trainer import TrainerWorker
from rl_async.algo.scoring import reward_placement
from rl_async.state import checkpoints as ckpts
from rl_async.state import rollouts
from rl_async.state.collective import OWN_PROCESS_NCCL_ENV
from rl_async.train.determinism import CUBLAS_ENV
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.plan.placement import trainer_groups
from rl_async.loop.monitor import LoopMonitor, aggregate
from rl_async.loop.publish import Publisher
from rl_async.base.types import Group

PLACEMENT_TIMEOUT_S = 120
CONTROL_CALL_TIMEOUT_S = 120  # control calls answer in milliseconds; this is a dead man's switch
ENGINE_SHUTDOWN_TIMEOUT_S = 60


def _placement(bundles: list[dict], what: str, key: str, strategy: str = "PACK"):
    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        on_one = " on one node (STRICT_PACK)" if strategy == "STRICT_PACK" else ""
        raise RuntimeError(
            f"the cluster cannot place the {what}: {len(bundles)} bundles of {bundles[0]}"
            f"{on_one} not available after {PLACEMENT_TIMEOUT_S}s (cluster resources: "
            f"{ray.cluster_resources()}); lower {key} or add nodes")
    return pg


def nccl_env(gpu: bool, deterministic: bool = False) -> dict:
    """Actor options for processes that join publication channels over NCCL: the same
    NCCL settings on both ends (rl_async/state/collective.py says why; SGLang servers get
    them through their launch environment), and cuBLAS's workspace setting for
    run.deterministic (it must be there before cuBLAS initialises)."""
    if not gpu:
        return {}
    env = {**OWN_PROCESS_NCCL_ENV, **(CUBLAS_ENV if deterministic else {})}
    return {"runtime_env": {"env_vars": env}}


@dataclass(frozen=True)
class Resume:
    """Where a resumed run starts: a complete checkpoint (rl_async.state.checkpoints)."""
    path: str
    step: int
    version: int
    ledger: dict
    config: dict = field(default_factory=dict)  # the config the checkpoint was written with
    prompt_stream: str | None = None  # its training prompt list's digest (None: older)
    progress: dict = field(default_factory=dict)  # the summary's counters at the checkpoint


def metrics_rank(reporters: list[bool]) -> int:
    """The one trainer whose metrics the run logs; exactly one must claim it."""
    claimed = [i for i, r in enumerate(reporters) if r]
    if len(claimed) != 1:
        raise RuntimeError(f"trainer ranks {claimed} claim to report metrics; exactly one must "
                           f"(the last pipeline stage's data-parallel rank 0)")
    return claimed[0]


class RayFleet(FleetPublication):
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, run_dir: str | None = None,
                 resume: Resume | None = None):
        self.cfg, self.plan = cfg, plan
        self.run_dir = Path(run_dir) if run_dir else ckpts.new_run_dir(cfg.run.output_dir,
                                                                      cfg.run.name)
        self.resume = resume
        self.prefix = cfg.run.name
        self.pgs: list = []
        self.engine_pg = None
        self.actors: list = []
        self._producer_ref = None
        self.monitor = LoopMonitor()  # the controller actor's own event loop
        # Fault tolerance (actors/engine_supervisor.py): engines out of routing, replacements
        # waiting for weights, and each engine's publication channel.
        self.down: set[int] = set()
        self.pending_up: set[int] = set()
        self.members_lock = asyncio.Lock()
        self.fault_log: list[dict] = []
        self._init_publication(plan.engines)  # channels, snapshots, relay links, scaling
        self.incarnations: dict[int, int] = {}  # engine index -> replacements so far
        self.supervisor: EngineSupervisor | None = None
        self.engine_start_timeout_s = cfg.sglang.startup_timeout_s + 60
        # The policy version engines hold (a replacement samples from a fresh seed stream).
        self.version_hint = resume.version if resume else 0
        self.engine_threads = cfg.engine.torch_threads  # the thread balancer's (set_threads)

    async def bounded(self, ref, what: str, timeout_s: float = CONTROL_CALL_TIMEOUT_S):
        """A control call on another actor, with a deadline: a wedged actor surfaces as an
        error naming the call instead of an endless wait."""
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} did not answer within {timeout_s:g} s") from None

    def start_engine(self, i: int):
        """Engine i in its placement-group bundle (at start, and for a replacement)."""
        c, gpu = self.cfg.cluster, self.cfg.cluster.inference_gpus > 0
        cfg = self.cfg
        if self.engine_threads != cfg.engine.torch_threads:  # a replacement keeps the split
            cfg = cfg.model_copy(deep=True)
            cfg.engine.torch_threads = self.engine_threads
        pg, bundle = self._bundle_of(i)
        return self._named(EngineActor, f"engine-{i}", cfg, i, self.version_hint,
                           pg=pg, bundle=bundle, num_cpus=c.engine_cpus,
                           num_gpus=c.gpus_per_engine if gpu else 0, **nccl_env(gpu))

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
        self.place_trainers()  # first: engines must not take the trainer groups' node
        engine_bundle = {"CPU": c.engine_cpus, **({"GPU": c.gpus_per_engine} if gpu else {})}
        self.engine_pg = _placement([engine_bundle] * plan.engines, "engines",
                                    "cluster.inference_gpus / cluster.cpu_engines")
        self.pgs.append(self.engine_pg)
        self.engines = [self.start_engine(i) for i in range(plan.engines)]
        # A sync actor: ledger transitions from one caller run in the order they were sent.
        self.source = self._named(PromptSourceActor, "prompt-source", cfg, num_cpus=0,
                                  max_concurrency=1)
        self.prompt_stream = await self.source.stream_digest.remote()
        if self.resume is not None:  # before engines load: a changed stream cannot resume
            why = ckpts.stream_change(self.resume.config, cfg.to_dict(),
                                      self.resume.prompt_stream, self.prompt_stream)
            if why:
                raise ckpts.ResumeError(f"cannot resume {self.resume.path}: {why}")
        if cfg.judge.enabled:  # the reward actor grades through it, so it comes first
            await self._start_judge()
        # Built-in verifiers score inside the producer (rl_async.algo.scoring): no actor.
        self.reward = (self._named(RewardActor, "reward", cfg, num_cpus=0)
                       if reward_placement(cfg) == "actor" else None)
        self.buffer = self._named(BufferActor, "completed-buffer", cfg, plan, self.source,
                                  num_cpus=0)
        self.producer = self._named(ProducerActor, "producer", cfg, plan, self.source,
                                    self.engines, self.reward, self.buffer, num_cpus=0)
        await asyncio.gather(*(e.start.remote() for e in self.engines))
        await self.setup_trainers()
        version = 0
        if self.resume is not None:  # trainer state and ledger, before any generation
            r = self.resume
            await asyncio.gather(*(t.load_checkpoint.remote(r.path) for t in self.trainers))
            await self.source.load_state_dict.remote(r.ledger)
            ckpts.trim_trained_log(self.run_dir, r.step)
            for moved in ckpts.abandon_later_checkpoints(self.run_dir, r.step):
                print(f"[rl-async] resuming from step {r.step}: the later checkpoint of the "
                      f"abandoned lineage is kept as {moved}", flush=True)
            version = r.version
        self.eval_prompts = await self.source.get_eval_prompts.remote()
        # Engines start from exactly the trainer's (restored) weights; under the publication
        # deadline. The send forms each engine's publication channel first.
        await Publisher(cfg.refresh.mode, cfg.publication.drain_timeout_s,
                        cfg.publication.timeout_s).transfer(version, self)
        await self.buffer.set_version.remote(version, version)  # engines hold it now
        if cfg.fault_tolerance:
            self.supervisor = EngineSupervisor(self)
            self.supervisor.start()

    def place_trainers(self) -> None:
        """The trainer group's actors in their placement group (a run, and `rl-async replay`,
        which re-trains recorded collections on the same layout)."""
        cfg, c = self.cfg, self.cfg.cluster
        tgpu = c.trainer_gpus > 0
        trainer_bundle = {"CPU": c.trainer_cpus, **({"GPU": 1} if tgpu else {})}
        where = {}  # rank -> (placement group, bundle): one group per TP group (placement.py)
        for group in trainer_groups(cfg):
            pg = _placement([trainer_bundle] * len(group.ranks), "trainer workers",
                            "cluster.trainer_workers / cluster.trainer_gpus", group.strategy)
            self.pgs.append(pg)
            where.update({r: (pg, b) for b, r in enumerate(group.ranks)})
        trainer_cls = TrainerWorker
        if cfg.train.backend == "synthetic":  # dry runs: no torch, no GPUs
            from actors.synthetic import SyntheticTrainerWorker as trainer_cls
        self.trainers = [self._named(trainer_cls, f"trainer-{r}", cfg, self.plan, r,
                                     c.trainer_workers, pg=where[r][0], bundle=where[r][1],
                                     num_cpus=c.trainer_cpus, num_gpus=1 if tgpu else 0,
                                     # CPU: two threads, so a publication's broadcast can
                                     # run while the next collection trains. GPU: one, so
                                     # NCCL collectives of two communicators never run
                                     # concurrently on one device (publication_overlaps_training)
                                     max_concurrency=1 if tgpu else 2,
                                     **nccl_env(tgpu, cfg.run.deterministic))
                         for r in range(c.trainer_workers)]

    async def setup_trainers(self) -> None:
        """Form the trainers' process group; learn each rank's data-parallel shard."""
        addr, port = await self.trainers[0].address.remote()
        await asyncio.gather(*(t.setup.remote(addr, port) for t in self.trainers))
        self.dp_ranks = await asyncio.gather(*(t.data_parallel_rank.remote() for t in self.trainers))
        reporters = await asyncio.gather(*(t.reports_metrics.remote() for t in self.trainers))
        self.metrics_rank = metrics_rank(reporters)

    async def _start_judge(self) -> None:
        from actors.judges import deploy_judge  # imports Ray Serve only when judging
        from rl_async.algo.judging import judge_deployment

        dep = judge_deployment(self.cfg.judge, self.cfg.run.name)
        self.judge_app = dep.app_name
        # serve.run blocks until min_replicas are up; keep the driver's loop free meanwhile.
        await asyncio.to_thread(deploy_judge, dep)

    async def shutdown(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        if getattr(self, "engines", None):
            # Bounded: after a failed publication an engine may be stuck in a broadcast;
            # ray.kill below ends it either way (SGLang servers die with their process group).
            done, _ = await asyncio.wait([asyncio.ensure_future(e.shutdown.remote())
                                          for e in self.engines],
                                         timeout=ENGINE_SHUTDOWN_TIMEOUT_S)
            for future in done:  # a failed engine shutdown is moot: the actor is killed next
                future.exception()
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
        await self.bounded(self.producer.set_target.remote(groups), "producer.set_target")

    async def producer_pause_admission(self) -> None:
        await self.bounded(self.producer.pause_admission.remote(), "producer.pause_admission")

    async def producer_resume_admission(self) -> None:
        await self.bounded(self.producer.resume_admission.remote(), "producer.resume_admission")

    async def producer_wait_idle(self, timeout_s: float) -> bool:
        return await self.producer.wait_idle.remote(timeout_s)

    async def producer_stop(self) -> None:
        await self.bounded(self.producer.stop.remote(), "producer.stop")

    async def producer_set_budget(self, groups: int) -> None:
        await self.bounded(self.producer.set_budget.remote(groups), "producer.set_budget")

    # ---- buffer and training -----------------------------------------------------------------
    async def get_groups(self, n: int, version: int) -> list[Group]:
        ref = self.buffer.get.remote(n, version)
        try:
            return await ref
        except asyncio.CancelledError:  # the controller gave up waiting: so does the buffer
            ray.cancel(ref)  # (an async actor's task is cancelled where it waits, taking none)
            raise

    async def buffer_set_version(self, version: int | None, engine_version: int | None = None
                                 ) -> None:
        await self.bounded(self.buffer.set_version.remote(version, engine_version),
                           "completed-buffer.set_version")

    async def buffer_reserve(self, n_groups: int) -> None:
        await self.bounded(self.buffer.reserve.remote(n_groups), "completed-buffer.reserve")

    async def producer_groups_owned(self) -> int:
        return await self.bounded(self.producer.groups_owned.remote(), "producer.groups_owned")

    async def train(self, groups: list[Group], version: int) -> dict[str, float]:
        # One shard per data-parallel rank; tensor/pipeline ranks of a replica share it.
        results = await asyncio.gather(*(t.train.remote(groups[dp::size], version)
                                         for t, (dp, size) in zip(self.trainers, self.dp_ranks)))
        # With pipeline parallelism rank 0 is the FIRST stage, whose log-prob metrics are
        # zeros: take the last stage's (see TrainerWorker.reports_metrics). The audit runs
        # on rank 0, which holds the published snapshots.
        return {**results[self.metrics_rank],
                **{k: v for k, v in results[0].items() if k.startswith("provenance/")}}

    async def set_threads(self, engine: int, trainer: int) -> None:
        """torch threads per engine process and per trainer worker (rl_async/loop/threads.py);
        an engine that fails the call is lost like any engine call."""
        self.engine_threads = engine
        await self._on_live_engines(lambda e: e.set_threads.remote(engine), "set_threads")
        await self.set_trainer_threads(trainer)

    async def set_trainer_threads(self, threads: int) -> None:
        """torch threads per trainer worker from the next collection on (also replay's)."""
        await self.bounded(asyncio.gather(*(t.set_threads.remote(threads)
                                            for t in self.trainers)), "trainer.set_threads")

    async def evaluate(self) -> dict[str, float]:
        return await self.producer.evaluate.remote(self.eval_prompts)

    def _collective_ranks(self) -> list:
        """Ranks that take part in gathering the full weights (all of megatron's)."""
        return self.trainers if self.cfg.train.backend == "megatron" else self.trainers[:1]

    async def export(self, directory: str) -> str:
        """The policy as a Hugging Face directory at `directory` (loadable with
        AutoModelForCausalLM.from_pretrained)."""
        out = await asyncio.gather(*(t.export_hf.remote(directory)
                                     for t in self._collective_ranks()))
        return out[0]

    async def checkpoint(self, step: int, version: int, progress: dict | None = None) -> str:
        """A complete checkpoint or none (rl_async.state.checkpoints): trainer state from the
        ranks that hold it and the policy as `hf/`, staged, then meta.json with the ledger
        and the config, then one rename. The producer keeps generating meanwhile."""
        staged = ckpts.staging_dir(self.run_dir, step)
        # The ledger first: every group it lists as delivered is in the weights saved next
        # (the controller trains no further collection until this returns).
        ledger = await self.source.state_dict.remote()
        await asyncio.gather(*(t.save_checkpoint.remote(str(staged), {"version": version})
                               for t in self.trainers))
        await self.export(str(staged / "hf"))
        final = ckpts.finalize(self.run_dir, step, {
            "policy_version": version, "ledger": ledger, "config": self.cfg.to_dict(),
            "prompt_stream": self.prompt_stream, "progress": progress or {}},
            self.cfg.run.keep_checkpoints)
        return str(final)

    async def record_trained(self, step: int, version: int, groups: list[Group],
                             info: dict | None = None) -> None:
        ckpts.append_trained(self.run_dir, step, version, [
            (g.group_id, g.attempt, g.oldest_version()) for g in groups], info)
        if self.cfg.run.record_rollouts:  # for `rl-async replay` (rl_async/state/rollouts.py)
            await asyncio.to_thread(rollouts.write_collection, self.run_dir, step, version,
                                    groups)

    async def metrics(self) -> dict[str, float]:
        parts = await self.bounded(asyncio.gather(
            self.buffer.metrics.remote(), self.producer.metrics.remote(),
            self.source.counts.remote(), self.source.busy.remote(),
            *([self.reward.metrics.remote()] if self.reward else [])), "metrics")
        out = {**parts[0], **parts[1], **parts[3], **(parts[4] if self.reward else {})}
        out.update({f"ledger/{k}": float(v) for k, v in parts[2].items()})
        # Each engine's own view (loop lag, busy, running/waiting; SGLang's polled from
        # /v1/loads); an engine that fails to answer is the supervisor's business, not a
        # reason to stop logging.
        live = self.live_engines()
        per_engine = [m for m in await asyncio.gather(
            *(self.engines[i].metrics.remote() for i in live), return_exceptions=True)
            if isinstance(m, dict)]
        for m in per_engine:
            out.update(m)
        out.update(aggregate(per_engine, "engines"))  # mean and max over engines
        out.update(self.monitor.metrics("controller"))
        out["faults/engine_restarts"] = float(self.supervisor.restarts.restarts
                                              if self.supervisor else 0)
        out["faults/engines_down"] = float(len(self.down))
        return out

    async def ledger(self) -> dict[str, int]:
        return await self.bounded(self.source.counts.remote(), "prompt-source.counts")

    async def progress_marker(self) -> int:
        """Groups the producer has inserted into the buffer so far (stall detection)."""
        return await self.bounded(self.producer.inserted_groups.remote(),
                                  "producer.inserted_groups")

    async def faults(self) -> dict:
        """The summary's `faults`: restarts (with causes), retried requests, failed and
        aborted groups."""
        counts = await self.bounded(self.producer.fault_counts.remote(), "producer.fault_counts")
        restarts = self.supervisor.restarts if self.supervisor else None
        return {"engine_restarts": restarts.restarts if restarts else 0,
                "engine_failures": self.fault_log, **counts}

    async def rollout(self) -> dict:
        """The summary's `rollout`: turns, truncation and environment time (multi-turn)."""
        return await self.bounded(self.producer.rollout_summary.remote(),
                                  "producer.rollout_summary")

    async def diagnosis(self) -> dict:
        """What every stage holds right now, for a stall error (each part best effort)."""
        parts = {"producer": self.producer.metrics.remote(),
                 "buffer_groups": self.buffer.size.remote(),
                 **({"reward": self.reward.metrics.remote()} if self.reward else {}),
                 **{f"engine-{i}": self.engines[i].load.remote() for i in self.live_engines()}}
        out: dict = {"engines_down": sorted(self.down), "engines_waiting_for_weights":
                     sorted(self.pending_up)}
        for key, ref in parts.items():
            try:
                out[key] = await asyncio.wait_for(ref, 10)
            except Exception as exc:  # noqa: BLE001 -- a diagnosis reports, never raises
                out[key] = f"unavailable: {type(exc).__name__}: {exc}"
        return out

    # ---- publication (PublicationOps) --------------------------------------------------------