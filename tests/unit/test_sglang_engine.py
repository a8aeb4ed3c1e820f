"""SGLangEngine client logic, without SGLang: a local aiohttp server on 127.0.0.1 plays
SGLang 0.5.23's HTTP API (endpoints and reply shapes as in its http_server.py), so payload
building, reply parsing, error mapping, retries and the weight-update session are tested.
The real server is exercised by tests/gpu/test_sglang_gpu.py."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import sys
from pathlib import Path

import pytest
from aiohttp import web

from rl_async.engine.base import EngineError, InvalidRequestError, SamplingParams
from rl_async.engine.sglang_args import (
    SGLANG_VERSION,
    SGLangEngineConfig,
    build_launch_command,
    build_launch_env,
    die_with_parent_command,
)
from rl_async.engine.sglang_engine import SGLangEngine


FIXTURES = Path(__file__).parent / "fixtures" / "sglang_0_5_23"


def load_fixture(name: str) -> tuple[int, object]:
    """(status, JSON body or text) of a recorded reply (see FIXTURES/README.md)."""
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    return data["status"], data["json"] if "json" in data else data["text"]


def _gen_reply(body: dict, logprobs=None, spans=None, finish=None, version="0") -> dict:
    n = body["sampling_params"]["max_new_tokens"]
    ids = [(body["input_ids"][-1] + i + 1) % 50 for i in range(n)]
    lps = logprobs if logprobs is not None else [[-0.5 - i, t, None] for i, t in enumerate(ids)]
    meta = {"id": body["rid"], "finish_reason": finish or {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": n,
            "output_token_logprobs": lps, "weight_version": version, "num_retractions": 0}
    if spans is not False:
        meta["weight_versions"] = spans or [{"version": version, "start": 0, "end": n}]
    return {"text": "", "output_ids": ids, "meta_info": meta}


class FakeSGLang:
    """Records every request; `replies[path]` overrides the default reply for a path with a
    callable (body) -> (status, json-or-text) or a list of such, consumed in order."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict, object]] = []
        self.replies: dict[str, object] = {}
        self.version = "0"
        self.delay_s = 0.0
        self.in_flight: dict[str, int] = {}       # path -> requests being handled now
        self.max_in_flight: dict[str, int] = {}   # path -> the most at once

    def calls(self, path: str) -> list:
        return [body for _, p, _, body in self.requests if p == path]

    def replay(self, path: str, *fixtures: str) -> None:
        """Answer `path` with recorded SGLang 0.5.23 replies (FIXTURES/<name>.json), in
        order; the last one repeats."""
        self.replies[path] = [(lambda body, f=load_fixture(name): f) for name in fixtures]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        path = request.path
        self.requests.append((request.method, path, dict(request.query), body))
        self.in_flight[path] = self.in_flight.get(path, 0) + 1
        self.max_in_flight[path] = max(self.max_in_flight.get(path, 0), self.in_flight[path])
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            reply = self.replies.get(path)
            if isinstance(reply, list):
                reply = reply.pop(0) if len(reply) > 1 else reply[0]
            status, out = reply(body) if reply else self.default(path, body)
        finally:
            self.in_flight[path] -= 1
        if isinstance(out, (dict, list)):
            return web.json_response(out, status=status)
        return web.Response(text=out, status=status)

    def default(self, path: str, body):
        if path == "/generate":
            return 200, _gen_reply(body, version=self.version)
        if path == "/model_info":
            return 200, {"model_path": "tiny", "weight_version": self.version}
        if path == "/v1/loads":
            core = {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2,
                    "num_used_tokens": 100, "max_total_num_tokens": 4096,
                    "max_running_requests": 8, "token_usage": 0.02}
            return 200, {"version": SGLANG_VERSION, "loads": [core, dict(core, dp_rank=1)]}
        if path in ("/update_weights_from_distributed", "/update_weights_from_tensor"):
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return 200, {"success": True, "message": "ok"}
        if path.endswith(("weight_update", "_group")):
            return 200, {"success": True, "message": "ok"}
        if path in ("/pause_generation", "/continue_generation"):
            return 200, {"message": "done", "status": "ok"}
        return 200, ""  # /health_generate, /abort_request, /flush_cache


