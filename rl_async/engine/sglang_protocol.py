"""Request payloads and reply parsing for SGLang's native HTTP API (pinned: 0.5.23).

Pure functions, no I/O, so every field is unit-testable and checkable against SGLang's own
request classes (tests/unit/test_sglang_contract.py).

Endpoints and request classes of SGLang 0.5.23 (`sglang.srt.managers.io_struct`):

    POST /generate                          GenerateReqInput (+ api.v1 GenerateRequest gate)
    POST /abort_request                     AbortReq {rid, abort_all}
    POST /pause_generation                  PauseGenerationReqInput {mode: abort|retract|in_place}
    POST /continue_generation               ContinueGenerationReqInput {}
    POST /flush_cache?timeout=S             (query parameter; 400 while requests are running)
    POST /init_weights_update_group         InitWeightsUpdateGroupReqInput
    POST /destroy_weights_update_group      DestroyWeightsUpdateGroupReqInput {group_name}
    POST /begin_weight_update               BeginWeightUpdateReqInput {}
    POST /update_weights_from_distributed   UpdateWeightsFromDistributedReqInput
    POST /update_weights_from_tensor        UpdateWeightsFromTensorReqInput (base64 bytes)
    POST /end_weight_update                 EndWeightUpdateReqInput {}
    GET  /model_info                        {"weight_version": str, ...}
    GET  /v1/loads?include=core             {"loads": [LoadSnapshot core fields per DP rank]}
    GET  /health_generate                   200 once a 1-token generation succeeds

Log-probs: SGLang returns `log_softmax(logits / temperature)` of the sampled token (greedy:
temperature 1), i.e. the same quantity the trainer computes, before top-p/top-k truncation,
unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then temperature is ignored).

Per-token versions: 0.5.23 reports `meta_info.weight_versions`, spans
`[{version, start, end}]` over the output tokens, recording the weight version each token was
sampled under (a retracted request keeps the versions its tokens were sampled with). When a
server does not report spans, every token gets `min(version seen at request start, version
reported at the end)`: conservative, because a response is never younger than its oldest token.

Routed experts (MoE routing replay): `return_routed_experts` in, `meta_info.routed_experts`
out; the format and its source are in sglang_routing.py.
"""

from __future__ import annotations

import base64
from typing import Any

from rl_async.engine.base import (
    PAUSE_MODES,
    EngineError,
    GenerateOutput,
    InvalidRequestError,
    SamplingParams,
)
from rl_async.engine import sglang_routing

# torch dtype names SGLang accepts (it resolves them with getattr(torch, name)).
_DTYPES = {
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool",
}
_FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def generate_payload(input_ids: list[int], params: SamplingParams, rid: str,
                     ignore_eos: bool = False,
                     return_routed_experts: bool = False) -> dict[str, Any]:
    """The /generate body: token ids in, log-probs of the sampled tokens out. `ignore_eos`
    also disables `stop_token_ids` in SGLang (Req.check_finished): rollouts keep it False.
    `return_routed_experts`: the experts of every fed position too (sglang_routing)."""
    if not input_ids:
        raise InvalidRequestError(f"request {rid!r}: input_ids is empty: give at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids):
        raise InvalidRequestError(
            f"request {rid!r}: input_ids must be non-negative ints, got "
            f"{[t for t in input_ids if not isinstance(t, int) or t < 0][:5]!r}"
        )
    params.validate()
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k,  # -1 = whole vocabulary in SGLang too
        "ignore_eos": ignore_eos,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    if params.seed is not None:
        sampling["sampling_seed"] = int(params.seed)
    payload = {
        "rid": rid,
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        # -1: log-probs of the output tokens only (no prompt scoring).
        "logprob_start_len": -1,
        "stream": False,
    }
    if return_routed_experts:
        # Only when asked: the reply then grows by 16/3 bytes per position, layer and expert.
        payload[sglang_routing.REQUEST_FIELD] = True
    return payload


def abort_payload(rid: str | None) -> dict[str, Any]:
    if rid is None:
        return {"rid": "", "abort_all": True}
    return {"rid": rid, "abort_all": False}


def pause_payload(mode: str) -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"pause_generation mode = {mode!r}: must be one of {PAUSE_MODES}")
    return {"mode": mode}


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> dict[str, Any]:
    if not group_name:
        raise InvalidRequestError("init_weights_update_group: group_name is empty: name the group")
    if not (0 < rank_offset < world_size):
        raise InvalidRequestError(
            f"init_weights_update_group: rank_offset = {rank_offset} with world_size = "
            f"{world_size}: the trainer is rank 0, so an engine's ranks start at >= 1 and "
            f"end below world_size"
        )
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16', torch.bfloat16 or 'bfloat16' -> 'bfloat16' (what SGLang resolves)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidRequestError(f"weight dtype {dtype!r}: not one of {sorted(_DTYPES)}")
    return name


