"""The running batch of the embedded engine: one left-padded KV cache shared by all rows.

Invariant for every running request (one row): the cache holds the KV of its prefix except
the last token, and that last token (the one sampled most recently) is fed at the next decode
step. Rows are left-padded to a common length; `mask_BL` marks real cache positions, and each
row's position ids count only its real tokens, so padding never changes a row's numbers.
Membership changes re-pack the cache (`select` drops rows, `merge` concatenates a freshly
prefilled batch); a decode step only appends one column.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rl_async.engine.fast_decode import FastDecode
from rl_async.engine.prefix_cache import PrefixCache
from rl_async.engine.scheduler import Request
from rl_async.state.models import cache_kwarg
from rl_async.state.moe_routing import ATTRIBUTE as ROUTING

PAD_ID = 0  # any valid id: padded positions are masked out and their KV zeroed


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live at the front of a buffer with room to grow:
    a decode step writes its column in place instead of concatenating the whole cache (which
    copied every layer's KV every step: a fifth of the tiny engine's time). `keys`/`values`
    are views of the filled part. Replace both with `set_kv(keys, values)`: assigning `keys`
    alone moves the filled length, so a `values` read after it takes the wrong columns (the
    setters stay for transformers' own DynamicLayer code, which assigns them)."""

    _k = _v = None
    _len = 0

    @property
    def keys(self):
        return None if self._k is None else self._k[..., :self._len, :]

    @keys.setter
    def keys(self, value):
        self._k = value
        self._len = value.shape[-2] if value is not None and value.dim() == 4 else 0

    @property
    def values(self):
        return None if self._v is None else self._v[..., :self._len, :]

    @values.setter
    def values(self, value):
        self._v = value

    def set_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Adopt two tensors as the buffers, filled to their length."""
        self._k, self._v = keys, values
        self._len = keys.shape[-2] if keys.dim() == 4 else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, filled = key_states.shape[-2], self._len
        if self._k.dim() != 4 or filled + n > self._k.shape[-2]:
            # grow by half (at least 64 columns): amortised O(1) copies per decoded token
            capacity = filled + n + max(64, filled // 2)
            shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
            k, v = key_states.new_empty(shape), value_states.new_empty(shape)
            if filled:
                k[..., :filled, :] = self._k[..., :filled, :]
                v[..., :filled, :] = self._v[..., :filled, :]
            self._k, self._v = k, v
        self._k[..., filled:filled + n, :] = key_states
        self._v[..., filled:filled + n, :] = value_states
        self._len = filled + n
        return self.keys, self.values


def new_cache(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A cache of GrowingLayers: empty (filled by a prefill), or holding `kv` per layer."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    if kv is not None:
        layers = []
        for k, v in kv:
            layer = GrowingLayer()
            layer.lazy_initialization(k, v)
            layer.set_kv(k, v)
            layers.append(layer)
        cache.layers = layers
    return cache


class KVBatch:
    def __init__(self, cache: DynamicCache, mask_BL: torch.Tensor, requests: list[Request]):
        self.cache = cache
        self.mask_BL = mask_BL
        self.requests = requests

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def select(self, keep: list[int]) -> KVBatch | None:
        """The batch with only rows `keep` (in order); None when no row is kept."""
        if not keep:
            return None
        if len(keep) == len(self.requests):
            return self
        index = torch.tensor(keep, device=self.mask_BL.device)
        mask_BL = self.mask_BL.index_select(0, index)
        # Drop leading columns that are padding for every remaining row.
        start = int(mask_BL.any(dim=0).nonzero()[0])
        kv = [(k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
              for k, v in self.kv()]
        return KVBatch(new_cache(kv), mask_BL[:, start:], [self.requests[i] for i in keep])

    @staticmethod
    def merge(a: KVBatch | None, b: KVBatch | None) -> KVBatch | None:
        if a is None or b is None:
            return a if b is None else b
        length = max(a.mask_BL.shape[1], b.mask_BL.shape[1])
        kv = [(torch.cat([_left_pad(ka, length), _left_pad(kb, length)]),
               torch.cat([_left_pad(va, length), _left_pad(vb, length)]))
              for (ka, va), (kb, vb) in zip(a.kv(), b.kv(), strict=True)]
        mask_BL = torch.cat([_left_pad_mask(a.mask_BL, length), _left_pad_mask(b.mask_BL, length)])
        return KVBatch(new_cache(kv), mask_BL, a.requests + b.requests)


def _left_pad(kv_BHLD: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - kv_BHLD.shape[2]
    if missing == 0:
        return kv_BHLD
    pad = kv_BHLD.new_zeros(kv_BHLD.shape[0], kv_BHLD.shape[1], missing, kv_BHLD.shape[3])
    return torch.cat([pad, kv_BHLD], dim=2)


def _left_pad_mask(mask_BL: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - mask_BL.shape[1]
    if missing == 0:
        return mask_BL
    return torch.cat([mask_BL.new_zeros(mask_BL.shape[0], missing), mask_BL], dim=1)


def prefill(model: torch.nn.Module, requests: list[Request], device: torch.device,
            cache: PrefixCache | None = None) -> tuple[KVBatch, torch.Tensor]:
    """Run the whole prefix of each request; returns the batch (KV of every prefix token) and
    the last-position logits [B, V], row i for `batch.requests[i]` (the requests, in an order
    of this function's choosing). Callers append the sampled token, which restores the
    invariant (cache = prefix minus its last token).

    A prefix is computed once however many requests share it: requests with the same prefix
    admitted together (a group's n samples of one prompt) share one row of the forward, and
    with a `cache`, a prompt prefilled in an earlier step is copied from it, not recomputed
    (siblings admitted later, as slots free up). Fresh prompts computed here are added to the
    cache. Rows never share storage afterwards (each decode step appends to its own row)."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(r.prefix()), len(first)) for r in requests]
    distinct = [requests[rows.index(i)] for i in range(len(first))]
    hits = {}
    if cache is not None and cache.max_tokens:
        for i, (key, request) in enumerate(zip(first, distinct)):
            if not request.output_ids and (entry := cache.get(key)) is not None:
                hits[i] = entry
    missing = [i for i in range(len(distinct)) if i not in hits]
    batch, logits_BV = None, []
    if missing:
        batch, computed_BV = _prefill_rows(model, [distinct[i] for i in missing], device)
        logits_BV.append(computed_BV)
        if cache is not None and cache.max_tokens:
            _remember(cache, batch, computed_BV)
        if len(missing) == len(requests):
            return batch, computed_BV
    for i, entry in hits.items():
        mask_1L = torch.ones((1, entry.tokens), dtype=torch.long, device=device)
        batch = KVBatch.merge(batch, KVBatch(new_cache(entry.kv), mask_1L, [distinct[i]]))
        logits_BV.append(entry.logits_V[None])
        if entry.routing is not None:
            distinct[i].routing = [entry.routing]
    for request, row in zip(requests, rows):  # siblings: the routing of their shared row
        if distinct[row].routing:
            request.routing = list(distinct[row].routing)
    position = {d: row for row, d in enumerate(missing + list(hits))}  # distinct -> its row
    index = torch.tensor([position[d] for d in rows], device=batch.mask_BL.device)
    # index_select copies: no row is a view of a cached tensor or of another row
    kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in batch.kv()]
    return (KVBatch(new_cache(kv), batch.mask_BL.index_select(0, index), list(requests)),
            torch.cat(logits_BV).index_select(0, index))


def _remember(cache: PrefixCache, batch: KVBatch, logits_BV: torch.Tensor) -> None:
    """Cache the fresh prompts of a prefilled batch: each row's real (unpadded) suffix."""
    length = batch.mask_BL.shape[1]
    kv = batch.kv()
    for row, request in enumerate(batch.requests):
        if request.output_ids:  # a retracted request's prompt + output: no sibling shares it
            continue
        start = length - len(request.prompt_ids)  # left padding: real positions are a suffix
        cache.put(tuple(request.prompt_ids),
                  [(k[row:row + 1, :, start:], v[row:row + 1, :, start:]) for k, v in kv],
                  logits_BV[row], request.routing[0] if request.routing else None)


def _prefill_rows(model: torch.nn.Module, requests: list[Request], device: torch.device
                  ) -> tuple[KVBatch, torch.Tensor]:
    prefixes = [r.prefix() for r in requests]
    length = max(len(p) for p in prefixes)
    ids_BL = torch.full((len(prefixes), length), PAD_ID, dtype=torch.long)
    mask_BL = torch.zeros((len(prefixes), length), dtype=torch.long)
    for row, prefix in enumerate(prefixes):
        ids_BL[row, length - len(prefix):] = torch.tensor(prefix)
        mask_BL[row, length - len(prefix):] = 1
    ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
    positions_BL = (mask_BL.cumsum(dim=1) - 1).clamp(min=0)
    cache = new_cache()
    routing = _begin_routing(model)
    out = model(input_ids=ids_BL, attention_mask=mask_BL, position_ids=positions_BL,
                use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    if routing is not None:  # each row's real (suffix) positions: its whole prefix
        ids_BLMK = routing.take().view(len(prefixes), length, routing.layers, routing.top_k)
        for row, (request, prefix) in enumerate(zip(requests, prefixes)):
            request.routing = [ids_BLMK[row, length - len(prefix):].clone()]
    # Zero the KV of padded positions: a fully masked query row can produce NaN in later
    # layers, and NaN * 0 attention weight is still NaN.
    real_B1L1 = mask_BL[:, None, :, None].bool()
    for layer in cache.layers:
        layer.set_kv(torch.where(real_B1L1, layer.keys, 0),
                     torch.where(real_B1L1, layer.values, 0))
    return KVBatch(cache, mask_BL, list(requests)), out.logits[:, -1]


def decode(model: torch.nn.Module, batch: KVBatch, fast: FastDecode | None = None
           ) -> torch.Tensor:
    """Feed every row's last sampled token; appends one KV column; returns logits [B, V].
    `fast`: the same step without the stock forward's per-call Python (fast_decode.py)."""
    device = batch.mask_BL.device
    ids_B1 = torch.tensor([[r.output_ids[-1]] for r in batch.requests], device=device)
    mask_BL = torch.cat([batch.mask_BL, batch.mask_BL.new_ones(len(batch.requests), 1)], dim=1)
    positions_B1 = mask_BL.sum(dim=1, keepdim=True) - 1
    routing = _begin_routing(model)
    if fast is not None:
        logits_BV = fast.step(ids_B1, mask_BL, positions_B1, batch.cache)
    else:
        logits_BV = model(input_ids=ids_B1, attention_mask=mask_BL, position_ids=positions_B1,
                          use_cache=True, **{cache_kwarg(model): batch.cache}).logits[:, -1]
    if routing is not None:
        ids_BMK = routing.take()
        for row, request in enumerate(batch.requests):
            request.routing.append(ids_BMK[row:row + 1].clone())
    batch.mask_BL = mask_BL
    return logits_BV


def _begin_routing(model: torch.nn.Module):
    """The model's routing recorder (MoE routing replay, state/moe_routing.py), started for
    one forward; None when the engine does not record."""
    routing = getattr(model, ROUTING, None)
    if routing is None or not routing.recording:
        return None
    routing.begin()
    return routing


def prefill_isolated(model: torch.nn.Module, requests: list[Request], device: torch.device,
                     cache: PrefixCache | None = None) -> tuple[KVBatch, torch.Tensor]:
    """`prefill`, one request per forward: each row's numbers are those of the request alone
    (no padding, batch of one), whatever else is admitted with it. The batch-invariant mode.
    Requests with the same prefix share one forward: identical inputs through the identical
    computation give identical bits (a group's samples share their prompt)."""
    done: dict[tuple[int, ...], tuple[KVBatch, torch.Tensor]] = {}
    batch, logits = None, []
    for request in requests:
        key = tuple(request.prefix())
        if key not in done:
            done[key] = (*prefill(model, [request], device, cache), request)
        part, row_logits, first = done[key]
        request.routing = list(first.routing)  # MoE: the experts its shared prefill chose
        request.prefill_len = len(key)
        batch = KVBatch.merge(batch, KVBatch(part.cache, part.mask_BL, [request]))
        logits.append(row_logits)
    return batch, torch.cat(logits)


def decode_isolated(model: torch.nn.Module, batch: KVBatch) -> torch.Tensor:
    """`decode`, one row per forward over that row's own KV (its real suffix of the padded
    cache, so a batch of one with no padding): a request's logits do not depend on which other
    requests share the step. Costs one forward per distinct row (engine.batch_invariant,
    README): rows with the same tokens whose KV came from the same computation (same prefill
    length, then the same isolated decodes) share one forward."""
    length = batch.mask_BL.shape[1]
    device = batch.mask_BL.device
    done: dict[tuple, tuple[torch.Tensor, list]] = {}
    logits, new_kv = [], []
    for row, request in enumerate(batch.requests):
        key = (request.prefill_len, tuple(request.prefix()))
        if key not in done:
            real = int(batch.mask_BL[row].sum())
            start = length - real  # left padding: the real positions are a suffix of the row
            cache = DynamicCache([(k[row:row + 1, :, start:], v[row:row + 1, :, start:])
                                  for k, v in batch.kv()])
            routing = _begin_routing(model)
            out = model(input_ids=torch.tensor([[request.output_ids[-1]]], device=device),
                        attention_mask=torch.ones((1, real + 1), dtype=torch.long,
                                                  device=device),
                        position_ids=torch.tensor([[real]], device=device),
                        use_cache=True, **{cache_kwarg(model): cache})
            done[key] = (out.logits[:, -1], [(layer.keys[:, :, -1:], layer.values[:, :, -1:])
                                             for layer in cache.layers],
                         None if routing is None else routing.take())
        logits.append(done[key][0])
        new_kv.append(done[key][1])
        if done[key][2] is not None:
            request.routing.append(done[key][2].clone())
    for i, layer in enumerate(batch.cache.layers):
        layer.set_kv(torch.cat([layer.keys, torch.cat([kv[i][0] for kv in new_kv])], dim=2),
                     torch.cat([layer.values, torch.cat([kv[i][1] for kv in new_kv])], dim=2))
    batch.mask_BL = torch.cat([batch.mask_BL, batch.mask_BL.new_ones(len(batch.requests), 1)],
                              dim=1)
    return torch.cat(logits)