def run_with_server(test, **config_kw):
    """Start the fake server, attach an engine to it, run `test(engine, fake)`."""

    async def main():
        fake = FakeSGLang()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", fake.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        config_kw.setdefault("load_poll_interval_s", 0)  # tests that poll ask for it
        config = SGLangEngineConfig(url=f"http://127.0.0.1:{port}", retry_backoff_s=0.0,
                                    health_poll_interval_s=0.01, **config_kw)
        engine = SGLangEngine(config)
        try:
            await engine.start()
            await test(engine, fake)
        finally:
            await engine.shutdown()
            await runner.cleanup()

    asyncio.run(main())


def test_generate_payload_and_parsed_output():
    async def test(engine, fake):
        params = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20,
                                stop_token_ids=(2, 7), seed=11)
        out = await engine.generate([5, 6, 7], params, request_id="r1")
        body = fake.calls("/generate")[0]
        assert body == {
            "rid": "r1", "input_ids": [5, 6, 7], "return_logprob": True,
            "logprob_start_len": -1, "stream": False,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                "top_k": 20, "ignore_eos": False, "stop_token_ids": [2, 7],
                                "sampling_seed": 11},
        }
        assert out.request_id == "r1" and out.output_ids == [8, 9, 10, 11]
        assert out.output_logprobs == [-0.5, -1.5, -2.5, -3.5]
        assert out.token_versions == [0, 0, 0, 0]
        assert out.finish_reason == "length" and out.prompt_len == 3

    run_with_server(test)


def test_per_token_versions_from_spans_and_finish_reasons():
    async def test(engine, fake):
        spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
        fake.replies["/generate"] = [
            lambda b: (200, _gen_reply(b, spans=spans, finish={"type": "stop", "matched": 9})),
            lambda b: (200, _gen_reply(b, finish={"type": "abort", "message": "Aborted"})),
        ]
        out = await engine.generate([1], SamplingParams(max_new_tokens=3))
        assert out.token_versions == [3, 4, 4] and out.finish_reason == "stop"
        out = await engine.generate([1], SamplingParams(max_new_tokens=3))
        assert out.finish_reason == "abort"

    run_with_server(test)


def test_without_spans_versions_are_the_older_of_start_and_end():
    async def test(engine, fake):
        assert await engine.get_weight_version() == 2
        fake.replies["/generate"] = lambda b: (200, _gen_reply(b, spans=False, version="3"))
        out = await engine.generate([1], SamplingParams(max_new_tokens=2))
        assert out.token_versions == [2, 2]

    def start_at_2(engine_test):
        async def wrapped(engine, fake):
            fake.version = "2"
            await engine_test(engine, fake)
        return wrapped

    run_with_server(start_at_2(test))


@pytest.mark.parametrize("mutate, needle", [
    (lambda r: r.pop("meta_info"), "no `meta_info` field"),
    (lambda r: r.pop("output_ids"), "no `output_ids` field"),
    (lambda r: r["meta_info"].pop("output_token_logprobs"), "output_token_logprobs"),
    (lambda r: r["meta_info"]["output_token_logprobs"].pop(), "has 1 entries for 2 output"),
    (lambda r: r["meta_info"]["output_token_logprobs"][0].__setitem__(1, 999), "[0]"),
    (lambda r: r["meta_info"].__setitem__("finish_reason", None), "finish_reason"),
    (lambda r: r["meta_info"]["weight_versions"][0].__setitem__("end", 1), "covers 1 tokens"),
    (lambda r: r["meta_info"]["weight_versions"][0].__setitem__("version", "default"),
     "not an integer policy version"),
])
def test_malformed_generate_replies_raise_engine_error(mutate, needle):
    async def test(engine, fake):
        def reply(body):
            out = _gen_reply(body)
            mutate(out)
            return 200, out
        fake.replies["/generate"] = reply
        with pytest.raises(EngineError) as info:
            await engine.generate([1], SamplingParams(max_new_tokens=2), request_id="bad")
        assert needle in str(info.value) and "bad" in str(info.value)
        assert not isinstance(info.value, KeyError)
        assert engine.load().extra["in_flight"] == 0

    run_with_server(test)