def update_distributed_payload(names: list[str], dtypes: list[Any], shapes: list[list[int]],
                               group_name: str, weight_version: int | None, flush_cache: bool,
                               load_format: str | None = None) -> dict[str, Any]:
    """One broadcast's metadata. `load_format="flattened_bucket"` means the sender broadcasts
    ONE uint8 tensor: each tensor's bytes in `names` order, no padding, every byte offset a
    multiple of that tensor's itemsize (SGLang 0.5.23 FlattenedTensorBucket.empty)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise InvalidRequestError(
            f"update_weights_from_distributed: names/dtypes/shapes have lengths "
            f"{len(names)}/{len(dtypes)}/{len(shapes)}: they must be equal and non-zero"
        )
    payload: dict[str, Any] = {
        "names": list(names),
        "dtypes": [dtype_name(d) for d in dtypes],
        "shapes": [[int(s) for s in shape] for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
    }
    return _with_update_options(payload, weight_version, load_format)


def _with_update_options(payload: dict[str, Any], weight_version: int | None,
                         load_format: str | None) -> dict[str, Any]:
    """The optional fields both weight-update requests share (SGLang takes versions as str)."""
    if weight_version is not None:
        payload["weight_version"] = str(weight_version)
    if load_format is not None:
        payload["load_format"] = load_format
    return payload


def update_tensor_payload(serialized_per_rank: list[bytes], weight_version: int | None,
                          flush_cache: bool, load_format: str | None = None) -> dict[str, Any]:
    """`serialized_named_tensors` is one ForkingPickler payload per TP rank, base64 in JSON."""
    if not serialized_per_rank:
        raise InvalidRequestError("update_weights_from_tensor: no serialized tensors to send")
    payload: dict[str, Any] = {
        "serialized_named_tensors": [base64.b64encode(b).decode("ascii")
                                     for b in serialized_per_rank],
        "flush_cache": flush_cache,
        "abort_all_requests": False,
    }
    return _with_update_options(payload, weight_version, load_format)


def serialize_named_tensors(named_tensors: list, tp_size: int) -> list[bytes]:
    """Pickle (name, tensor) pairs the way SGLang's Engine does: torch's ForkingPickler, which
    sends CUDA tensors as IPC handles and CPU tensors as shared-memory handles. The receiving
    server maps the sender's memory, so this works only for an engine on the same machine
    (colocated), and the tensors must stay alive until the update call returns."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named_tensors))
    # One payload per TP rank: each rank unpickles its own copy (SGLang's per-rank contract).
    return [buf.getvalue()] * tp_size


