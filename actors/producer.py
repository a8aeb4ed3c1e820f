"""Producer actor: the producer pool (rl_async.loop.producer.Producer) plus the engine router.

One asyncio actor drives every in-flight request: the limits of SPEC §4 are asyncio
semaphores here, so "global" means global. A dead engine, reward, source or buffer actor
is fatal for `run()` (with the actor named); a bad request or reward fails only its group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import ray
from ray.exceptions import RayActorError

from actors.prompt_source import ref_of
from rl_async.base.batching import MicroBatcher
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.engine.base import EngineError, GenerateOutput, SamplingParams
from rl_async.engine.router import NoHealthyEngine, Router
from rl_async.algo.evaluation import eval_metrics
from rl_async.loop.faults import FailureBudget, RunStopped, TransientEngineError
from rl_async.loop.monitor import LoopMonitor
from rl_async.loop.producer import Producer, ProducerLimits, zero_variance
from rl_async.algo.rewards import RewardError, backoff_s
from rl_async.algo.scoring import SampleScorer
from rl_async.algo.environments import EnvironmentFailure
from rl_async.algo.seeding import eval_seed
from rl_async.loop.trajectory import turn_request
from rl_async.loop.environment_runner import build_environment_runner
from rl_async.algo.stop_ids import stop_token_ids
from rl_async.algo.tasks import ENV_TASKS, response_budget
from rl_async.base.types import Sample


# An evaluation request aborted by engine failures is asked again, up to this many times in
# all: enough to ride out restarts (each bounded by engine.max_restarts), finite so that an
# engine that aborts everything stops the evaluation with an error instead of spinning.
EVAL_ATTEMPTS = 20


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
        # reward None: the reward runs here (reward.placement, rl_async.algo.scoring).
        self.scorer = SampleScorer.from_config(cfg) if reward is None else None
        self.score_batcher = MicroBatcher(self._score_batch)
        self.put_batcher = MicroBatcher(self._put_batch)  # the groups finished in one tick
        self.sampling = sampling_params(cfg)
        self.trajectory = (build_environment_runner(cfg) if cfg.task.name in ENV_TASKS
                           else None)
        self.core = Producer(
            ProducerLimits(plan.submission_granularity, plan.producer_samples, plan.group_size,
                           plan.http_slots),
            next_group=self._call(source, "prompt source", "next_group"),
            generate=self._generate,
            score=self.score_batcher.submit if self.scorer is None else self.scorer.score,
            put=self.put_batcher.submit,
            on_aborted=lambda g, why="aborted by publication or shutdown": self._call(
                source, "prompt source", "mark_aborted")(ref_of(g), why),
            on_failed=lambda g, err: self._call(source, "prompt source", "mark_failed")(
                ref_of(g), err),
            group_errors=(EngineError, RewardError, EnvironmentFailure),
            next_groups=self._call(source, "prompt source", "next_groups"),
            engine_ready=self._engine_ready,
            failure_budget=FailureBudget(cfg.run.failure_window_groups,
                                         cfg.run.max_failed_group_fraction),
            seed=cfg.run.seed, trajectory=self.trajectory,
            **({"admit": self._call(buffer, "completed buffer", "admit"),
                "release": self._call(buffer, "completed buffer", "release")}
               if plan.staleness_bound == "admission" else {}),
            **({"filter_group": zero_variance,
                "on_filtered": lambda g, reason: self._call(source, "prompt source",
                                                            "mark_filtered")(ref_of(g), reason)}
               if cfg.filter.zero_variance else {}))
        self._window = {"inserted": 0, "filtered": 0}  # stats at the last metrics() call
        self._routable = asyncio.Event()
        self._routable.set()
        self._failed = asyncio.Event()
        self._fail_message: str | None = None
        self.faults = {"retried_requests": 0, "last_transient_error": ""}
        self._failing = [0] * len(engines)  # consecutive transient failures per engine
        self._aborts: set[asyncio.Future] = set()  # engine aborts of cancelled turns

    def _call(self, handle, role: str, method: str):
        async def call(*args):
            self.ray_calls += 1
            try:
                return await getattr(handle, method).remote(*args)
            except RayActorError as exc:
                raise ActorDied(f"the {role} actor died during {method}: {exc}") from None
        return call

    async def _engine_ready(self) -> None:
        """While every engine is down (restarts under way), wait for one (the core waits
        here before a sample counts as in flight)."""
        while not self.router.any_healthy:
            if self._failed.is_set():
                raise RunStopped(self._fail_message)
            self._routable.clear()
            await self._routable.wait()

    async def _generate(self, sample: Sample, group_id: str, max_new_tokens: int | None = None,
                        params=None) -> GenerateOutput:
        """One request. A transient failure (a dead engine under fault tolerance, a reset
        connection, an HTTP 5xx, a timeout) aborts the sample after a backoff, so its group
        is regenerated from the original prompt; a malformed request fails the group.
        `max_new_tokens` marks a turn of a multi-turn trajectory (`group_id` names the
        trajectory): its room in the trajectory's budget, and routed to the trajectory's
        engine."""
        params = params or self.sampling
        if sample.seed is not None:
            params = dataclasses.replace(params, seed=sample.seed)
        if max_new_tokens is not None:
            params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
        budget = response_budget(sample.metadata, params.max_new_tokens, sample.prompt_id)
        if budget != params.max_new_tokens:  # the row's own budget (task.count_tokens, JSONL)
            params = dataclasses.replace(params, max_new_tokens=budget)
        cost, sticky = len(sample.prompt_ids) + params.max_new_tokens, max_new_tokens is not None
        try:
            index = self.router.pick(group_id, cost, sticky)
        except NoHealthyEngine:  # went down since _engine_ready (or an eval request)
            await self._engine_ready()
            index = self.router.pick(group_id, cost, sticky)
        # A trajectory's turn is named, so that a straggler (its rollout returned, or its
        # client went away: the gateway cancels the call) frees its engine slot at once.
        rid = uuid.uuid4().hex if sticky else None
        request = (sample.prompt_ids, params) + ((rid,) if rid else ())
        try:
            out = await self.gen_batchers[index].submit(request)
            self._failing[index] = 0
            return out
        except asyncio.CancelledError:
            if rid is not None:
                self._abort_request(index, rid)
            raise
        except ActorDied:  # the engine's stream broke: the actor died
            if not self.cfg.fault_tolerance:
                raise
            self.router.set_healthy(index, False)  # out of routing now; the supervisor
            cause = f"engine-{index} died"          # restarts it
        except TransientEngineError as exc:
            cause = f"engine-{index}: {exc}"
        finally:
            self.router.release(index, cost, group_id)
        self.faults["retried_requests"] += 1
        self.faults["last_transient_error"] = cause
        # backs off while this engine keeps failing, from scratch once it answers again
        self._failing[index] += 1
        await asyncio.sleep(backoff_s(min(self._failing[index], 6)))
        return GenerateOutput(request_id="", output_ids=[], output_logprobs=[],
                              token_versions=[], finish_reason="abort")

    def _abort_request(self, index: int, request_id: str) -> None:
        """Abort one engine request whose caller was cancelled (fire and forget: an engine
        that died meanwhile is the supervisor's business, reported there)."""
        task = asyncio.ensure_future(self.engines[index].abort.remote(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved

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

    async def _put_batch(self, groups: list):
        self.ray_calls += 1
        try:
            async for ref in self.buffer.put_many.remote(groups):
                yield await ref
        except RayActorError as exc:
            raise ActorDied(f"the completed buffer actor died during put_many: {exc}") from None

    async def run(self) -> None:
        """The producer loop, until stopped; raises its fatal error, or one a fault policy
        reported with `fail` (an engine past its restarts)."""
        self.monitor.ensure_started()
        task = asyncio.ensure_future(self.core.run())
        failed = asyncio.ensure_future(self._failed.wait())
        await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
        if self._failed.is_set() and not task.done():
            task.cancel()
            raise RunStopped(self._fail_message)
        await task

    def fail(self, message: str) -> None:
        self._fail_message = self._fail_message or message
        self._failed.set()
        self._routable.set()  # wake requests waiting for an engine: they raise now

    def engine_down(self, index: int) -> None:
        self.router.set_healthy(index, False)

    def engine_up(self, index: int, handle) -> None:
        """A replacement holding the current policy version rejoins routing."""
        self.engines[index] = handle
        self.router.engines[index] = handle
        self.router.set_healthy(index, True)
        self._routable.set()

    # ---- fleet membership (`rl-async scale`: actors/fleet_scale.py) -----------------------
    def engine_add(self, index: int, handle) -> None:
        """A new engine, out of routing until it holds the current weights (engine_up)."""
        if index != len(self.engines):
            raise ValueError(f"engine_add({index}): the next engine index is "
                             f"{len(self.engines)}")
        self.engines.append(handle)
        self.router.add(handle)
        self.gen_batchers.append(MicroBatcher(self._engine_stream(index)))
        self._failing.append(0)

    async def engine_leave(self, index: int, timeout_s: float) -> bool:
        """Engine `index` leaves: no new request goes to it, those it has finish for up to
        `timeout_s`, then the rest are aborted (their groups go back to the ledger and are
        regenerated). Returns whether it drained in time."""
        self.router.set_healthy(index, False)
        deadline = time.monotonic() + timeout_s
        while self.router.outstanding(index) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        drained = not self.router.outstanding(index)
        if not drained:
            await self.engines[index].abort.remote(None)
        return drained

    def set_limits(self, producer_samples: int, http_slots: int) -> None:
        """The producer budget and generation gate for the fleet's new size."""
        self.core.resize(producer_samples, http_slots)

    def set_target(self, groups: float) -> None:
        self.core.set_target(groups)

    def set_budget(self, groups: int) -> None:
        self.core.set_budget(groups)

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

    def inserted_groups(self) -> int:
        return self.core.stats.inserted_groups

    def fault_counts(self) -> dict:
        """The summary's `faults`, with the mixed_policy counters beside them (requests
        whose prefix was rebuilt under new weights: SPEC §9 wants them shown, since a
        configured refresh mode does not prove a run crossed a publication)."""
        s = self.core.stats
        return {**self.faults, "failed_groups": s.failed_groups,
                "aborted_groups": s.aborted_groups, "refreshed_requests": s.refreshed_requests,
                "mixed_version_responses": s.mixed_version_responses}

    def rollout_summary(self) -> dict:
        return self.core.stats.rollout_summary()

    def groups_owned(self) -> int:
        return self.core.groups_owned

    async def evaluate(self, prompts: list) -> dict[str, float]:
        """Score held-out prompts with the reward actor: one response each (greedy unless
        eval.greedy = false) plus eval.n_samples sampled ones (rl_async.algo.evaluation)."""
        first = sampling_params(self.cfg, greedy=self.cfg.eval.greedy)
        k = self.cfg.eval.n_samples

        async def one(tag: str, p, params, seed: int | None) -> float:
            sample = Sample(prompt_id=p.prompt_id, prompt_ids=list(p.prompt_ids),
                            metadata=dict(p.metadata), seed=seed)
            if self.trajectory is not None:
                return await self._evaluate_trajectory(tag, sample, params)
            out = await self._eval_generate(sample, tag, None, params)
            sample.response_ids = list(out.output_ids)
            try:
                if self.scorer is not None:
                    return await self.scorer.score(sample)
                return await self._call(self.reward, "reward", "score")(sample)
            except RewardError as exc:  # as for environments: scored 0, counted; the run's
                # failure budget (rollouts), not an evaluation, decides whether it stops
                self.faults["eval_reward_failures"] = self.faults.get("eval_reward_failures", 0) + 1
                self.faults["last_transient_error"] = str(exc)
                return 0.0

        seed = self.cfg.run.seed

        async def k_samples(i: int, p) -> list[float]:
            return list(await asyncio.gather(*(one(f"eval{i}", p, self.sampling,
                                                   eval_seed(seed, i, 1 + j))
                                               for j in range(k))))

        firsts, *sampled = await asyncio.gather(
            asyncio.gather(*(one(f"eval{i}", p, first, eval_seed(seed, i, 0))
                             for i, p in enumerate(prompts))),
            *(k_samples(i, p) for i, p in enumerate(prompts) if k))
        return eval_metrics(list(firsts), sampled)

    async def _eval_generate(self, sample: Sample, key: str, max_new_tokens: int | None,
                             params) -> GenerateOutput:
        """An evaluation request under the rollouts' generation semaphore; a request an
        engine failure aborted is asked again, at most EVAL_ATTEMPTS times in all."""
        for _ in range(EVAL_ATTEMPTS):
            out = await self.core.gated(
                lambda: self._generate(sample, key, max_new_tokens, params))
            if out.finish_reason != "abort":
                return out
        raise EngineError(f"evaluation request {key!r} was aborted {EVAL_ATTEMPTS} times in a "
                          f"row (last: {self.faults['last_transient_error']})")

    async def _evaluate_trajectory(self, tag: str, sample: Sample, params) -> float:
        """An eval trajectory at the eval sampling settings, scored by the environment. An
        environment failure scores 0 and is counted (faults.eval_env_failures), so a flaky
        environment cannot stop the run from an evaluation."""
        key = f"{tag}/{sample.seed}"

        async def turn(ids: list[int], n: int, t: int) -> GenerateOutput:
            return await self._eval_generate(turn_request(sample, ids, t), key, n, params)

        try:
            await self.trajectory.run(sample, turn)
        except EnvironmentFailure as exc:
            self.faults["eval_env_failures"] = self.faults.get("eval_env_failures", 0) + 1
            self.faults["last_transient_error"] = str(exc)
            return 0.0
        return float(sample.reward)

    def metrics(self) -> dict[str, float]:
        s = self.core.stats
        out = {f"producer/{k}": float(v) for k, v in vars(s).items() if k != "extra"}
        out["faults/retried_requests"] = float(self.faults["retried_requests"])
        out["faults/failed_groups"] = float(s.failed_groups)
        # Dynamic sampling, windowed per report: filtered / (filtered + inserted).
        filtered = s.filtered_groups - self._window["filtered"]
        inserted = s.inserted_groups - self._window["inserted"]
        self._window = {"inserted": s.inserted_groups, "filtered": s.filtered_groups}
        out["rollout/filtered_groups"] = float(filtered)
        out["rollout/filtered_fraction"] = filtered / max(1, filtered + inserted)
        if self.trajectory is not None:  # multi-turn: since the start of the run
            out.update({f"rollout/{k}": float(v) for k, v in s.rollout_summary().items()})
        out.update({f"producer/{k}": float(v) for k, v in self.core.load().items()})
        for load in self.router.loads():
            out[f"engine/{load['engine']}/outstanding_requests"] = load["outstanding_requests"]
        out.update(self.monitor.metrics("producer"))
        out["producer/ray_calls"] = float(self.ray_calls)
        out.update(self.score_batcher.metrics("producer/reward"))
        if self.scorer is not None:  # reward/* as the reward actor reports them
            out.update(self.scorer.metrics())
        out.update(self.put_batcher.metrics("producer/put"))
        for b in self.gen_batchers:
            for k, v in b.metrics("producer/generate").items():
                out[k] = out.get(k, 0.0) + v
        return out
