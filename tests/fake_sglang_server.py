"""A test double of an SGLang 0.5.23 server: SGLang's HTTP API over a real (tiny) model that
rl-async's embedded engine serves, launched exactly as SGLangEngine launches SGLang
(`python -m fake_sglang_server --model-path DIR --port N ...`; `sglang.launch_module`).

It follows SGLang 0.5.23's own rules, read in its source (the PyPI wheel; paths as in
sgl-project/sglang, under python/sglang/), not rl-async's assumptions:

- Launch arguments (`srt/server_args.py` ServerArgs.add_cli_args over
  `srt/arg_groups/fields/*.py`): parsed strictly; an unknown flag ends the launch (exit 2).
  The flags are tests/unit/fixtures/sglang_0_5_23/launch_flags.json, extracted from them.
- `/generate` (`srt/entrypoints/http_server.py` generate_request ->
  `api_contract.generate_contract_error`, `api/v1/api_types.py` SamplingParams): an unknown
  sampling_params key is HTTP 400.
- Finishing (`srt/managers/schedule_batch.py`, `Req.update_finish_state`): stop tokens and
  EOS are checked BEFORE the length cap (a stop id landing at max_new_tokens is "stop"), and
  only when `ignore_eos` is false (`_check_token_based_finish`). The stop set: the request's
  `stop_token_ids`, the model's EOS ids (config and generation config), the tokenizer's
  eos_token_id and its additional stop tokens (rl_async/algo/stop_ids.py cites each).
- `/health` and `/health_generate` (`http_server.py` health_generate): one handler. `/health`
  answers 200 at once only when SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false
  (`srt/environ.py`, default true); otherwise it sends a one-token generate and answers 200
  once the scheduler answers, else 503 after SGLANG_HEALTH_CHECK_TIMEOUT (default 20) s. A
  generate waits at the pause gate while the engine is paused
  (`srt/managers/tokenizer_manager.py`, `is_pause_cond`), so a paused engine's probe is 503.
  Tests set SGLANG_HEALTH_CHECK_TIMEOUT low, as SGLang itself reads it.
- Weight updates (`srt/managers/scheduler_components/weight_updater.py`): outside a
  begin/end_weight_update session an update fails; a second begin, or an end without a
  session, fails; every failure is HTTP 400 (`http_server.py`). `update_weights_from_distributed`
  receives one broadcast per tensor from group rank 0, in `names` order, on every TP rank
  (rank = rank_offset + tp_rank: `model_runner_components/weight_updater.py`
  init_weights_update_group; this double's TP ranks past 0 are helper processes). With
  `flush_cache` the scheduler flushes after loading; a flush that finds requests running or
  queued fails the call ("Weights were updated, but the cache was not flushed"), but while
  the scheduler is paused (retract / in_place) its waiting queue is ignored
  (`srt/managers/scheduler.py` flush_cache -> is_fully_idle(ignore_waiting=paused)): a
  retract pause flushes.
- `/flush_cache` answers 400 under the same rule.
- `pause_generation` modes `abort` (the tokenizer's gate only), `retract`, `in_place` (also
  the scheduler's); `continue_generation` resumes both.

Test-only, not SGLang's: `GET /fake/weights_checksum` (what the weights are; with TP > 1, of
every rank) and `GET /fake/groups` (the groups joined).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import uuid
from pathlib import Path

import torch
from aiohttp import web

from fake_sglang_tp import TPRanks, receive_tensors
from rl_async.algo.stop_ids import model_stop_ids
from rl_async.engine.base import EngineError, SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state import collective
from rl_async.state.weights import weights_checksum

FLAGS = Path(__file__).parent / "unit" / "fixtures" / "sglang_0_5_23" / "launch_flags.json"
# api/v1/api_types.py SamplingParams: every key it declares (unknown keys are rejected)
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice"}
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are "
               "still running or queued. Retract or finish them, then call /flush_cache.")


def finish_reason(output_ids: list[int], max_new_tokens: int, ignore_eos: bool,
                  stop_token_ids: list[int], eos_token_ids: set[int]) -> dict | None:
    """SGLang's Req.update_finish_state, for the tokens so far: None while the request runs."""
    last = output_ids[-1]
    if not ignore_eos and (last in stop_token_ids or last in eos_token_ids):
        return {"type": "stop", "matched": last}
    if len(output_ids) >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    return None


