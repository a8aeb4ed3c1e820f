"""Routed experts from SGLang, for MoE routing replay ("R3", `train.routing_replay`).

What SGLang 0.5.23 does (read in the PyPI wheel `sglang==0.5.23`; paths under sglang/):

- Launch flag `--enable-return-routed-experts` (ServerArgs field
  `enable_return_routed_experts`, srt/arg_groups/fields/exec_.py, default False). It creates a
  `RoutedExpertsCapturer` (srt/state_capturer/routed_experts.py): a pinned host buffer
  int32 [KV-pool tokens, num_hidden_layers, num_experts_per_tok] indexed by KV slot, and a
  device buffer every MoE layer's top-k writes into (srt/layers/moe/topk.py
  `capture_routed_experts_if_allowed`, before any EPLB logical->physical remap: logical
  expert ids; fused shared-expert columns are cut off). Without the flag there is no
  capturer and a request that asks gets no field at all, silently.
- Request field `return_routed_experts: true` on /generate (srt/managers/io_struct.py
  GenerateReqInput; the api.v1 GenerateRequest contract gate ignores it as an unknown key).
  `routed_experts_start_len` (default 0 = whole sequence) is left at its default.
- Reply: `meta_info["routed_experts"]`, a str: base64 of the C-order int32 array's raw bytes
  (srt/managers/detokenizer_manager.py `_b64_encode_per_request`:
  `pybase64.b64encode(t.numpy().tobytes())`; srt/managers/tokenizer_manager.py puts it in
  meta_info), shape [seqlen - 1, num_hidden_layers, num_experts_per_tok] with
  seqlen = len(origin_input_ids) + len(output_ids_through_stop)
  (srt/managers/scheduler_components/batch_result_processor.py `_maybe_collect_routed_experts`
  -> srt/state_capturer/base.py `BaseTopkCapturer.get_topk`: KV slots [0, seqlen - 1)).
  The reply's `output_ids` are `output_ids_through_stop` too (output_streamer.py), so the rows
  are exactly prompt + output[:-1]: RoutedExperts' positions, nothing to drop. The layer axis
  is every decoder layer; dense layers are never written and stay 0. Routes are collected
  only for requests that finish normally (`discard_finish_reason is None`): an aborted reply
  may lack them (this client then records none: the producer discards or resends aborts).
- SGLang's own decoder: srt/state_capturer/routed_experts.py
  `extract_routed_experts_from_meta_info` (np.frombuffer(b64decode(...), dtype=np.int32)).

Here: the dense layers are dropped (RoutedExperts holds the MoE layers, as the trainer
replays them) and ids become uint8 (<= 256 experts) or uint16. Positions of a prompt prefix
served from SGLang's radix cache carry the routes recorded when that KV was computed (the
engine flushes the cache at every publication, so under the same weights).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl_async.base.types import RoutedExperts
from rl_async.engine.base import EngineError
from rl_async.plan.moe import moe_dims, moe_layer_ids, routing_replay_on

FLAG = "--enable-return-routed-experts"  # ServerArgs.enable_return_routed_experts
REQUEST_FIELD = "return_routed_experts"  # GenerateReqInput.return_routed_experts
META_KEY = "routed_experts"              # meta_info key of the reply


@dataclass(frozen=True)
class RoutingLayout:
    """The shape of SGLang's routed-experts array for one model, and which layers to keep.
    Picklable: it travels to the engine actor inside SGLangEngineConfig."""

    hidden_layers: int             # num_hidden_layers: SGLang's layer axis
    top_k: int                     # num_experts_per_tok: SGLang's last axis
    experts: int                   # routed experts per MoE layer (ids are below this)
    moe_layers: tuple[int, ...]    # decoder layers with a mixture MLP, ascending

    def __post_init__(self) -> None:
        if self.top_k < 1 or not 1 < self.experts <= 65536:
            raise ValueError(f"routing layout: top_k = {self.top_k}, experts = {self.experts}: "
                             f"need top_k >= 1 and 2..65536 experts (ids kept in 16 bits)")
        if not self.moe_layers or not all(0 <= i < self.hidden_layers for i in self.moe_layers):
            raise ValueError(f"routing layout: MoE layers {list(self.moe_layers)[:8]} must be "
                             f"a non-empty subset of 0..{self.hidden_layers - 1}")

    @property
    def itemsize(self) -> int:
        return 1 if self.experts <= 256 else 2


def routing_layout(setting: str, config: dict[str, Any] | None,
                   source: str) -> RoutingLayout | None:
    """`train.routing_replay` for an SGLang engine: the layout to ask the server for, or None
    (off). `config` is the model's config.json fields, read from `source` (plan.memory's
    `architecture`: SGLang loads the same file, so on an engine's node it is readable)."""
    if setting == "off":
        return None
    if config is None:
        raise ValueError(f"train.routing_replay = {setting!r}: the SGLang engine needs the "
                         f"model's config to know its experts, but {source}; or set "
                         f"train.routing_replay = 'off'")
    if not routing_replay_on(setting, config):
        return None
    dims = moe_dims(config)
    if dims is None:
        raise ValueError(f"train.routing_replay = 'r3' but the model ({source}) has no "
                         f"experts (no num_experts / num_local_experts / n_routed_experts): "
                         f"set it to 'auto' or 'off'")
    if not config.get("num_hidden_layers"):
        raise ValueError(f"train.routing_replay: the model config ({source}) has no "
                         f"num_hidden_layers, the layer axis of SGLang's routed experts")
    return RoutingLayout(int(config["num_hidden_layers"]), dims.top_k, dims.experts,
                         moe_layer_ids(config))


