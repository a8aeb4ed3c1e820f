"""The loop's schedule, decided from the config and the capacity plan: what the producer
generates per collection, whether a publication may overlap training, and how far the
engines may trail the trainer when publications are spaced out (publication.every_updates).
The controller follows it; validate checks the spacing against the lag."""

from __future__ import annotations

from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig


def publication_overlaps_training(cfg: RunConfig, plan: CapacityPlan) -> bool:
    """Whether a publication's drain and broadcast may run while the next collection trains.

    Needs a lag of at least 2: engines then trail the trainer by one publication, so the
    tokens they make while the next collection trains are already one version old when it
    is published. At lag 1 that leaves no room: every group started before the transfer
    lands is two versions old when dequeued, so overlapping discarded about a third of all
    groups (measured on the local demo) to save the publication's time; lag 1 publishes
    between steps instead, and its groups are one version old at most.
    Never with trainers on GPU: trainer rank 0 would broadcast on the publication NCCL
    communicator from one actor thread while DDP/TP/PP collectives run from another on the
    same device and default stream; NCCL gives no ordering between two communicators' kernels
    there, and the two can deadlock each other. The fix would be a dedicated CUDA stream per
    communicator with explicit event ordering; until that exists and is tested on a GPU, GPU
    trainers publish between steps. On CPU (gloo), each group has its own connections and
    the overlap is safe.
    """
    return cfg.fully_async and plan.max_weight_staleness >= 2 and not cfg.cluster.trainer_gpus


def generates_per_collection(cfg: RunConfig, plan: CapacityPlan) -> bool:
    """Whether the producer opens exactly one collection's groups per policy version.

    Synchronous runs, and async runs at lag 0: a group sampled ahead at lag 0 could only be
    discarded (its version is gone by the time it is dequeued) and re-attempted with fresh
    randomness, so the producer opens only what the current version will train. Lag 0 then
    equals sync by construction (same prompts, same versions, same seeds, same tokens)."""
    return not cfg.fully_async or plan.max_weight_staleness == 0


def engine_trail_updates(cfg: RunConfig, plan: CapacityPlan) -> int:
    """How many updates behind the trainer the engines' weights may be when a collection is
    dequeued: the updates a skipped publication leaves out (the controller publishes whole
    collections, so every_updates rounds up to a multiple of the updates per collection),
    plus the collection just trained, plus one more while an overlapped publication lands."""
    k = plan.optimizer_steps_per_collection
    skipped = -(-cfg.publication.every_updates // k) * k - k
    return skipped + k + (k if publication_overlaps_training(cfg, plan) else 0)


def publication_lag_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    """publication.every_updates must leave groups within the lag: a run that publishes less
    often than its lag allows would discard (and regenerate) most of what it generates."""
    every, lag = cfg.publication.every_updates, plan.max_weight_staleness
    if every == 1:
        return []
    key = f"publication.every_updates = {every}"
    if generates_per_collection(cfg, plan):
        return [f"{key} needs an async run with a lag of at least 2: this run trains only on "
                f"the current weights, so the engines need every version; set it to 1"]
    trail = engine_trail_updates(cfg, plan)
    if trail > lag:
        overlap = " and one while it lands" if publication_overlaps_training(cfg, plan) else ""
        return [f"{key}: the engines may then trail the trainer by {trail} updates when a "
                f"collection is dequeued (the updates between publications{overlap}), beyond "
                f"async.max_weight_staleness = {lag}, so groups would be discarded for age; "
                f"lower publication.every_updates or raise the lag"]
    return []