def env_bool(name: str, default: bool) -> bool:
    """srt/environ.py EnvBool.parse."""
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'"{value}" is not a valid boolean value')


def parser() -> argparse.ArgumentParser:
    """SGLang 0.5.23's launch flags, strictly (an unknown one exits with code 2)."""
    p = argparse.ArgumentParser(prog="sglang serve")  # abbreviations allowed, as there
    kinds = {"flag": dict(action="store_true"), "value": {}, "multi": dict(nargs="*"),
             "optional": dict(nargs="?"), "bool_optional":
             dict(action=argparse.BooleanOptionalAction)}
    for flag, kind in json.loads(FLAGS.read_text()).items():
        if kind == "bool_optional" and flag.startswith("--no-"):
            continue  # BooleanOptionalAction adds it
        p.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"), **kinds[kind])
    return p


class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.engine = EmbeddedEngine(EmbeddedEngineConfig(
            path=args.model_path, dtype=args.dtype or "float32",
            max_running_requests=int(args.max_running_requests or 8),
            record_routing=bool(args.enable_return_routed_experts)))
        self.engine._version = int(args.weight_version or 0)
        self.model_path = args.model_path
        self.eos_ids = model_stop_ids(args.model_path, _tokenizer(args.model_path))
        self.tp = TPRanks(int(args.tp_size or 1))
        self.session_open = False
        self.scheduler_paused = False  # retract / in_place pause the scheduler too

    def idle(self) -> bool:
        """Scheduler.is_fully_idle(ignore_waiting=self._engine_paused)."""
        load = self.engine.load()
        return load.running == 0 and (load.waiting == 0 or self.scheduler_paused)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        sp = body["sampling_params"]
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:  # generate_contract_error
            return web.json_response({"error": {"message": f"sampling_params: unknown "
                                                f"keys {unknown}"}}, status=400)
        n = int(sp.get("max_new_tokens", 128))
        # The embedded engine stops at its stop ids; SGLang's rule decides which they are.
        stops = () if sp.get("ignore_eos", False) else tuple(
            sorted(set(sp.get("stop_token_ids") or []) | self.eos_ids))
        params = SamplingParams(max_new_tokens=n, temperature=float(sp.get("temperature", 1.0)),
                                top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", -1)),
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
        meta = _meta(body, out, reason, self.engine._version)
        if body.get("return_routed_experts") and out.routed_experts is not None \
                and reason["type"] != "abort":  # SGLang collects routes at a normal finish
            meta["routed_experts"] = _routed_experts(out.routed_experts,
                                                     self.engine.model.config.to_dict())
        return web.json_response({"text": "", "output_ids": out.output_ids, "meta_info": meta})

    async def health(self, request: web.Request) -> web.Response:
        if request.path == "/health" and not env_bool(
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True):
            return web.Response(status=200)
        timeout = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
        probe = asyncio.ensure_future(self.engine.generate(
            [0], SamplingParams(max_new_tokens=1, temperature=0.0), rid))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:  # any answer of the scheduler within the timeout: the probe's, or a step's
            while loop.time() < deadline:
                if probe.done() or (not self.engine._paused and self.engine.load().running):
                    return web.Response(status=200)
                await asyncio.wait({probe}, timeout=min(0.2, deadline - loop.time()))
            return web.Response(status=503)
        finally:
            if not probe.done():
                await self.engine.abort(rid)
            await asyncio.gather(probe, return_exceptions=True)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.session_open:
            return _result(False, "update_weights_from_distributed must run between "
                                  "begin_weight_update() and end_weight_update()")
        group = collective.get_group(body["group_name"])
        got = await asyncio.gather(
            asyncio.to_thread(receive_tensors, group, body["dtypes"], body["shapes"]),
            self.tp.receive(body["group_name"], body["names"], body["dtypes"], body["shapes"]))
        version = body.get("weight_version")
        await self.engine.update_weights_from_tensor(
            list(zip(body["names"], got[0])), None if version is None else int(version))
        if body.get("flush_cache", True):
            if not self.idle():
                return _result(False, NOT_FLUSHED)
            await self.engine.flush_cache()
        return _result(True, "Succeeded to update parameter online.")

    async def control(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json() if request.can_read_body else {}
        if path == "/pause_generation":
            mode = body.get("mode", "abort")
            await self.engine.pause_generation(mode)
            self.scheduler_paused = mode != "abort"
        elif path == "/continue_generation":
            await self.engine.continue_generation()
            self.scheduler_paused = False
        elif path == "/abort_request":
            await self.engine.abort(None if body.get("abort_all") else body["rid"])
        elif path == "/flush_cache":
            if not self.idle():
                return web.Response(status=400, text="Cache not flushed because there are "
                                                     "pending requests")
            await self.engine.flush_cache()
        elif path in ("/begin_weight_update", "/end_weight_update"):
            return self._session(path == "/begin_weight_update")
        elif path == "/init_weights_update_group":
            return await self._init_group(body)
        elif path == "/destroy_weights_update_group":
            collective.destroy_group(body["group_name"])
            self.tp.destroy(body["group_name"])
            return _result(True, "group destroyed")
        return web.json_response({"message": "ok", "status": "ok"})

    def _session(self, begin: bool) -> web.Response:
        if begin and self.session_open:
            return _result(False, "a weight-update session is already open; call "
                                  "end_weight_update() first")
        if not begin and not self.session_open:
            return _result(False, "no weight-update session is open; call "
                                  "begin_weight_update() first")
        self.session_open = begin
        return _result(True, "Success")

    async def _init_group(self, body: dict) -> web.Response:
        url = f"tcp://{body['master_address']}:{body['master_port']}"
        try:  # every TP rank joins as rank_offset + tp_rank
            await asyncio.gather(
                asyncio.to_thread(collective.init_custom_process_group, body["backend"], url,
                                  body["world_size"], body["rank_offset"], body["group_name"]),
                self.tp.join(url, body))
        except Exception as exc:  # noqa: BLE001 -- SGLang answers 400 with the message
            return _result(False, f"Failed to initialize custom process group: {exc}.")
        return _result(True, "Succeeded to initialize custom process group.")

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
                self.engine.model.named_parameters()), "tp_ranks": await self.tp.checksums()})
        return web.json_response({"groups": collective.joined_groups()})  # /fake/groups