def test_bad_input_is_rejected_before_sending_and_400_is_invalid_request():
    async def test(engine, fake):
        with pytest.raises(InvalidRequestError, match="input_ids is empty"):
            await engine.generate([], SamplingParams())
        with pytest.raises(InvalidRequestError, match="top_p"):
            await engine.generate([1], SamplingParams(top_p=0.0))
        assert fake.calls("/generate") == []
        fake.replies["/generate"] = [
            lambda b: (400, {"error": {"message": "input is longer than the context"}}),
            lambda b: (200, _gen_reply(b)),
        ]
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate([1] * 10, SamplingParams(max_new_tokens=2))
        text = str(info.value)
        assert "POST /generate" in text and "HTTP 400" in text and "longer than" in text
        assert len(fake.calls("/generate")) == 1  # a 400 is final: never retried
        out = await engine.generate([1], SamplingParams(max_new_tokens=2))
        assert len(out.output_ids) == 2  # and the engine keeps serving

    run_with_server(test)


def test_state_changing_calls_are_not_retried_but_reads_are_bounded():
    async def test(engine, fake):
        fake.replies["/pause_generation"] = lambda b: (503, "busy")
        with pytest.raises(EngineError, match=r"POST /pause_generation.*HTTP 503.*attempt 1 of 1"):
            await engine.pause_generation("retract")
        assert len(fake.calls("/pause_generation")) == 1
        fake.replies["/model_info"] = [lambda b: (503, "x"), lambda b: (503, "x"),
                                       lambda b: (200, {"weight_version": "5"})]
        assert await engine.get_weight_version() == 5  # 2 retries allowed
        fake.replies["/model_info"] = [lambda b: (500, "down")]
        before = len(fake.calls("/model_info"))
        with pytest.raises(EngineError, match=r"GET /model_info.*HTTP 500: down.*attempt 3 of 3"):
            await engine.get_weight_version()
        assert len(fake.calls("/model_info")) - before == 3

    run_with_server(test, read_retries=2)


def test_timeouts_name_the_setting():
    async def test(engine, fake):
        fake.delay_s = 1.0
        with pytest.raises(EngineError, match="control_timeout_s = 0.2 s"):
            await engine.continue_generation()

    run_with_server(test, control_timeout_s=0.2)


def test_abort_pause_continue_flush_payloads():
    async def test(engine, fake):
        assert await engine.abort("gone") == 0
        assert await engine.abort() == 0
        assert fake.calls("/abort_request") == [{"rid": "gone", "abort_all": False},
                                                {"rid": "", "abort_all": True}]
        for mode in ("abort", "retract", "in_place"):
            await engine.pause_generation(mode)
        assert fake.calls("/pause_generation") == [{"mode": m} for m in
                                                   ("abort", "retract", "in_place")]
        with pytest.raises(InvalidRequestError, match="mode = 'freeze'"):
            await engine.pause_generation("freeze")
        await engine.continue_generation()
        assert fake.calls("/continue_generation") == [{}]
        await engine.flush_cache()
        flush = [q for _, p, q, _ in fake.requests if p == "/flush_cache"]
        assert flush == [{"timeout": "1.5"}]
        fake.replies["/flush_cache"] = lambda b: (400, "Flush cache failed.\n")
        with pytest.raises(EngineError, match=r"POST /flush_cache.*HTTP 400.*Flush cache failed"):
            await engine.flush_cache()

    run_with_server(test, flush_timeout_s=1.5)


def test_abort_counts_this_clients_open_requests():
    async def test(engine, fake):
        fake.delay_s = 0.3
        tasks = [asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1),
                                                     request_id=f"r{i}")) for i in range(3)]
        await asyncio.sleep(0.1)
        assert engine.load().extra["in_flight"] == 3
        fake.delay_s = 0.0
        assert await engine.abort("r1") == 1
        assert await engine.abort() == 3
        await asyncio.gather(*tasks)
        assert engine.load().extra["in_flight"] == 0

    run_with_server(test)


