"""megatron-core weights out as Hugging Face tensors, one layer at a time, on the trainer's
device: what a publication snapshot and an HF export read.

    data-parallel replica 0 only (the others hold the same weights and do nothing)
    for each pipeline stage s, for each unit of it (the embedding, one layer, the final
    norm and output layer):
        its TP ranks all-gather the unit's shards                    (on the device)
        stage s > 0: its TP rank 0 sends the gathered unit to global rank 0  (p2p, device)
        global rank 0 converts the unit to HF names and yields it    (nothing elsewhere)

With expert parallelism each data-parallel rank holds E / EP of a layer's experts, so replica
0 alone lacks some: before the TP gather, a layer's experts are all-gathered over the expert-
parallel group, whose other members (expert-data-parallel rank 0, data-parallel rank > 0) take
part in that gather and nothing else.

So global rank 0 holds one layer's full tensors at a time (the consumer copies them out:
into the pinned-host publication snapshot, or the CPU export), never the whole model on the
GPU, and no rank pickles or unpickles a stage (the old PP merge went through CPU objects,
gave CPU tensors the NCCL publication rejected, and held every stage on every rank).
Global rank 0 is pipeline stage 0, tensor rank 0, data-parallel rank 0 in megatron's rank
order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl_async.train import megatron_convert as conv
from rl_async.train import megatron_model as mm
from rl_async.train import megatron_moe as moe


def _units(local: dict[str, Tensor], stage: int, stages: int, per: int,
           tied: bool) -> list[list[str]]:
    """This stage's tensor names grouped into units, in HF order."""
    units: list[list[str]] = []
    if stage == 0:
        units.append([n for n in local if n.startswith("embedding.")])
    for j in range(per):
        prefix = f"decoder.layers.{j}."
        units.append([n for n in local if n.startswith(prefix)])
    if stage == stages - 1:
        # a tied model's last stage keeps its own copy of the embedding as output_layer:
        # the HF export names it once (the embedding), so it never travels
        units.append([n for n in local if not n.startswith(("embedding.", "decoder.layers."))
                      and not (tied and n == "output_layer.weight")])
    return units


def _gather_tp(tensors: dict[str, Tensor], tp: int, group: Any) -> dict[str, Tensor]:
    if tp == 1:
        return dict(tensors)
    per_rank: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, t in tensors.items():
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for r, part in enumerate(parts):
            per_rank[r][name] = part
    return conv.unshard_tp(per_rank)


def _gather_ep(tensors: dict[str, Tensor], ep: int, group: Any) -> dict[str, Tensor]:
    """Every expert-parallel rank's experts of one unit, under global expert numbers (EP
    rank r holds experts r * local onwards); other tensors as they are."""
    if ep == 1:
        return tensors
    experts = {n for n in tensors if moe._expert_index(n) is not None}
    local = len({moe._expert_index(n)[1] for n in experts})
    out = {n: t for n, t in tensors.items() if n not in experts}
    for name in [n for n in tensors if n in experts]:  # the same order on every EP rank
        parts = [torch.empty_like(tensors[name]) for _ in range(ep)]
        dist.all_gather(parts, tensors[name].contiguous(), group=group)
        for r, part in enumerate(parts):
            out.update(moe.renumber_experts({name: part}, r * local))
    return out


def _send(unit: dict[str, Tensor], dst: int) -> None:
    dist.send_object_list([[(n, tuple(t.shape), t.dtype) for n, t in unit.items()]], dst=dst)
    for t in unit.values():
        dist.send(t.contiguous(), dst=dst)


def _recv(src: int, device: torch.device) -> dict[str, Tensor]:
    meta: list[Any] = [None]
    dist.recv_object_list(meta, src=src)
    out = {}
    for name, shape, dtype in meta[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out[name] = t
    return out


def _to_hf(unit: dict[str, Tensor], stage: int, per: int, shape: conv.ModelShape
           ) -> dict[str, Tensor]:
    """A gathered unit under HF names (layers renumbered to the global index)."""
    if any(n.startswith("embedding.") for n in unit):
        return conv.embedding_to_hf(unit, shape)
    if any(n.startswith("decoder.layers.") for n in unit):
        j = int(next(iter(unit))[len("decoder.layers."):].split(".", 1)[0])
        i = stage * per + j
        renamed = {n.replace(f"decoder.layers.{j}.", f"decoder.layers.{i}.", 1): t
                   for n, t in unit.items()}
        return conv.layer_to_hf(renamed, i, shape)
    return conv.final_to_hf(unit, shape)  # a tied model's last-stage copy is not emitted


def stream_hf_tensors(model: Any, hf_config: Any, cfg: mm.MegatronParallelConfig
                      ) -> Iterator[tuple[str, Tensor]]:
    """HF-named full tensors on global rank 0, one unit at a time; every other rank of
    data-parallel replica 0 must consume it too (it takes part and yields nothing)."""
    from megatron.core import parallel_state as ps

    shape = mm.model_shape(hf_config, cfg)
    stages, per = cfg.pipeline_parallel_size, shape.num_layers // cfg.pipeline_parallel_size
    stage, tp, ep = ps.get_pipeline_model_parallel_rank(), cfg.tensor_parallel_size, cfg.expert_parallel_size
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    local = {k: v.detach() for k, v in mm._tensor_state(model).items()}
    units_here = _units(local, stage, stages, per, shape.tied_embeddings)
    if ps.get_data_parallel_rank() != 0:
        if ep > 1 and ps.get_expert_data_parallel_rank() == 0:  # replica 0's EP peers
            for names in units_here:
                _gather_ep({n: local[n] for n in names}, ep, ep_group)
        return
    if ep > 1 and ps.get_expert_data_parallel_rank() != 0:
        raise RuntimeError("megatron export: data-parallel rank 0 is not expert-data-parallel "
                           "rank 0 in this rank layout; its experts cannot be gathered")

    def gathered(names: list[str]) -> dict[str, Tensor]:
        return _gather_tp(_gather_ep({n: local[n] for n in names}, ep, ep_group), tp, tp_group)

    receiver = dist.get_rank() == 0
    device = next(iter(local.values())).device
    if not receiver:  # a sender, or a TP peer of one: gather this stage's units
        for names in units_here:
            unit = gathered(names)
            if tp_rank == 0 and stage > 0:
                _send(unit, dst=0)
        return
    for s in range(stages):
        if s == 0:
            units = (gathered(names) for names in units_here)
        else:  # stage s's TP rank 0 of replica 0: its first rank in the pipeline group
            src = _stage_rank(s)
            count = per + (1 if s == stages - 1 else 0)
            units = (_recv(src, device) for _ in range(count))
        for unit in units:
            yield from _to_hf(unit, s, per, shape).items()


def _stage_rank(stage: int) -> int:
    """Global rank of pipeline stage `stage` in global rank 0's pipeline group."""
    from megatron.core import parallel_state as ps

    return dist.get_global_rank(ps.get_pipeline_model_parallel_group(), stage)
