"""Engine actor: one generation engine (embedded torch engine or one SGLang server).

Methods mirror the engine interface (SPEC §10) one to one, so the producer and the
controller drive either backend the same way.
"""

from __future__ import annotations

import os
import signal
import time

import ray

from rl_async.plan.config import RunConfig
from rl_async.plan.moe import replay_for
from rl_async.algo.tasks import engine_prompt_limit
from rl_async.base.allocator import apply_for, rss_bytes
from rl_async.engine.base import Engine, GenerateOutput, SamplingParams
from rl_async.loop.monitor import LoopMonitor


def build_engine(cfg: RunConfig, index: int, start_version: int = 0) -> Engine:
    if cfg.engine.backend == "synthetic":
        from rl_async.engine.synthetic import synthetic_engine

        return synthetic_engine(cfg, index)
    if cfg.engine.backend == "embedded":
        from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

        on_gpu = cfg.cluster.inference_gpus > 0
        return EmbeddedEngine(EmbeddedEngineConfig(
            hf_config=cfg.model.hf_config, path=cfg.model.path, init_seed=cfg.model.init_seed,
            device="cuda" if on_gpu else "cpu", dtype=cfg.model.dtype,
            max_running_requests=cfg.sglang.max_running_requests,
            max_total_tokens=cfg.engine.max_total_tokens,
            prefix_cache_tokens=cfg.engine.prefix_cache_tokens,
            onednn_linear=cfg.engine.onednn_linear,
            max_prompt_len=engine_prompt_limit(cfg),
            torch_threads=None if on_gpu else cfg.engine.torch_threads,
            # only for requests that carry no seed of their own (rollouts and evaluations
            # always do: rl_async/algo/seeding.py); a resumed run does not replay the start's
            # stream for them
            sampling_seed=cfg.run.seed * 1000 + index + 1_000_003 * start_version,
            batch_invariant=cfg.run.deterministic,
            request_timeout_s=cfg.sglang.request_timeout_s,
            record_routing=replay_for(cfg, cfg.train.routing_replay)))
    from rl_async.engine.sglang_engine import SGLangEngine, SGLangEngineConfig
    from rl_async.engine.sglang_routing import routing_layout
    from rl_async.plan.memory import architecture

    s = cfg.sglang
    server_args = {"dtype": cfg.model.dtype}
    if cfg.run.deterministic:
        # SGLang's batch-invariant kernels (its per-request sampling_seed then gives
        # bit-exact tokens across runs), at a throughput cost.
        server_args["enable_deterministic_inference"] = True
    if cfg.refresh.mode == "mixed_policy":
        # Retracted requests are re-prefilled under the new weights; a radix cache would
        # hand them prefixes cached under the old ones (miles #2783, NeMo-RL #3152), and
        # flushing it needs an idle engine, which a retract pause is not (sglang #33784).
        server_args["disable_radix_cache"] = True
    if cfg.cluster.inference_gpus == 0:
        server_args["device"] = "cpu"
    return SGLangEngine(SGLangEngineConfig(
        model_path=cfg.model.path, gpus_per_engine=cfg.cluster.gpus_per_engine,
        # engine i listens on sglang.port_base + i (unique per node whatever the placement)
        host=ray.util.get_node_ip_address(), port=s.port_base + index if s.port_base else 0,
        mem_fraction_static=s.mem_fraction_static, max_running_requests=s.max_running_requests,
        speculative_algorithm=s.speculative_algorithm,
        disaggregation_mode=s.disaggregation_mode, ignore_eos=s.ignore_eos,
        # MoE routing replay: config.json is read here, on the engine's node, where SGLang
        # reads it too
        routed_experts=routing_layout(cfg.train.routing_replay, *architecture(cfg)),
        launch_module=s.launch_module, python_executable=s.python,
        server_args={**server_args, **s.extra_args},
        startup_timeout_s=s.startup_timeout_s, generate_timeout_s=s.request_timeout_s))


