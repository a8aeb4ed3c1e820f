"""Record and replay the experts a mixture-of-experts model's routers choose (R3).

Engine and trainer compute the router logits with different kernels, batch shapes and
precisions, so a token whose top-k sits on a near tie goes to different experts on each side:
the trainer then scores a different function than the one that sampled (Megatron-LM#4168:
3 of 3 MoE RL runs collapsed without routing replay). With replay the engine records, for
every token it feeds and every MoE layer, the top-k expert ids, and the trainer forces the
same ids in every forward that scores those tokens. The gate *weights* stay the trainer's own
(softmax of its router logits at the forced ids, renormalised as the model does), so the
router still learns through them.

`Routing(model)` takes over every softmax-top-k router of the model (transformers 5's
`*TopKRouter` modules: Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral), in layer order. Each is
checked at install: its own forward must equal softmax -> top-k -> (renormalise) on a probe,
so a router of another form (sigmoid scores, grouped top-k, bias-corrected selection) is
refused by name instead of replayed wrongly.

    routing.begin(); model(...); ids_NMK = routing.take()           # engine: record
    with routing.replay(forced_NMK): model(...)                      # trainer: replay
    with routing.replay(None): model(...)                            # trainer: own routing

N = batch x sequence positions in the order the model flattens them (row-major [B, L]),
M = MoE layers, K = top-k; a forced row with any id < 0 keeps the router's own choice.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.nn import functional as F

from rl_async.base.types import RoutedExperts

ATTRIBUTE = "rl_routing"  # the model attribute engines and trainer find it under


class RoutingError(RuntimeError):
    """A model whose routers cannot be recorded or replayed, or a replay of the wrong shape."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in module (= layer) order."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def _renormalises(router: torch.nn.Module) -> bool:
    # Qwen2/3-MoE and OLMoE say so in `norm_topk_prob`; Mixtral always renormalises.
    return bool(getattr(router, "norm_topk_prob", True))


