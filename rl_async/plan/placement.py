"""Where the trainers' actors go: one Ray placement group per tensor-parallel group.

megatron-core puts tensor-parallel ranks next to each other (ranks t*k .. t*k + t - 1 form
a TP group: parallel_state.initialize_model_parallel's default order), and their per-layer
all-reduces must stay on one node's NVLink. So with train.tensor_parallel = t > 1 on GPUs,
each TP group is a placement group of t bundles under STRICT_PACK (all on one node, or none
placed); data-parallel replicas may spread over nodes. Otherwise the whole trainer group is
one PACK group (best effort on one node).

The fleet places the trainers before the engines: engines packed first could take GPUs on
the node the trainer groups need (engine bundles are one per engine, each on one node).
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_async.plan.config import RunConfig


@dataclass(frozen=True)
class TrainerGroup:
    ranks: list[int]  # trainer ranks, one bundle each, in bundle order
    strategy: str     # Ray placement strategy


def trainer_groups(cfg: RunConfig) -> list[TrainerGroup]:
    c, t = cfg.cluster, cfg.train
    ranks = list(range(c.trainer_workers))
    tp = t.tensor_parallel if t.backend == "megatron" else 1
    if tp <= 1 or not c.trainer_gpus:
        return [TrainerGroup(ranks, "PACK")]
    return [TrainerGroup(ranks[k:k + tp], "STRICT_PACK") for k in range(0, len(ranks), tp)]