@ray.remote
class EngineActor:
    def __init__(self, cfg: RunConfig, index: int, start_version: int = 0):
        self.index = index
        # before the model is built: its tensors then come from reused memory too
        self.allocator = apply_for(cfg, "engine")
        self.engine = build_engine(cfg, index, start_version)
        self.monitor = LoopMonitor()
        self._die_in_transfer = False
        self._die_before_commit = False

    async def start(self) -> dict:
        """Launch/attach (SGLang) and report where this engine runs."""
        self.monitor.ensure_started()
        if hasattr(self.engine, "start"):
            await self.engine.start()
        return {"index": self.index, "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        return await self.engine.generate(input_ids, sampling_params, request_id)

    @ray.method(num_returns="streaming")
    async def generate_batch(self, requests: list):
        """Many requests in one call, streamed back as they finish (lists of (index,
        GenerateOutput | EngineError)): one actor call per batch, not per sample."""
        async for finished in self.engine.generate_batch(requests):
            yield finished

    async def abort(self, request_id: str | None = None) -> int:
        return await self.engine.abort(request_id)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.engine.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.engine.continue_generation()

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None) -> None:
        await self.engine.init_weights_update_group(master_address, master_port, rank_offset,
                                                    world_size, group_name, backend, timeout_s)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.engine.destroy_weights_update_group(group_name)

    async def weight_update_groups(self) -> list[str]:
        """The publication channels this engine has joined (tests: none leak)."""
        return self.engine.weight_update_groups()

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str,
                                              weight_version: int | None = None,
                                              flush_cache: bool | None = None) -> None:
        """One bucket over channel `group_name`. `flush_cache` on the last bucket: False
        when requests were retracted (mixed_policy): SGLang asserts an idle engine."""
        if self._die_in_transfer:  # chaos tests: the sender is already broadcasting
            os.kill(os.getpid(), signal.SIGKILL)
        await self.engine.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                          weight_version,
                                                          flush_cache=flush_cache)

    def stages_weights(self) -> bool:
        return self.engine.stages_weights

    async def stage_weights(self, buckets, group_name: str, version: int, fingerprints,
                            digest: str, forward: str | None = None, chunk_bytes: int = 0,
                            relayed: bool = False) -> dict:
        """A publication into the staging buffers while generating (prepare, transfer,
        verify), forwarded on relay link `forward`; commit_weights switches to it."""
        if self._die_in_transfer:
            os.kill(os.getpid(), signal.SIGKILL)
        return await self.engine.stage_weights(buckets, group_name, version, fingerprints,
                                               digest, forward, chunk_bytes, relayed)

    def open_relay(self, name: str, timeout_s: float) -> tuple[str, int]:
        """Host relay link `name` to the next engine; (address, port) it joins at."""
        return ray.util.get_node_ip_address(), self.engine.open_relay(name, timeout_s)

    async def join_relay(self, name: str) -> None:
        await self.engine.join_relay(name)

    async def commit_weights(self, version: int) -> dict:
        if self._die_before_commit:  # chaos tests: verified, not yet switched
            os.kill(os.getpid(), signal.SIGKILL)
        return await self.engine.commit_weights(version)

    def committed(self) -> dict:
        """The committed version and its model digest (what this engine serves)."""
        return {"version": self.engine._version,
                "digest": getattr(self.engine, "committed_digest", None)}

    async def update_weights_from_tensor(self, named_tensors, weight_version=None) -> None:
        await self.engine.update_weights_from_tensor(named_tensors, weight_version)

    async def get_weight_version(self) -> int:
        return await self.engine.get_weight_version()

    async def weights_checksum(self) -> str:
        return await self.engine.weights_checksum()

    async def named_weights(self) -> list:
        """The engine's current weights (tests compare them with the trainer's)."""
        return [(n, p.detach().cpu().clone()) for n, p in self.engine.model.named_parameters()]

    def load(self) -> dict:
        return vars(self.engine.load())

    async def health(self) -> dict:
        """The supervisor's probe: answers at all (the actor is alive and its loop free),
        and how long running requests have waited for progress."""
        if hasattr(self.engine, "health"):  # SGLang: the server process answers too
            await self.engine.health()
        stalled = getattr(self.engine, "seconds_without_progress", lambda: 0.0)()
        return {"index": self.index, "pid": os.getpid(), "seconds_without_progress": stalled,
                "server_pid": getattr(self.engine, "server_pid", None)}

    def debug_die_in_transfer(self) -> None:
        """Chaos tests: SIGKILL this engine's process at the start of its next weight receive,
        while trainer rank 0 (and every other engine) is inside that broadcast."""
        self._die_in_transfer = True

    def debug_fault(self, kind: str, bucket: int | None = None) -> None:
        """Chaos tests, for the next staged publication: `die_at_bucket` SIGKILLs this
        engine just before it receives bucket `bucket` (0-based), `stall_at_bucket` blocks
        it there (a wedged engine: its bucket misses the deadline), `corrupt_bucket` flips a
        byte of that bucket after it arrived, `die_before_commit` SIGKILLs it once its
        weights are verified and before they are switched in. `keep_prompt_cache`: from now
        on the prompt cache survives weight loads (stale KV, for the audit's tests)."""
        faults = self.engine.debug_faults.setdefault("next_publication", {})
        if kind == "die_at_bucket":
            faults["before_bucket"] = (lambda i: os.kill(os.getpid(), signal.SIGKILL)
                                       if i == bucket else None)
        elif kind == "corrupt_bucket":
            faults["corrupt_bucket"] = bucket
        elif kind == "die_before_commit":
            self._die_before_commit = True
        elif kind == "stall_at_bucket":  # the actor stops answering before that bucket
            faults["before_bucket"] = (lambda i: time.sleep(3600) if i == bucket else None)
        elif kind == "keep_prompt_cache":  # the provenance audit's negative control
            self.engine.debug_faults["keep_prompt_cache"] = True  # from now on
        else:
            raise ValueError(f"debug_fault kind = {kind!r}: die_at_bucket, corrupt_bucket, "
                             f"die_before_commit, stall_at_bucket or keep_prompt_cache")

    def debug_routing_noise(self, scale: float) -> None:
        """Benchmarks: this engine's MoE routers pick their top-k from probabilities plus
        Gaussian noise of `scale` (the gate weights stay the true probabilities there), as
        an engine whose kernels round differently from the trainer's flips near ties
        (benchmarks/routing_replay.py). Installs the routing hook where the run does not
        record (train.routing_replay = "off"), without recording."""
        from rl_async.state.moe_routing import ATTRIBUTE, Routing

        routing = getattr(self.engine.model, ATTRIBUTE, None)
        if routing is None:
            routing = Routing(self.engine.model)
            routing.recording = False
        routing.perturb = scale

    def debug_block(self, seconds: float) -> None:
        """Chaos tests: make this engine unresponsive (its actor loop blocked) without dying,
        as a wedged server or a driver stuck in a kernel looks from outside."""
        time.sleep(seconds)

    def set_threads(self, threads: int) -> None:
        """torch threads of an embedded engine on CPU (the controller's thread balancer)."""
        self.engine.set_threads(threads)

    def metrics(self) -> dict[str, float]:
        """This actor's event-loop lag and busy fraction (the fleet aggregates engines)."""
        load = self.engine.load()
        prefix = f"engine/{self.index}"
        measured = {}  # the simulator's calibration; SGLang does not measure these here
        for name in ("step_curve", "latency"):
            if getattr(self.engine, name, None) is not None:
                measured.update(getattr(self.engine, name).metrics(prefix))
        return {**self.monitor.metrics(prefix), **measured,
                # every thread of this process (the forward's too): rl_async/loop/threads.py
                f"{prefix}/cpu_seconds": time.process_time(),
                f"{prefix}/memory_reused": float(self.allocator == "on"),
                f"{prefix}/rss_bytes": rss_bytes(),
                **({f"{prefix}/threads": float(self.engine.stats["threads"])}
                   if "threads" in getattr(self.engine, "stats", {}) else {}),
                f"{prefix}/running": float(load.running),
                f"{prefix}/waiting": float(load.waiting),
                f"{prefix}/tokens_in_use": float(load.tokens_in_use)}

    async def shutdown(self) -> None:
        for name in ("shutdown", "close"):
            if hasattr(self.engine, name):
                await getattr(self.engine, name)()
                return
