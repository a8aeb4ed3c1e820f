"""Turn samples into padded [batch, tokens] tensors and score their response tokens.

Layout: each row is `prompt_ids + response_ids`, right-padded. The log-prob of token t comes
from the logits at position t − 1, so per-token tensors live on the *shifted* axis. Only the
window from the earliest response token onwards is materialised (`start`), which keeps the
[batch, tokens, vocab] logits small when prompts are long.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_async.base.types import RoutedExperts, Sample
from rl_async.train import prefix
from rl_async.train.logits import token_logprobs as chunked_logprobs
from rl_async.train.ragged import flat, ragged_index
from rl_async.state.moe_routing import ATTRIBUTE as ROUTING


@dataclass
class TrainItem:
    """One sample prepared for training: tokens, per-token data and its advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]        # empty = unknown
    advantage: float = 0.0
    anchor_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None   # None = every response token is trained
    routed: RoutedExperts | None = None  # MoE: the engine's experts (train/routing.py)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss averages over: the sampled ones of a trajectory."""
        return self.response_len if self.loss_mask is None else sum(self.loss_mask)


def item_from_sample(sample: Sample, advantage: float, where: str) -> TrainItem:
    """Validate a sample's per-token fields; `where` names it in errors (group and index)."""
    n = len(sample.response_ids)
    if not sample.prompt_ids:
        raise ValueError(f"{where}: prompt_ids is empty; the first response token needs at "
                         f"least one prompt token to be scored")
    if len(sample.behavior_logprobs) != n:
        raise ValueError(f"{where}: {len(sample.behavior_logprobs)} behavior_logprobs for {n} "
                         f"response tokens; the engine must return one log-prob per token")
    if sample.token_versions and len(sample.token_versions) != n:
        raise ValueError(f"{where}: {len(sample.token_versions)} token_versions for {n} "
                         f"response tokens; record one version per token or none")
    if sample.loss_mask and len(sample.loss_mask) != n:
        raise ValueError(f"{where}: {len(sample.loss_mask)} loss_mask entries for {n} "
                         f"response tokens; a trajectory masks each token or none")
    return TrainItem(list(sample.prompt_ids), list(sample.response_ids),
                     [float(x) for x in sample.behavior_logprobs], list(sample.token_versions),
                     float(advantage),
                     loss_mask=[int(m) for m in sample.loss_mask] if sample.loss_mask else None,
                     routed=sample.routed_experts)


def micro_batches(items: Sequence[TrainItem], size: int,
                  max_tokens: int | None = None) -> list[Sequence[TrainItem]]:
    """Consecutive micro-batches of `items`: `size` items each, or, with `max_tokens`
    (train.max_tokens_per_microbatch), as many as fit a padded-token budget: a micro-batch
    grows while its row count x its longest sequence stays within `max_tokens` (at least one
    item, even a longer one). The split changes no gradient: the loss is the token mean over
    the whole optimizer step, whatever the micro-batches (except M2PO's mask, which like
    AReaL's is drawn over each micro-batch's tokens)."""
    if max_tokens is None:
        return [items[i:i + size] for i in range(0, len(items), size)]
    out, start, longest = [], 0, 0
    for i, it in enumerate(items):
        n = len(it.prompt_ids) + it.response_len
        if i > start and max(longest, n) * (i - start + 1) > max_tokens:
            out.append(items[start:i])
            start, longest = i, 0
        longest = max(longest, n)
    if start < len(items):
        out.append(items[start:])
    return out


@dataclass
class PackedBatch:
    input_ids_BL: Tensor
    attention_mask_BL: Tensor
    start: int                 # first shifted position kept (earliest response token − 1)
    targets_BT: Tensor         # token whose log-prob each kept position predicts
    mask_BT: Tensor            # bool: response tokens
    behavior_BT: Tensor
    anchor_BT: Tensor | None
    advantages_BT: Tensor
    versions_BT: Tensor        # int64, −1 where unknown or masked
    spans: list[tuple[int, int]]  # per row: [begin, end) of its response on the T axis
    shared: prefix.SharedPrompts | None = None  # set: score each distinct prompt once
    routing_BLMK: Tensor | None = None  # MoE routing replay: experts forced per position