def test_distributed_publication_opens_and_closes_the_session():
    async def test(engine, fake):
        await engine.init_weights_update_group("10.0.0.1", 29500, 1, 3, "pub", "nccl")
        assert fake.calls("/init_weights_update_group") == [{
            "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 3, "group_name": "pub", "backend": "nccl"}]
        await engine.update_weights_from_distributed(["a"], ["torch.bfloat16"], [[2, 3]], "pub")
        await engine.update_weights_from_distributed(["b", "c"], ["float32", "bfloat16"],
                                                     [[4], [1, 1]], "pub", weight_version=5,
                                                     load_format="flattened_bucket")
        paths = [p for _, p, _, _ in fake.requests if "weight" in p]
        assert paths == ["/init_weights_update_group", "/begin_weight_update",
                         "/update_weights_from_distributed", "/update_weights_from_distributed",
                         "/end_weight_update"]
        first, last = fake.calls("/update_weights_from_distributed")
        assert first == {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                         "group_name": "pub", "flush_cache": False, "abort_all_requests": False}
        assert last["weight_version"] == "5" and last["flush_cache"] is True
        assert last["load_format"] == "flattened_bucket"
        assert await engine.get_weight_version() == 5
        out = await engine.generate([1], SamplingParams(max_new_tokens=1))
        assert out.token_versions == [5]

    run_with_server(test)


def test_failed_update_raises_and_continue_closes_an_open_session():
    async def test(engine, fake):
        fake.replies["/update_weights_from_distributed"] = lambda b: (
            400, {"success": False, "message": "Weights were updated, but the cache was not "
                                               "flushed because requests are still running"})
        with pytest.raises(EngineError, match="HTTP 400.*still running"):
            await engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g", 1)
        fake.replies["/update_weights_from_distributed"] = lambda b: (
            200, {"success": False, "message": "shape mismatch"})
        with pytest.raises(EngineError, match="reported failure: shape mismatch"):
            await engine.update_weights_from_distributed(["a"], ["float32"], [[1]], "g")
        with pytest.raises(InvalidRequestError, match="lengths 2/1/1"):
            await engine.update_weights_from_distributed(["a", "b"], ["float32"], [[1]], "g")
        with pytest.raises(InvalidRequestError, match="weight dtype 'complex7'"):
            await engine.update_weights_from_distributed(["a"], ["complex7"], [[1]], "g")
        await engine.continue_generation()
        paths = [p for _, p, _, _ in fake.requests if p in (
            "/begin_weight_update", "/end_weight_update", "/continue_generation")]
        assert paths == ["/begin_weight_update", "/end_weight_update", "/continue_generation"]
        assert engine._weight_version == 0  # a failed update never advances the version

    run_with_server(test)


def test_update_weights_from_tensor_sends_base64_per_rank_payloads():
    import torch

    async def test(engine, fake):
        await engine.update_weights_from_tensor([b"rank0", b"rank1"], weight_version=2,
                                                load_format="flattened_bucket")
        body = fake.calls("/update_weights_from_tensor")[0]
        assert [base64.b64decode(s) for s in body["serialized_named_tensors"]] == [b"rank0",
                                                                                  b"rank1"]
        assert body["weight_version"] == "2" and body["flush_cache"] is True
        named = [("w", torch.arange(4, dtype=torch.float32))]
        await engine.update_weights_from_tensor(named)
        body = fake.calls("/update_weights_from_tensor")[1]
        assert len(body["serialized_named_tensors"]) == 2  # one per TP rank
        assert "weight_version" not in body and body["flush_cache"] is False

    run_with_server(test, gpus_per_engine=2)


def test_load_sums_dp_ranks():
    async def test(engine, fake):
        load = await engine.refresh_load()
        assert (load.running, load.waiting, load.tokens_in_use, load.token_capacity,
                load.max_running_requests) == (6, 4, 200, 8192, 16)
        assert [q for _, p, q, _ in fake.requests if p == "/v1/loads"] == [{"include": "core"}]
        fake.replies["/v1/loads"] = lambda b: (200, {"loads": [{"num_running_reqs": 1}]})
        with pytest.raises(EngineError, match="no `num_waiting_reqs` field"):
            await engine.refresh_load()

    run_with_server(test)


def test_launch_command_and_env():
    config = SGLangEngineConfig(model_path="/ckpt", gpu_ids=(2, 3), gpus_per_engine=2,
                                mem_fraction_static=0.7, max_running_requests=64,
                                initial_weight_version=4, speculative_algorithm="NGRAM",
                                disaggregation_mode="decode",
                                server_args={"dtype": "bfloat16", "disable-radix-cache": True,
                                             "enable_metrics": False, "cuda_graph_bs": [1, 2]})
    cmd = build_launch_command(config, 31000)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", "/ckpt", "--tp-size", "2", "--host", "127.0.0.1",
                       "--port", "31000", "--weight-version", "4",
                       "--mem-fraction-static", "0.7", "--max-running-requests", "64",
                       "--speculative-algorithm", "NGRAM", "--disaggregation-mode", "decode",
                       "--dtype", "bfloat16", "--disable-radix-cache",
                       "--cuda-graph-bs", "1", "2"]
    # The defaults add neither flag (SGLang's own defaults: no speculation, "null").
    plain = build_launch_command(SGLangEngineConfig(model_path="/ckpt"), 31000)
    assert "--speculative-algorithm" not in plain and "--disaggregation-mode" not in plain
    env = build_launch_env(config, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PATH"] == "/bin"
    # /health is liveness, not a generated token that waits while the engine is paused
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    venv = build_launch_command(SGLangEngineConfig(model_path="/ckpt",
                                                   python_executable="/opt/sgl/bin/python"), 1)
    assert venv[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]


def test_the_server_dies_with_its_engine_process_without_a_preexec_fn(monkeypatch):
    """The launched command sets its own parent-death signal, then execs the server: no
    preexec_fn runs Python between fork and exec in the (threaded) engine actor."""
    import os
    import subprocess

    probe = [sys.executable, "-c", "import ctypes, signal; v = ctypes.c_int(); "
             "ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(v)); print(v.value)"]
    out = subprocess.run(die_with_parent_command(probe, os.getpid()), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(int(signal.SIGKILL))
    gone = subprocess.run(die_with_parent_command(probe, 1), capture_output=True, text=True,
                          timeout=60)  # its parent is not pid 1: the launcher is gone
    assert gone.returncode == 1 and "is gone" in gone.stderr
    seen = {}

    class Popen:
        def __init__(self, cmd, **kw):
            seen.update(cmd=cmd, **kw)
            raise RuntimeError("stop here")

    monkeypatch.setattr(subprocess, "Popen", Popen)
    engine = SGLangEngine(SGLangEngineConfig(model_path="/ckpt", port=31000))
    with pytest.raises(RuntimeError, match="stop here"):
        engine._launch()
    assert "preexec_fn" not in seen and seen["start_new_session"] is True
    assert seen["cmd"][1] == "-c" and seen["cmd"][3] == str(os.getpid())
    assert seen["cmd"][4:7] == [sys.executable, "-m", "sglang.launch_server"]


@pytest.mark.parametrize("kw, needle", [
    ({}, "set `model_path`"),
    ({"model_path": "m", "gpu_ids": (0,), "gpus_per_engine": 2}, "exactly one id per TP rank"),
    ({"model_path": "m", "server_args": {"tp-size": 2}}, "server_args.tp-size"),
    ({"model_path": "m", "startup_timeout_s": 0}, "startup_timeout_s = 0"),
    ({"model_path": "m", "server_args": {"speculative-algorithm": "EAGLE"}},
     "use the engine setting `speculative_algorithm"),
    ({"model_path": "m", "disaggregation_mode": "both"}, "disaggregation_mode = 'both'"),
])
def test_config_errors_name_the_key(kw, needle):
    with pytest.raises(ValueError) as info:
        SGLangEngineConfig(**kw)
    assert needle in str(info.value)


def test_launch_failure_reports_exit_code_and_log_tail(tmp_path):
    config = SGLangEngineConfig(model_path="/nonexistent", port=0, startup_timeout_s=60,
                                health_poll_interval_s=0.05,
                                launch_module="rl_async_no_such_sglang_module",
                                log_path=str(tmp_path / "server.log"))

    async def main():
        engine = SGLangEngine(config)
        with pytest.raises(EngineError) as info:
            await engine.start()
        return str(info.value)

    text = asyncio.run(main())
    assert "exited with code 1" in text and "No module named" in text
    assert str(tmp_path / "server.log") in text
