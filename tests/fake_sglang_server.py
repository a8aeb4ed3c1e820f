"""A test double of an SGLang 0.5.23 server: SGLang's HTTP API over a real (tiny) model that
rl-async's embedded engine serves, launched exactly as SGLangEngine launches SGLang
(`python -m fake_sglang_server --model-path DIR --port N ...`; `sglang.launch_module`).

It follows SGLang's own rules, read in sgl-project/sglang, not rl-async's assumptions:

- Finishing (`srt/managers/schedule_batch.py`, `Req.check_finished`): `max_new_tokens`
  first (FINISH_LENGTH, `{"type": "length"}`); then, ONLY when `ignore_eos` is false, the
  last token in `stop_token_ids` or in the model's EOS ids (`eos_token_ids` from the model's
  config and generation config) ends it (FINISH_MATCHED_TOKEN, `{"type": "stop"}`). With
  `ignore_eos` true the stop ids are never checked.
- Weight updates (`srt/managers/scheduler_components/weight_updater.py`): an update outside a
  begin/end_weight_update session answers success=false; `update_weights_from_distributed`
  receives one broadcast per tensor from group rank 0, in `names` order; when the request
  carries `flush_cache` the scheduler flushes after loading and ASSERTS the flush worked.
  A flush needs an idle scheduler (no running and no waiting request), which a `retract`
  pause is not (retracted requests wait), so the assertion kills the scheduler: this double
  exits the process, as the server does (sglang #32153, #33784).
- `/flush_cache` answers 400 while requests run or wait.
- `pause_generation` modes `abort`, `retract`, `in_place`; `continue_generation` resumes.
- `/destroy_weights_update_group {group_name}` frees a group.

Test-only, not SGLang's: `GET /fake/weights_checksum` (what the weights are) and
`GET /fake/groups` (the groups joined).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from aiohttp import web

from rl_async.engine.base import EngineError, SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state import collective
from rl_async.state.models import resolve_dtype
from rl_async.state.weights import weights_checksum


def finish_reason(output_ids: list[int], max_new_tokens: int, ignore_eos: bool,
                  stop_token_ids: list[int], eos_token_ids: set[int]) -> dict | None:
    """SGLang's Req.check_finished, for the tokens so far: None while the request runs."""
    if len(output_ids) >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    last = output_ids[-1]
    if not ignore_eos and (last in stop_token_ids or last in eos_token_ids):
        return {"type": "stop", "matched": last}
    return None