def parse_version(value: Any, where: str) -> int:
    """SGLang versions are strings; ours are ints. 'default' means a server started without
    --weight-version, which rl-async never does."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise EngineError(
        f"{where}: weight_version = {value!r} is not an integer policy version; launch the "
        f"server with --weight-version <int> (the engine does) or publish weights with a version"
    )


def _require(mapping: Any, key: str, where: str) -> Any:
    if not isinstance(mapping, dict):
        raise EngineError(f"{where}: expected a JSON object, got {type(mapping).__name__}")
    if key not in mapping:
        raise EngineError(f"{where}: reply has no `{key}` field (keys: {sorted(mapping)[:12]})")
    return mapping[key]


def parse_generate_response(
        body: Any, rid: str, start_version: int, prompt_len: int = 0,
        routing: sglang_routing.RoutingLayout | None = None) -> GenerateOutput:
    """`routing`: the request asked for routed experts (sglang_routing); a finished reply
    must then carry them. An aborted one need not (SGLang collects them at a normal finish,
    and the producer discards or resends an abort), so it gets none."""
    where = f"POST /generate (rid {rid!r})"
    output_ids = _require(body, "output_ids", where)
    meta = _require(body, "meta_info", where)
    if not isinstance(output_ids, list):
        raise EngineError(f"{where}: output_ids is {type(output_ids).__name__}, expected a list")
    entries = _require(meta, "output_token_logprobs", where + " meta_info")
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise EngineError(
            f"{where}: meta_info.output_token_logprobs has {got} entries for "
            f"{len(output_ids)} output tokens; they must match one to one"
        )
    logprobs = []
    for i, (entry, token) in enumerate(zip(entries, output_ids)):
        # Each entry is [logprob, token_id, text_or_null].
        if not (isinstance(entry, list) and len(entry) >= 2
                and isinstance(entry[0], (int, float)) and entry[1] == token):
            raise EngineError(
                f"{where}: meta_info.output_token_logprobs[{i}] = {entry!r} is not "
                f"[logprob, {token}, text] for output token {i}"
            )
        logprobs.append(float(entry[0]))
    finish = _parse_finish_reason(_require(meta, "finish_reason", where + " meta_info"), where)
    versions = token_versions(meta, len(output_ids), start_version, where)
    routed = None
    if routing is not None and finish != "abort":
        routed = sglang_routing.parse_routed_experts(meta, routing, prompt_len,
                                                     len(output_ids), where)
    return GenerateOutput(request_id=rid, output_ids=[int(t) for t in output_ids],
                          output_logprobs=logprobs, token_versions=versions,
                          finish_reason=finish, prompt_len=prompt_len,
                          refreshes=int(meta.get("num_retractions", 0) or 0),
                          routed_experts=routed)


def _parse_finish_reason(reason: Any, where: str) -> str:
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in _FINISH_TYPES:
        raise EngineError(
            f"{where}: meta_info.finish_reason = {reason!r}: expected an object whose type is "
            f"one of {sorted(_FINISH_TYPES)} (a finished, non-streamed request)"
        )
    return _FINISH_TYPES[kind]


def token_versions(meta: dict, n_tokens: int, start_version: int, where: str) -> list[int]:
    """Per-token versions from `weight_versions` spans, else the conservative fallback."""
    spans = meta.get("weight_versions")
    if not spans:
        end = parse_version(_require(meta, "weight_version", where + " meta_info"), where)
        return [min(start_version, end)] * n_tokens
    versions: list[int] = []
    for span in spans:
        start = _require(span, "start", where + " weight_versions span")
        stop = _require(span, "end", where + " weight_versions span")
        version = parse_version(_require(span, "version", where + " weight_versions span"), where)
        if start != len(versions) or stop < start:
            raise EngineError(
                f"{where}: meta_info.weight_versions span {span!r} does not continue at token "
                f"{len(versions)}; spans must tile the output tokens in order"
            )
        versions.extend([version] * (stop - start))
    if len(versions) != n_tokens:
        raise EngineError(
            f"{where}: meta_info.weight_versions covers {len(versions)} tokens but the reply "
            f"has {n_tokens} output tokens"
        )
    return versions


def check_success(body: Any, where: str) -> str:
    """Weight-update endpoints reply {"success": bool, "message": str}."""
    ok = _require(body, "success", where)
    message = str(body.get("message", ""))
    if ok is not True:
        raise EngineError(f"{where}: SGLang reported failure: {message or repr(body)}")
    return message


def parse_loads(body: Any) -> dict[str, int | float]:
    """Sum the per-DP-rank core load of GET /v1/loads into one engine's numbers."""
    where = "GET /v1/loads"
    loads = _require(body, "loads", where)
    if not isinstance(loads, list) or not loads:
        raise EngineError(f"{where}: `loads` is {loads!r}, expected a non-empty list of ranks")
    total = {"running": 0, "waiting": 0, "tokens_in_use": 0, "token_capacity": 0,
             "max_running_requests": 0}
    fields = {"running": "num_running_reqs", "waiting": "num_waiting_reqs",
              "tokens_in_use": "num_used_tokens", "token_capacity": "max_total_num_tokens",
              "max_running_requests": "max_running_requests"}
    for rank in loads:
        for ours, theirs in fields.items():
            value = _require(rank, theirs, where + " rank")
            if not isinstance(value, int):
                raise EngineError(f"{where}: {theirs} = {value!r} is not an integer")
            total[ours] += value
    return total