def _result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message},
                             status=200 if success else 400)


def _meta(body: dict, out, reason: dict, version: int) -> dict:
    spans, start = [], 0
    for i in range(1, len(out.token_versions) + 1):
        if i == len(out.token_versions) or out.token_versions[i] != out.token_versions[start]:
            spans.append({"version": str(out.token_versions[start]), "start": start, "end": i})
            start = i
    return {"id": body["rid"], "finish_reason": reason,
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out.output_ids),
            "output_token_logprobs": [[lp, t, None] for lp, t in
                                      zip(out.output_logprobs, out.output_ids)],
            "weight_version": str(version), "weight_versions": spans,
            "num_retractions": out.refreshes}


def _routed_experts(routed, config: dict) -> str:
    """As SGLang's detokenizer writes them (`_b64_encode_per_request`): base64 of a C-order
    int32 [positions, num_hidden_layers, top_k] array, dense layers left 0."""
    from rl_async.plan.moe import moe_layer_ids
    from rl_async.state.moe_routing import unpack_routed

    ids = unpack_routed(routed)
    full = torch.zeros(ids.shape[0], int(config["num_hidden_layers"]), ids.shape[2],
                       dtype=torch.int32)
    full[:, list(moe_layer_ids(config))] = ids.to(torch.int32)
    return base64.b64encode(full.numpy().tobytes()).decode()


def _tokenizer(model_path: str):
    from rl_async.algo.tasks import TOKENIZER_FILES

    if not any((Path(model_path) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def main() -> None:
    args = parser().parse_args()  # strict, as SGLang's
    torch.set_num_threads(1)
    fake = FakeSGLang(args)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", fake.generate)
    app.router.add_post("/update_weights_from_distributed", fake.update_weights_from_distributed)
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
                 "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
                 "/destroy_weights_update_group"):
        app.router.add_post(path, fake.control)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, fake.health)
    for path in ("/model_info", "/v1/loads", "/fake/weights_checksum", "/fake/groups"):
        app.router.add_get(path, fake.info)
    app.on_shutdown.append(lambda _app: fake.tp.stop())
    web.run_app(app, host=args.host or "127.0.0.1", port=int(args.port), print=None)


if __name__ == "__main__":
    main()