def parse_routed_experts(meta: dict, layout: RoutingLayout, prompt_len: int, n_output: int,
                         where: str) -> RoutedExperts:
    """meta_info's routed experts as RoutedExperts over the MoE layers; EngineError naming
    `where` and the field when it is missing or not what SGLang writes."""
    field = f"meta_info.{META_KEY}"
    encoded = meta.get(META_KEY)
    if encoded is None:
        raise EngineError(
            f"{where}: the reply has no `{field}` although the request set "
            f"{REQUEST_FIELD}: the server runs without {FLAG} (the engine adds it when "
            f"train.routing_replay is on; a server attached by URL must be started with it)")
    if not isinstance(encoded, str):
        raise EngineError(f"{where}: {field} is {type(encoded).__name__}, expected a base64 "
                          f"string of int32 ids")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise EngineError(f"{where}: {field} is not base64 ({e})") from None
    positions = prompt_len + n_output - 1
    width = layout.hidden_layers * layout.top_k
    if len(raw) != 4 * positions * width:
        got = f"{len(raw) / 4 / width:g} positions" if width else f"{len(raw)} bytes"
        raise EngineError(
            f"{where}: {field} holds {len(raw)} bytes = {got} of {layout.hidden_layers} "
            f"layers x top-{layout.top_k} int32 ids; expected {positions} positions (prompt "
            f"{prompt_len} + output {n_output} - 1)")
    ids = np.frombuffer(raw, dtype="<i4").reshape(positions, layout.hidden_layers, layout.top_k)
    _check_layers(ids, layout, field, where)
    kept = ids[:, list(layout.moe_layers), :]
    if kept.size and (kept.min() < 0 or kept.max() >= layout.experts):
        raise EngineError(f"{where}: {field} has expert id {int(kept.min())}..{int(kept.max())}"
                          f" outside 0..{layout.experts - 1} (the model's routed experts)")
    data = np.ascontiguousarray(kept, dtype="<u1" if layout.itemsize == 1 else "<u2")
    return RoutedExperts(data.tobytes(), positions, len(layout.moe_layers), layout.top_k,
                         layout.itemsize)


def _check_layers(ids: np.ndarray, layout: RoutingLayout, field: str, where: str) -> None:
    """SGLang leaves a dense layer's rows 0 and writes distinct experts in a MoE layer's
    (top-2 and up, never all expert 0): a mismatch means the config's MoE layers
    (mlp_only_layers, decoder_sparse_step, first_k_dense_replace) are not the served model's."""
    if not len(ids):
        return
    moe = set(layout.moe_layers)
    dense = [i for i in range(layout.hidden_layers) if i not in moe]
    written = ids.any(axis=(0, 2))
    wrong = [i for i in dense if written[i]]
    if layout.top_k > 1:
        wrong += [i for i in layout.moe_layers if not written[i]]
    if wrong:
        raise EngineError(
            f"{where}: {field} routes layers {sorted(wrong)[:8]} unlike the model config's MoE "
            f"layers {list(layout.moe_layers)[:8]}...: the config read at launch does not "
            f"describe the served checkpoint")
