"""Score a micro-batch whose rows share prompts by running each distinct prompt once.

A group's n samples share one prompt, and the plain forward (`batching.token_logprobs`) runs
prompt + response for every row: SmolLM2's chat template makes the arithmetic prompts 44
tokens against at most 12 response tokens, so most of a row's forward and backward is its
prompt, computed n times over. Here (SPEC §8's loss, unchanged):

    prefix  = prompt[:-1] of each distinct prompt, right-padded, run ONCE with gradients
    cache   = each layer's keys/values of the prefixes, rows picked by index_select
              (its backward sums every row's gradient into the one prefix)
    rows    = [prompt[-1]] + response[:-1] per sample, run on that cache at positions
              len(prompt) - 1 ...: position j's logits predict response token j

The log-probs and the gradient equal the plain forward's to float rounding
(tests/unit/test_shared_prompts.py); they are returned on `pack()`'s shifted [B, T] axis, so
the loss code does not change. A micro-batch where no prompt repeats, or a prompt is a single
token (no prefix to share), is scored the plain way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rl_async.state.models import cache_kwarg
from rl_async.train.logits import token_logprobs as chunked_logprobs
from rl_async.train.ragged import ragged_index

if TYPE_CHECKING:
    from rl_async.train.batching import TrainItem


@dataclass
class SharedPrompts:
    """One micro-batch laid out as distinct prefixes (U rows) and per-sample rows (B)."""

    prefix_ids_UP: Tensor
    prefix_mask_UP: Tensor
    rows_B: Tensor            # the distinct prefix each sample continues
    ids_BR: Tensor            # [prompt[-1]] + response[:-1], right-padded
    mask_BK: Tensor           # K = P + R: the row's real prefix columns, then its own tokens
    positions_BR: Tensor
    targets_BR: Tensor        # the response tokens the R positions predict
    columns_BR: Tensor        # each position's column on pack()'s T axis (T: padding)


def plan(items: Sequence[TrainItem], start: int, T: int, device: torch.device,
         pad_id: int) -> SharedPrompts | None:
    """The shared layout of `items`, or None when sharing saves nothing or cannot apply.

    `start` and `T` are pack()'s: response token j of row i sits at column
    len(prompt_i) - 1 - start + j of the shifted axis."""
    prompts = [tuple(it.prompt_ids) for it in items]
    distinct = list(dict.fromkeys(prompts))
    if (len(distinct) == len(prompts) or min(len(p) for p in distinct) < 2
            or max(it.response_len for it in items) == 0):
        return None
    index = {p: u for u, p in enumerate(distinct)}
    P = max(len(p) for p in distinct) - 1
    R = max(it.response_len for it in items)
    U, B = len(distinct), len(items)
    prefix_ids = torch.full((U, P), pad_id, dtype=torch.long)
    prefix_mask = torch.zeros((U, P), dtype=torch.long)
    for u, p in enumerate(distinct):
        prefix_ids[u, :len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
        prefix_mask[u, :len(p) - 1] = 1
    rows = torch.tensor([index[p] for p in prompts], dtype=torch.long)
    n = [it.response_len for it in items]
    first = torch.tensor([len(it.prompt_ids) - 1 for it in items], dtype=torch.long)
    # Fed: [prompt[-1]] + response[:-1] (just [prompt[-1]] for an empty response).
    fed_rows, fed_cols = ragged_index([0] * B, [max(k, 1) for k in n])
    ids = torch.full((B, R), pad_id, dtype=torch.long)
    ids[fed_rows, fed_cols] = torch.tensor(
        [t for it in items for t in [it.prompt_ids[-1], *it.response_ids[:-1]]],
        dtype=torch.long)
    mask = torch.cat([prefix_mask.index_select(0, rows),
                      torch.zeros((B, R), dtype=torch.long)], dim=1)
    mask[fed_rows, P + fed_cols] = 1
    positions = first[:, None] + torch.arange(R)[None, :]
    resp_rows, resp_cols = ragged_index([0] * B, n)
    targets = torch.full((B, R), pad_id, dtype=torch.long)
    targets[resp_rows, resp_cols] = torch.tensor(
        [t for it in items for t in it.response_ids], dtype=torch.long)
    columns = torch.full((B, R), T, dtype=torch.long)
    columns[resp_rows, resp_cols] = (first - start)[resp_rows] + resp_cols
    dev = torch.device(device)
    return SharedPrompts(prefix_ids.to(dev), prefix_mask.to(dev), rows.to(dev), ids.to(dev),
                         mask.to(dev), positions.to(dev), targets.to(dev), columns.to(dev))


def token_logprobs(model: torch.nn.Module, shared: SharedPrompts, T: int, temperature: float,
                   with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """[B, T] log-probs (and detached entropy) of the response tokens, as the plain forward."""
    from transformers import DynamicCache

    kwarg = cache_kwarg(model)
    prefixes = DynamicCache()
    # logits_to_keep=1: the prefix's logits predict nothing that is trained.
    model(input_ids=shared.prefix_ids_UP, attention_mask=shared.prefix_mask_UP,
          use_cache=True, logits_to_keep=1, **{kwarg: prefixes})
    per_row = DynamicCache()
    for i, (k, v) in enumerate(_layers(prefixes)):
        per_row.update(k.index_select(0, shared.rows_B), v.index_select(0, shared.rows_B), i)
    out = model(input_ids=shared.ids_BR, attention_mask=shared.mask_BK,
                position_ids=shared.positions_BR, use_cache=True, **{kwarg: per_row})
    lp_BR, entropy_BR = chunked_logprobs(out.logits, shared.targets_BR, temperature,
                                         with_entropy=with_entropy)
    return _on_t_axis(lp_BR, shared.columns_BR, T), (
        None if entropy_BR is None else _on_t_axis(entropy_BR.detach(), shared.columns_BR, T))


def _layers(cache) -> list[tuple[Tensor, Tensor]]:
    """(keys, values) per layer: `layers` in transformers 5, key_cache/value_cache before."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _on_t_axis(values_BR: Tensor, columns_BR: Tensor, T: int) -> Tensor:
    """Scatter each row's values to its response columns; padding lands in column T, cut."""
    out = values_BR.new_zeros((values_BR.shape[0], T + 1))
    return out.scatter(1, columns_BR, values_BR)[:, :T]
