"""The capacity plan (SPEC §3): every limit computed once, with its warnings.

Every actor reads the resolved `CapacityPlan`; nothing recomputes a limit. The limits are
independent (SPEC §1): raising one never raises another.

    engines                 = inference_gpus / gpus_per_engine   (cpu_engines when no GPUs)
    server_concurrency      = 2 x max_running_requests           (omitted, structured file)
    requested_slots         = engines x min(server_concurrency, max_running_requests)
    collection_samples      = rollout_batch_size x n_samples_per_prompt
    producer_samples        = round_up_to_whole_group(max(collection_samples, 2 x requested_slots))
    completed_buffer_groups = floor(async_data_buffer_capacity_factor x rollout_batch_size)

An explicit producer budget is kept, rounded DOWN to whole groups, never below one group.
A low-level file (no [async]) that omits it gets the native default: one collection.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rl_async.plan.config import RunConfig


@dataclass(frozen=True)
class Warning_:
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class CapacityPlan:
    engines: int
    max_running_requests: int
    server_concurrency: int
    http_slots: int
    engine_slots: int
    requested_slots: int
    group_size: int
    collection_samples: int
    producer_samples: int
    producer_groups: int
    completed_buffer_groups: int
    completed_buffer_samples: int
    max_weight_staleness: int
    global_batch_size: int
    optimizer_steps_per_collection: int
    submission_granularity: str
    rollout_batch_size: int
    fully_async: bool
    # "admission" (async runs with a lag) or "dequeue", and the admission bound's horizon:
    # groups the trainer may have ahead of it (taken, buffered, in flight) while the engines
    # hold its version, rollout_batch_size x (floor(lag / updates per collection) + 1).
    staleness_bound: str = "dequeue"
    admission_horizon_groups: int = 0
    # async.hold_back_collections x rollout_batch_size: groups left behind each collection
    hold_back_groups: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _round_up_to_group(samples: int, group: int) -> int:
    return math.ceil(samples / group) * group


def _engines(cfg: RunConfig, errors: list[str]) -> int:
    c = cfg.cluster
    if c.inference_gpus == 0:
        return c.cpu_engines
    if c.inference_gpus % c.gpus_per_engine:
        errors.append(
            f"cluster.gpus_per_engine = {c.gpus_per_engine} does not divide cluster.inference_gpus "
            f"= {c.inference_gpus}; choose a tensor-parallel size that divides the engine GPUs"
        )
    return max(1, c.inference_gpus // c.gpus_per_engine)


def _producer(cfg: RunConfig, group: int, collection: int, requested: int,
              warnings: list[Warning_], errors: list[str]) -> int:
    explicit = cfg.async_.async_max_concurrent_samples
    key = "async.async_max_concurrent_samples" if cfg.structured else "core.async_max_concurrent_samples"
    if explicit is None:
        if not cfg.structured:
            return collection
        return _round_up_to_group(max(collection, 2 * requested), group)
    if explicit <= 0:
        errors.append(f"{key} = {explicit}: the producer limit must be positive (at least one "
                      f"group of {group} samples); omit it to derive it from the engine fleet")
        return group
    rounded = max(group, (explicit // group) * group)
    if rounded != explicit:
        warnings.append(Warning_("GROUP_ROUNDING", (
            f"{key} = {explicit} is not a whole number of groups of {group}; "
            f"using {rounded} ({rounded // group} groups)")))
    return rounded


def limits_for_engines(cfg: RunConfig, plan: CapacityPlan, engines: int) -> tuple[int, int]:
    """(producer_samples, http_slots) for a fleet scaled to `engines` (`rl-async scale`):
    the HTTP gate is server_concurrency x engines; a derived producer budget is derived
    again, an explicit one scales with the engine count (whole groups, at least one)."""
    group = plan.group_size
    http = plan.server_concurrency * engines
    if cfg.async_.async_max_concurrent_samples is None and cfg.structured:
        requested = engines * min(plan.server_concurrency, plan.max_running_requests)
        return _round_up_to_group(max(plan.collection_samples, 2 * requested), group), http
    scaled = plan.producer_samples * engines // plan.engines
    return max(group, scaled // group * group), http


def plan_capacity(cfg: RunConfig) -> tuple[CapacityPlan, list[Warning_], list[str]]:
    """Resolve every limit. Returns (plan, warnings, errors); errors make the file invalid."""
    warnings: list[Warning_] = []
    errors: list[str] = []
    engines = _engines(cfg, errors)
    mrr = cfg.sglang.max_running_requests
    server = cfg.sglang.server_concurrency or (2 * mrr if cfg.structured else mrr)
    group = cfg.rollout.n_samples_per_prompt
    rbs = cfg.rollout.rollout_batch_size
    collection = rbs * group
    requested = engines * min(server, mrr)
    producer = _producer(cfg, group, collection, requested, warnings, errors)
    buffer_groups = math.floor(cfg.async_.async_data_buffer_capacity_factor * rbs)
    buffer_key = ("async" if cfg.structured else "core") + ".async_data_buffer_capacity_factor"
    if buffer_groups <= 0:
        errors.append(
            f"{buffer_key} = {cfg.async_.async_data_buffer_capacity_factor} with "
            f"rollout.rollout_batch_size = {rbs} gives a completed buffer of {buffer_groups} groups; "
            f"it must hold at least one group (factor >= {1 / rbs:.4g})")
    gbs = cfg.train.global_batch_size or collection
    steps = collection // gbs
    if collection % gbs:
        errors.append(
            f"train.global_batch_size = {gbs} must divide the collection of rollout.rollout_batch_size"
            f" x rollout.n_samples_per_prompt = {collection} samples (whole optimizer steps)")
    lag = cfg.max_weight_staleness
    plan = CapacityPlan(
        engines=engines, max_running_requests=mrr, server_concurrency=server,
        http_slots=server * engines, engine_slots=engines * mrr, requested_slots=requested,
        group_size=group, collection_samples=collection, producer_samples=producer,
        producer_groups=producer // group, completed_buffer_groups=max(buffer_groups, 0),
        completed_buffer_samples=max(buffer_groups, 0) * group, max_weight_staleness=lag,
        global_batch_size=gbs, optimizer_steps_per_collection=max(steps, 0),
        submission_granularity=cfg.async_.rollout_submission_granularity,
        rollout_batch_size=rbs, fully_async=cfg.fully_async)
    plan = _with_staleness_bound(cfg, plan)
    plan = _with_hold_back(cfg, plan, errors)
    warnings += capacity_warnings(plan)
    return plan, warnings, errors


def _with_staleness_bound(cfg: RunConfig, plan: CapacityPlan) -> CapacityPlan:
    """async.staleness_bound resolved: admission needs an async run that may run ahead
    (lag >= 1); sync runs and lag 0 open one collection per version instead."""
    lag, steps = plan.max_weight_staleness, plan.optimizer_steps_per_collection
    if not (cfg.async_.staleness_bound == "admission" and plan.fully_async and lag >= 1
            and steps >= 1):
        return plan
    return dataclasses.replace(plan, staleness_bound="admission",
                               admission_horizon_groups=plan.rollout_batch_size
                               * (lag // steps + 1))


def _with_hold_back(cfg: RunConfig, plan: CapacityPlan, errors: list[str]) -> CapacityPlan:
    """async.hold_back_collections: room for them plus the collection taken, and a lag that
    lets data that old be trained (else every group would be discarded)."""
    hold = cfg.async_.hold_back_collections
    if not hold:
        return plan
    key = f"async.hold_back_collections = {hold}"
    need = (hold + 1) * plan.rollout_batch_size
    if not plan.fully_async:
        errors.append(f"{key} needs an async run (async.fully_async = true): a synchronous "
                      f"run generates one collection per version")
    if plan.completed_buffer_groups < need:
        errors.append(f"{key} needs a completed buffer of at least {need} groups ((hold + 1) "
                      f"x rollout.rollout_batch_size); it holds {plan.completed_buffer_groups}: "
                      f"raise async.async_data_buffer_capacity_factor to {hold + 1}")
    least = hold * plan.optimizer_steps_per_collection + 1
    if plan.max_weight_staleness < least:
        errors.append(f"{key} makes every group at least {least - 1} versions old; "
                      f"async.max_weight_staleness = {plan.max_weight_staleness} would discard "
                      f"them all: raise it to at least {least}")
    return dataclasses.replace(plan, hold_back_groups=hold * plan.rollout_batch_size)


def capacity_warnings(p: CapacityPlan) -> list[Warning_]:
    w: list[Warning_] = []
    if p.producer_samples < p.requested_slots:
        w.append(Warning_("PRODUCER_BELOW_FLEET", (
            f"producer budget {p.producer_samples} samples < requested engine slots "
            f"{p.requested_slots}: engines will idle; raise async_max_concurrent_samples")))
    if p.http_slots < p.engine_slots:
        w.append(Warning_("HTTP_GATE_BELOW_ENGINE", (
            f"HTTP slots {p.http_slots} (server_concurrency {p.server_concurrency} x {p.engines} "
            f"engines) < engine slots {p.engine_slots}: engines cannot fill their running batch")))
    if min(p.producer_samples, p.http_slots) <= p.engine_slots:
        w.append(Warning_("NO_HEADROOM", (
            f"min(producer {p.producer_samples}, HTTP slots {p.http_slots}) <= engine slots "
            f"{p.engine_slots}: no queued work above engine capacity to refill finished requests")))
    if p.completed_buffer_groups < p.rollout_batch_size:
        w.append(Warning_("BUFFER_SMALLER_THAN_COLLECTION", (
            f"completed buffer {p.completed_buffer_groups} groups < rollout_batch_size "
            f"{p.rollout_batch_size}: a collection can never be fully buffered")))
    # The age budget only means something when generation may run ahead of training (at
    # lag 0 the producer opens one collection per version, as in sync mode).
    if p.fully_async and p.max_weight_staleness > 0:
        if p.completed_buffer_samples / p.global_batch_size > p.max_weight_staleness:
            w.append(Warning_("BUFFER_EXCEEDS_AGE_BUDGET", (
                f"the buffer spans {p.completed_buffer_samples / p.global_batch_size:g} optimizer "
                f"batches ({p.completed_buffer_samples} samples / global_batch_size "
                f"{p.global_batch_size}) > max_weight_staleness {p.max_weight_staleness}")))
        future = p.producer_samples + p.completed_buffer_samples
        if future > p.max_weight_staleness * p.global_batch_size:
            w.append(Warning_("RETAINED_EXCEEDS_LAG", (
                f"producer + buffer can hold {future} future samples > max_weight_staleness "
                f"{p.max_weight_staleness} x global_batch_size {p.global_batch_size}: an upper "
                f"bound on work that may age out, not a predicted discard rate")))
    return w
