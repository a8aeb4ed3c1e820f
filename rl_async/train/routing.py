"""Routing replay in the torch trainer (MoE models, `train.routing_replay`).

`pack()` lays every sample's recorded experts ([positions, layers, k], positions = the
tokens its engine fed) on the batch's [B, L] token grid (`routing_grid`), -1 where nothing
was recorded (padding, the last response token, samples without a recording: those keep the
trainer's own routing). `batching.token_logprobs` forces the grid in every forward that scores
rollout tokens: the anchor pass and the training forwards.

What it reports per collection (W&B `train/routing_*`, summary `routing`):
- `agreement`: share of (position, MoE layer) pairs whose own top-k set equals the engine's,
  over the on-policy samples (every trained token sampled by the weights the trainer holds)
  in the collection's first optimizer step (its pre-update weights);
- `logprob_mismatch_replay` / `_own`: mean |trainer log-prob - behaviour log-prob| over the
  on-policy tokens (sampled by the very weights the trainer holds) of the first micro-batch
  under the pre-update weights that has some, with the engine's experts and with the
  trainer's own (one extra no-grad forward of that micro-batch: the cost of knowing). Stale
  tokens would add policy drift to both, and old routing is no better a guess than new;
- `replayed_tokens`: response tokens scored with recorded experts (`unreplayed_tokens`: none),
  and the recordings' size (`replay_bytes`, over `replayed_samples`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rl_async.state.moe_routing import Routing, unpack_routed

if TYPE_CHECKING:
    from rl_async.train.batching import PackedBatch, TrainItem


def routing_grid(items: Sequence[TrainItem], length: int, layers: int, k: int,
                 device: torch.device | str) -> Tensor:
    """[B, L, layers, k] int64: row i's recorded experts at its first positions, -1 after."""
    grid = torch.full((len(items), length, layers, k), -1, dtype=torch.long)
    for row, item in enumerate(items):
        routed = item.routed
        if routed is None:
            continue
        if (routed.layers, routed.k) != (layers, k):
            raise ValueError(f"sample {row} of the micro-batch: routed experts for "
                             f"{routed.layers} layers x top-{routed.k}; the model has {layers} "
                             f"MoE layers x top-{k} (engine and trainer models differ)")
        fed = len(item.prompt_ids) + item.response_len - 1
        if routed.positions != fed:
            raise ValueError(f"sample {row} of the micro-batch: routed experts for "
                             f"{routed.positions} positions, its prompt and response feed {fed}")
        grid[row, :fed] = unpack_routed(routed)
    return grid.to(device)


def on_policy_rows(batch: PackedBatch, version: int) -> Tensor:
    """[B] bool: samples with trained tokens, every one of them sampled by `version` (the
    weights the trainer holds): where both trainers measure routing agreement."""
    return (((batch.versions_BT == version) | ~batch.mask_BT).all(dim=1)
            & batch.mask_BT.any(dim=1))


class TrainerRouting:
    def __init__(self, model: torch.nn.Module):
        self.routing = Routing(model)
        self._measuring = self._measured = False
        self._mismatch: dict[str, float] = {}
        self._replayed = self._unreplayed = 0.0
        self._bytes = self._samples = 0

    @property
    def shape(self) -> tuple[int, int]:
        """(MoE layers, top-k): the recorded experts' shape per position."""
        return self.routing.layers, self.routing.top_k

    def score(self, scorer, plain_scorer, batch: PackedBatch, items: Sequence[TrainItem],
              temperature: float, with_entropy: bool, version: int):
        """A training forward with the engine's experts (`scorer`: the DDP-wrapped one where
        there is one); under the pre-update weights it also counts how often the trainer's
        own top-k agrees with them, on the samples of `version` (on-policy: the engine ran
        these very weights), and measures the mismatch (`observe`)."""
        self.routing.measure_rows = None
        if self._measuring and batch.routing_BLMK is not None:
            length = batch.routing_BLMK.shape[1]
            self.routing.measure_rows = (on_policy_rows(batch, version)[:, None]
                                         .expand(-1, length).reshape(-1))
        try:
            out = scorer(batch, temperature, with_entropy)
        finally:
            self.routing.measure_rows = None
        self.observe(batch, items, out[0], plain_scorer, temperature, version)
        return out

    def start_collection(self) -> None:
        """Before the collection's first optimizer step: measure under its pre-update
        weights."""
        self._measuring, self._measured = True, False
        self._mismatch, self._replayed, self._unreplayed = {}, 0.0, 0.0
        self._bytes = self._samples = 0

    def after_first_step(self) -> None:
        self._measuring = False

    def observe(self, batch: PackedBatch, items: Sequence[TrainItem], logprobs_BT: Tensor,
                scorer, temperature: float, version: int) -> None:
        """After a training forward: count replayed tokens; on the first micro-batch with
        tokens of `version` (the trainer's weights) under the pre-update weights, also the
        log-prob mismatch with the engine's experts and with own."""
        for item in items:
            n = item.trained_tokens
            if item.routed is None:
                self._unreplayed += n
            else:
                self._replayed += n
                self._bytes += item.routed.nbytes
                self._samples += 1
        if self._measured or not self._measuring or batch.routing_BLMK is None:
            return
        mask = batch.mask_BT & (batch.versions_BT == version)
        if not bool(mask.any()):
            return
        self._measured = True
        behaviour = batch.behavior_BT[mask]
        with torch.no_grad():
            own_BT, _ = scorer(dataclasses.replace(batch, routing_BLMK=None), temperature)
        self._mismatch = {
            "replay": float((logprobs_BT.detach()[mask] - behaviour).abs().mean()),
            "own": float((own_BT.detach().float()[mask] - behaviour).abs().mean())}

    def metrics(self) -> dict[str, float]:
        agree, compared = self.routing.take_agreement()
        out = {"train/routing_replayed_tokens": self._replayed,
               "train/routing_unreplayed_tokens": self._unreplayed,
               "train/routing_replayed_samples": float(self._samples),
               "train/routing_replay_bytes": float(self._bytes)}
        if compared:
            out["train/routing_agreement"] = agree / compared
        if self._mismatch:
            out["train/routing_logprob_mismatch_replay"] = self._mismatch["replay"]
            out["train/routing_logprob_mismatch_own"] = self._mismatch["own"]
        return out
