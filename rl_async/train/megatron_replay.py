"""Routing replay (R3) in the megatron backend: force the engine's recorded experts.

megatron-core 0.16 has a replay hook: `TopKRouter.routing` passes its `router_replay`
(transformer/moe/router.py; a `RouterReplay` when `moe_enable_routing_replay`) to
`topk_routing_with_score_function` (moe_utils.py), which asks it for the top-k through
`get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`. megatron's own
`RouterReplay` (transformer/moe/router_replay.py) replays whole layers from a class-level list
of every instance ever built, with no per-token fallback; a batch here has positions with
nothing recorded (padding, the last response token, samples without a recording) that keep
the router's own choice, as the torch trainer does (rl_async/state/moe_routing.py). So each
router gets a `ForcedTopK` in that slot instead: the same interface, per-token fallback,
nothing global.

The scores it gathers at the forced ids are what megatron gathers at its own top-k: the
logits under `moe_router_pre_softmax=False` (softmax over the k follows: HF's renormalised
weights) or the full softmax otherwise, so the gate weights stay the trainer's own and the
router still learns through them.

Layout: megatron's hidden states are [s, b, h], so the router sees tokens sequence-major
(token s * B + b). A batch's grid is `routing_BLMK` ([B, L, MoE layers, k], -1 = keep own:
rl_async/train/routing.py `routing_grid`); a pipeline stage's routers are the MoE layers it
holds (every layer is MoE in the models the megatron backend takes: megatron_moe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from rl_async.state.moe_routing import force_experts


class ForcedTopK:
    """One router's replay slot: the forced [tokens, k] ids of the current forward or None."""

    def __init__(self, layer: int):
        self.layer = layer
        self.forced_NK: Tensor | None = None
        # [N] bool: rows whose own top-k set is compared with the forced one (agreement),
        # cleared once counted so a recomputed forward does not count twice
        self.measure_N: Tensor | None = None
        self.agree = self.compared = 0

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None
                        ) -> tuple[Tensor, Tensor]:
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups=num_groups,
                                           group_topk=group_topk)
        forced = self.forced_NK
        if forced is None:
            return values, own
        if forced.shape != own.shape:
            raise ValueError(f"routing replay: forced experts of shape {tuple(forced.shape)} "
                             f"for MoE layer {self.layer}, whose router routes "
                             f"{tuple(own.shape)} (tokens, top-k)")
        chosen, agree, compared = force_experts(own, forced, self.measure_N)
        self.agree += agree
        self.compared += compared
        self.measure_N = None
        return scores.gather(1, chosen), chosen


def routers(model: Any) -> list[Any]:
    """The model's megatron TopKRouters, in module (= layer) order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class MegatronRouting:
    """Every router of this rank's stage taken over by a `ForcedTopK`."""

    def __init__(self, model: Any, first_layer: int, moe_layers: int, top_k: int):
        """`first_layer`: the global MoE-layer index of this stage's first router."""
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("routing replay: the megatron model has no MoE routers (a dense "
                             "model); set train.routing_replay = 'off'")
        self.first_layer, self.moe_layers, self.top_k = first_layer, moe_layers, top_k
        self.slots = [ForcedTopK(first_layer + j) for j in range(len(self.routers))]
        for router, slot in zip(self.routers, self.slots):
            router.router_replay = slot

    def force(self, routing_BLMK: Tensor | None, measure_B: Tensor | None = None) -> None:
        """Force `routing_BLMK`'s experts (None: the routers' own) from now on. A schedule's
        forward step sets its micro-batch's grid and leaves it set: activation recompute
        re-runs the routers in that micro-batch's backward, which (one pipeline stage)
        follows its forward before the next forward step."""
        if routing_BLMK is not None and routing_BLMK.shape[2:] != (self.moe_layers, self.top_k):
            raise ValueError(f"routing replay: a grid of {tuple(routing_BLMK.shape[2:])} "
                             f"(MoE layers, top-k) per position; the model has "
                             f"({self.moe_layers}, {self.top_k})")
        measure_N = None
        if routing_BLMK is not None and measure_B is not None:  # rows, sequence-major too
            measure_N = measure_B[None, :].expand(routing_BLMK.shape[1], -1).reshape(-1)
        for slot in self.slots:
            slot.forced_NK = (None if routing_BLMK is None else
                              routing_BLMK[:, :, slot.layer].transpose(0, 1).reshape(-1, self.top_k))
            slot.measure_N = measure_N

    def take_agreement(self) -> tuple[int, int]:
        """(pairs whose own top-k set equals the forced one, pairs compared) since last."""
        out = (sum(s.agree for s in self.slots), sum(s.compared for s in self.slots))
        for slot in self.slots:
            slot.agree = slot.compared = 0
        return out

    @contextlib.contextmanager
    def replay(self, routing_BLMK: Tensor | None) -> Iterator[None]:
        """`force` for the forwards inside, the routers' own routing after."""
        self.force(routing_BLMK)
        try:
            yield
        finally:
            self.force(None)


def for_trainer(module: Any, hf_config: Any, cfg: Any) -> MegatronRouting | None:
    """The trainer's replay (None when `cfg.routing_replay` is off): this rank's pipeline
    stage's routers; `cfg` is a megatron_model.MegatronParallelConfig."""
    if not cfg.routing_replay:
        return None
    from megatron.core import parallel_state

    from rl_async.train import megatron_convert as conv

    shape = conv.ModelShape.from_hf_config(hf_config)
    if not shape.num_experts:
        raise ValueError("train.routing_replay = 'r3' but the model is dense (no routers to "
                         "replay); set train.routing_replay = 'auto' or 'off'")
    if cfg.recompute == "full" and cfg.pipeline_parallel_size > 1:
        # 1F1B runs several micro-batches' forwards before their backwards: a recomputed
        # router would see a later micro-batch's grid (`MegatronRouting.force`).
        raise ValueError("train.recompute = 'full' with train.pipeline_parallel > 1 cannot "
                         "replay routing in the megatron backend; set train.recompute = "
                         "'selective' or 'none', or train.routing_replay = 'off'")
    per_stage = shape.num_layers // cfg.pipeline_parallel_size
    first = parallel_state.get_pipeline_model_parallel_rank() * per_stage
    return MegatronRouting(module, first, shape.num_layers, shape.moe_top_k)


def agreement(routing: MegatronRouting) -> dict[str, float]:
    """`train/routing_agreement` over every rank's MoE layers and samples (a collective on
    the world group: every rank calls it); absent when nothing was compared."""
    import torch.distributed as dist

    counts = torch.tensor(routing.take_agreement(), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(counts)
    agree, compared = counts.tolist()
    return {"train/routing_agreement": agree / compared} if compared else {}


def replay_counts(items: Any, dp_group: Any) -> dict[str, float]:
    """The torch trainer's counting `train/routing_*` metrics (rl_async/train/routing.py),
    summed over the data-parallel ranks: trained tokens scored with recorded experts and
    without, and the recordings' samples and bytes. (The log-prob mismatch needs the extra
    forward the torch trainer runs; not measured here yet.)"""
    import torch.distributed as dist

    replayed = [it for it in items if it.routed is not None]
    sums = torch.tensor([
        float(sum(it.trained_tokens for it in replayed)),
        float(sum(it.trained_tokens for it in items if it.routed is None)),
        float(len(replayed)), float(sum(it.routed.nbytes for it in replayed))],
        dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums, group=dp_group)
    names = ("replayed_tokens", "unreplayed_tokens", "replayed_samples", "replay_bytes")
    return {f"train/routing_{n}": v for n, v in zip(names, sums.tolist())}