def pack(items: Sequence[TrainItem], device: torch.device | str, pad_id: int = 0,
         share_prompts: bool = False, routing_layers: tuple[int, int] | None = None
         ) -> PackedBatch:
    """`share_prompts`: lay the rows out to run each distinct prompt once (train/prefix.py)
    where some prompt repeats; the scores and gradients are the plain layout's.
    `routing_layers` (MoE layers, top-k): replay the recorded experts (train/routing.py) on
    the plain layout: a shared prompt row would force one sample's prompt routing on all."""
    if not items:
        raise ValueError("pack() needs at least one item")
    lengths = [len(it.prompt_ids) + it.response_len for it in items]
    L = max(lengths)
    start = min(len(it.prompt_ids) for it in items) - 1
    T = max(L - start - 1, 0)
    B = len(items)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    behavior = torch.zeros((B, T), dtype=torch.float32)
    anchor = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    have_anchor = all(it.anchor_logprobs is not None for it in items)
    rows, cols = ragged_index([0] * B, lengths)
    ids[rows, cols] = torch.tensor([t for it in items for part in (it.prompt_ids, it.response_ids)
                                    for t in part], dtype=torch.long)
    attn[rows, cols] = 1
    n = [it.response_len for it in items]
    begins = [len(it.prompt_ids) - 1 - start for it in items]
    spans = [(b, b + k) for b, k in zip(begins, n)]
    rows, cols = ragged_index(begins, n)
    if all(it.loss_mask is None for it in items):
        mask[rows, cols] = True
    else:  # environment tokens are context, not trained (SPEC §12)
        mask[rows, cols] = torch.tensor(flat([it.loss_mask if it.loss_mask is not None
                                              else [1] * k for it, k in zip(items, n)],
                                             n, "loss_mask"), dtype=torch.bool)
    behavior[rows, cols] = torch.tensor(flat([it.behavior_logprobs for it in items], n,
                                             "behavior_logprobs"), dtype=torch.float32)
    adv[rows, cols] = torch.repeat_interleave(
        torch.tensor([float(it.advantage) for it in items], dtype=torch.float32),
        torch.tensor(n, dtype=torch.long))
    versions[rows, cols] = torch.tensor(flat([it.token_versions or [-1] * k
                                              for it, k in zip(items, n)], n,
                                             "token_versions"), dtype=torch.long)
    if have_anchor:
        anchor[rows, cols] = torch.tensor(flat([it.anchor_logprobs for it in items], n,
                                               "anchor_logprobs"), dtype=torch.float32)
    dev = torch.device(device)
    routing = None
    if routing_layers is not None and any(it.routed is not None for it in items):
        from rl_async.train.routing import routing_grid

        routing, share_prompts = routing_grid(items, L, *routing_layers, dev), False
    return PackedBatch(
        input_ids_BL=ids.to(dev), attention_mask_BL=attn.to(dev), start=start,
        targets_BT=ids[:, start + 1:].to(dev), mask_BT=mask.to(dev),
        behavior_BT=behavior.to(dev), anchor_BT=anchor.to(dev) if have_anchor else None,
        advantages_BT=adv.to(dev), versions_BT=versions.to(dev), spans=spans,
        shared=prefix.plan(items, start, T, dev, pad_id) if share_prompts else None,
        routing_BLMK=routing)


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float,
                   with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / temperature) of each target token, [B, T] float32.

    The engine samples with the same temperature and records the same quantity as the
    behaviour log-prob, so anchor and behaviour are comparable. Entropy (of the same
    tempered distribution, detached) is returned when asked.
    """
    if batch.shared is not None:
        return prefix.token_logprobs(model, batch.shared, batch.targets_BT.shape[1],
                                     temperature, with_entropy)
    B, L = batch.input_ids_BL.shape
    keep = L - batch.start  # logits for positions start .. L-1
    routing = getattr(model, ROUTING, None)
    forced = (None if batch.routing_BLMK is None
              else batch.routing_BLMK.view(B * L, *batch.routing_BLMK.shape[2:]))
    with routing.replay(forced) if routing is not None else contextlib.nullcontext():
        out = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                    logits_to_keep=keep, use_cache=False)
    # Over vocabulary chunks: no fp32 copy of the logits (rl_async/train/logits.py).
    return chunked_logprobs(out.logits[:, :-1], batch.targets_BT, temperature,
                            with_entropy=with_entropy)


class PolicyScorer(torch.nn.Module):
    """`token_logprobs` as a module. DDP wraps this rather than the model: a micro-batch of
    shared prompts runs the model twice (prefixes, then rows), and DDP allows one forward of
    the module it wraps per backward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: PackedBatch, temperature: float, with_entropy: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        return token_logprobs(self.model, batch, temperature, with_entropy)


def unpack_rows(values_BT: Tensor, batch: PackedBatch) -> list[list[float]]:
    """Per-row response values (e.g. log-probs) as Python lists."""
    cpu = values_BT.detach().float().cpu()
    return [cpu[i, b:e].tolist() for i, (b, e) in enumerate(batch.spans)]