def model_eos_ids(model_path: str) -> set[int]:
    """`eos_token_id` of config.json and generation_config.json (an int or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids


class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.engine = EmbeddedEngine(EmbeddedEngineConfig(
            path=args.model_path, dtype=args.dtype,
            max_running_requests=args.max_running_requests or 8))
        self.engine._version = int(args.weight_version)
        self.model_path = args.model_path
        self.eos_ids = model_eos_ids(args.model_path)
        self.session_open = False

    def idle(self) -> bool:
        load = self.engine.load()
        return load.running == 0 and load.waiting == 0

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        sp = body["sampling_params"]
        n = int(sp["max_new_tokens"])
        # The embedded engine stops at its stop ids; SGLang's rule decides which they are.
        stops = () if sp.get("ignore_eos", False) else tuple(
            sorted(set(sp.get("stop_token_ids") or []) | self.eos_ids))
        params = SamplingParams(max_new_tokens=n, temperature=float(sp["temperature"]),
                                top_p=float(sp["top_p"]), top_k=int(sp["top_k"]),
                                stop_token_ids=stops, seed=sp.get("sampling_seed"))
        try:
            out = await self.engine.generate(list(body["input_ids"]), params, body["rid"])
        except EngineError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if out.finish_reason == "abort":
            reason = {"type": "abort", "message": "aborted"}
        else:
            reason = finish_reason(out.output_ids, n, sp.get("ignore_eos", False),
                                   list(sp.get("stop_token_ids") or []), self.eos_ids)
        spans, start = [], 0
        for i in range(1, len(out.token_versions) + 1):
            if i == len(out.token_versions) or out.token_versions[i] != out.token_versions[start]:
                spans.append({"version": str(out.token_versions[start]), "start": start, "end": i})
                start = i
        meta = {"id": body["rid"], "finish_reason": reason,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out.output_ids),
                "output_token_logprobs": [[lp, t, None] for lp, t in
                                          zip(out.output_logprobs, out.output_ids)],
                "weight_version": str(self.engine._version), "weight_versions": spans,
                "num_retractions": out.refreshes}
        return web.json_response({"text": "", "output_ids": out.output_ids, "meta_info": meta})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.session_open:
            return web.json_response({"success": False, "message": "no weight update session; "
                                      "call /begin_weight_update first"})
        group = collective.get_group(body["group_name"])
        tensors = [torch.empty(shape, dtype=resolve_dtype(dtype))
                   for dtype, shape in zip(body["dtypes"], body["shapes"])]

        def receive() -> None:  # one broadcast per tensor, in names order, from rank 0
            for t in tensors:
                dist.broadcast(t, group=group, group_src=0)

        await asyncio.to_thread(receive)
        version = body.get("weight_version")
        await self.engine.update_weights_from_tensor(
            list(zip(body["names"], tensors)), None if version is None else int(version))
        if body.get("flush_cache", True) and not self.idle():
            # `assert flush_cache_success, "Cache flush failed after updating weights"`
            print("AssertionError: Cache flush failed after updating weights", flush=True)
            os._exit(1)
        return web.json_response({"success": True, "message": "Succeeded to update weights."})

    async def control(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else {}
        if path == "/pause_generation":
            await self.engine.pause_generation(body.get("mode", "abort"))
        elif path == "/continue_generation":
            await self.engine.continue_generation()
        elif path == "/abort_request":
            await self.engine.abort(None if body.get("abort_all") else body["rid"])
        elif path == "/flush_cache":
            if not self.idle():
                return web.Response(status=400, text="Cache not flushed because there are "
                                                     "pending requests")
        elif path in ("/begin_weight_update", "/end_weight_update"):
            self.session_open = path == "/begin_weight_update"
            return web.json_response({"success": True, "message": ""})
        elif path == "/init_weights_update_group":
            await asyncio.to_thread(
                collective.init_custom_process_group, body["backend"],
                f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
                body["rank_offset"], body["group_name"])
            return web.json_response({"success": True, "message": "group initialized"})
        elif path == "/destroy_weights_update_group":
            collective.destroy_group(body["group_name"])
            return web.json_response({"success": True, "message": "group destroyed"})
        return web.json_response({"message": "ok", "status": "ok"})

    async def info(self, request: web.Request) -> web.Response:
        path = request.path
        if path == "/model_info":
            return web.json_response({"model_path": self.model_path,
                                      "weight_version": str(self.engine._version)})
        if path == "/v1/loads":
            load = self.engine.load()
            core = {"dp_rank": 0, "num_running_reqs": load.running,
                    "num_waiting_reqs": load.waiting, "num_used_tokens": load.tokens_in_use,
                    "max_total_num_tokens": load.token_capacity,
                    "max_running_requests": load.max_running_requests, "token_usage": 0.0}
            return web.json_response({"version": "0.5.23", "loads": [core]})
        if path == "/fake/weights_checksum":
            return web.json_response({"checksum": weights_checksum(
                self.engine.model.named_parameters())})
        if path == "/fake/groups":
            return web.json_response({"groups": collective.joined_groups()})
        return web.Response(text="")  # /health, /health_generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-running-requests", type=int, default=None)
    args, _ignored = parser.parse_known_args()  # --tp-size, --device, --mem-fraction-static ...
    torch.set_num_threads(1)
    fake = FakeSGLang(args)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", fake.generate)
    app.router.add_post("/update_weights_from_distributed", fake.update_weights_from_distributed)
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
                 "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
                 "/destroy_weights_update_group"):
        app.router.add_post(path, fake.control)
    for path in ("/model_info", "/v1/loads", "/health", "/health_generate",
                 "/fake/weights_checksum", "/fake/groups"):
        app.router.add_get(path, fake.info)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