class Routing:
    def __init__(self, model: torch.nn.Module, perturb: float = 0.0, seed: int = 0):
        """`perturb` (tests only): the engine picks its top-k from its probabilities plus
        Gaussian noise of this scale, as near-tie flips between kernels do; the gate weights
        stay the true probabilities at the picked experts."""
        self.routers = routers(model)
        if not self.routers:
            raise RoutingError(f"{type(model).__name__}: no top-k router modules (a dense "
                               f"model); set train.routing_replay = 'off'")
        self.top_k = int(self.routers[0].top_k)
        self.experts = int(self.routers[0].weight.shape[0])
        self.perturb = perturb
        self._noise = torch.Generator().manual_seed(seed)
        self._recorded: list[torch.Tensor] | None = None
        self._forced: torch.Tensor | None = None
        # [N] bool: the positions whose own top-k set is compared with the forced one
        # (agreement); None: none.
        self.measure_rows: torch.Tensor | None = None
        self.recording = True  # False: installed only to perturb (benchmarks), not to record
        self.agree = self.compared = 0
        for index, router in enumerate(self.routers):
            self._check(router)
            original = router.forward
            router.forward = types.MethodType(
                lambda mod, hidden, _i=index, _orig=original: self._route(mod, hidden, _i, _orig),
                router)
        setattr(model, ATTRIBUTE, self)

    @property
    def layers(self) -> int:
        return len(self.routers)

    # ---- engine: record ---------------------------------------------------------------
    def begin(self) -> None:
        self._recorded = []

    def take(self) -> torch.Tensor:
        """[N, M, K] int64 expert ids of the forward since `begin`."""
        recorded, self._recorded = self._recorded, None
        if recorded is None or len(recorded) != self.layers:
            raise RoutingError(f"routing: {0 if recorded is None else len(recorded)} router "
                               f"calls recorded in one forward, the model has {self.layers}")
        return torch.stack(recorded, dim=1)

    # ---- trainer: replay --------------------------------------------------------------
    @contextlib.contextmanager
    def replay(self, forced_NMK: torch.Tensor | None):
        if forced_NMK is not None and (forced_NMK.dim() != 3 or forced_NMK.shape[1:] !=
                                       (self.layers, self.top_k)):
            raise RoutingError(f"routing replay: forced ids of shape {tuple(forced_NMK.shape)}"
                               f"; this model needs [tokens, {self.layers}, {self.top_k}]")
        previous, self._forced = self._forced, forced_NMK
        try:
            yield self
        finally:
            self._forced = previous

    def take_agreement(self) -> tuple[int, int]:
        """(pairs whose own top-k set equals the forced one, pairs compared) since last."""
        out = (self.agree, self.compared)
        self.agree = self.compared = 0
        return out

    # ---- the router ---------------------------------------------------------------------
    def _route(self, router, hidden, index: int, original):
        logits, scores, own = original(hidden)
        chosen = own
        if self.perturb:
            probs = F.softmax(logits.detach().float(), dim=-1)
            noise = torch.randn(probs.shape, generator=self._noise).to(probs.device)
            chosen = torch.topk(probs + self.perturb * noise, self.top_k, dim=-1).indices
        forced = self._forced
        if forced is not None:
            if forced.shape[0] != own.shape[0]:
                raise RoutingError(f"routing replay: {forced.shape[0]} forced positions for "
                                   f"a forward of {own.shape[0]} tokens (router {index})")
            chosen, agree, compared = force_experts(own, forced[:, index], self.measure_rows)
            self.agree += agree
            self.compared += compared
        if chosen is not own:
            scores = self._weights(router, logits, chosen).to(scores.dtype)
        if self._recorded is not None:
            self._recorded.append(chosen.detach())
        return logits, scores, chosen

    @staticmethod
    def _weights(router, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The gate weights the model gives `chosen`: its probabilities there, renormalised
        where the model renormalises (differentiable: the router learns through them)."""
        weights = F.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if _renormalises(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights

    def _check(self, router) -> None:
        """The router must be softmax -> top-k -> (renormalise): checked on a probe."""
        weight = router.weight
        probe = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(7)
                            ).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            logits, scores, ids = router(probe)
            if ids.shape[-1] != self.top_k or not torch.allclose(
                    self._weights(router, logits, ids).to(scores.dtype), scores,
                    rtol=1e-3, atol=1e-5):
                raise RoutingError(
                    f"{type(router).__name__}: not a softmax top-{self.top_k} router (its "
                    f"gate weights differ from softmax at its top-k); routing replay knows "
                    f"Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral routers: set "
                    f"train.routing_replay = 'off' for this model")


def force_experts(own_NK: torch.Tensor, forced_NK: torch.Tensor,
                  measure_N: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """The experts a replayed router uses: `forced_NK` where a row's ids are all >= 0, its
    own top-k elsewhere (positions nothing was recorded for). Also (rows whose own top-k set
    equals the forced one, rows compared) among the forced rows marked in `measure_N`; the
    torch trainer's routers and megatron's (train/megatron_replay.py) both count this way."""
    forced_NK = forced_NK.to(own_NK.device)
    use_N1 = (forced_NK >= 0).all(dim=-1, keepdim=True)
    agree = compared = 0
    if measure_N is not None:
        rows = use_N1[:, 0] & measure_N.to(use_N1.device)
        same = (forced_NK.sort(dim=-1).values == own_NK.sort(dim=-1).values).all(dim=-1)
        agree, compared = int((same & rows).sum()), int(rows.sum())
    return torch.where(use_N1, forced_NK, own_NK), agree, compared


def pack_routed(ids_PMK: torch.Tensor) -> RoutedExperts:
    """[positions, layers, k] expert ids as the compact form samples carry (1 byte per id
    while every id is below 256, else 2)."""
    import numpy as np

    size = 1 if ids_PMK.numel() == 0 or int(ids_PMK.max()) < 256 else 2
    array = ids_PMK.detach().to("cpu").numpy().astype(np.uint8 if size == 1 else "<u2")
    return RoutedExperts(array.tobytes(), *ids_PMK.shape, itemsize=size)


def unpack_routed(routed: RoutedExperts) -> torch.Tensor:
    """The [positions, layers, k] int64 ids of a sample's RoutedExperts."""
    import numpy as np

    array = np.frombuffer(routed.data, dtype=np.uint8 if routed.itemsize == 1 else "<u2")
    return torch.from_numpy(array.astype(np.int64)).view(routed.positions, routed.layers,
                                                         routed.k)
