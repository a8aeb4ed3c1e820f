"""SGLangEngine against recorded SGLang 0.5.23 replies (tests/unit/fixtures/sglang_0_5_23:
successes, aborts, errors), replayed by the loopback fake of test_sglang_engine, and the
engine's background load polling."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.engine.base import EngineError, InvalidRequestError, SamplingParams
from test_sglang_engine import load_fixture, run_with_server

PARAMS = SamplingParams(max_new_tokens=4)


def test_replayed_finished_requests_parse_to_tokens_logprobs_and_versions():
    async def test(engine, fake):
        fake.replay("/generate", "generate_stop", "generate_length")
        out = await engine.generate([1, 2, 3, 4, 5], PARAMS, request_id="rid-stop")
        assert out.output_ids == [19, 20, 2] and out.finish_reason == "stop"
        assert out.output_logprobs == [-0.105, -1.25, -0.0031]
        assert out.token_versions == [2, 3, 3]  # spans: one token under v2, then v3
        assert out.refreshes == 1 and out.prompt_len == 5
        out = await engine.generate([1, 2, 3], PARAMS, request_id="rid-length")
        assert out.finish_reason == "length" and out.token_versions == [5] * 4

    run_with_server(test)


def test_replayed_aborts_keep_the_partial_response_or_none():
    async def test(engine, fake):
        fake.replay("/generate", "generate_aborted_midway", "generate_aborted_before_prefill")
        out = await engine.generate([1, 2, 3], PARAMS, request_id="rid-abort")
        assert out.finish_reason == "abort"
        assert out.output_ids == [7, 8] and out.output_logprobs == [-2.5, -0.75]
        out = await engine.generate([1, 2, 3], PARAMS, request_id="rid-abort0")
        assert out.finish_reason == "abort" and out.output_ids == [] and out.token_versions == []

    run_with_server(test)


def test_replayed_errors_name_the_endpoint_and_sglangs_message():
    async def test(engine, fake):
        fake.replay("/generate", "generate_bad_request")
        with pytest.raises(InvalidRequestError, match=r"POST /generate on .*: HTTP 400: .*longer "
                                                      r"than the model's context length"):
            await engine.generate([1, 2, 3], PARAMS)
        fake.replay("/flush_cache", "flush_cache_busy")
        with pytest.raises(EngineError, match="POST /flush_cache .*HTTP 400: Cache flushed"):
            await engine.flush_cache()
        assert len(fake.calls("/flush_cache")) == 1  # a 4xx is final: never retried
        fake.replay("/update_weights_from_distributed", "update_weights_failed")
        with pytest.raises(EngineError, match="HTTP 400: .*shape mismatch for model.layers.0"):
            await engine.update_weights_from_distributed(["w"], ["float32"], [[2]], "g", 1)

    run_with_server(test)


def test_replayed_unavailable_server_retries_reads_only():
    async def test(engine, fake):
        fake.replay("/model_info", "service_unavailable", "model_info")
        assert await engine.get_weight_version() == 5  # one 503, then the reply
        assert len(fake.calls("/model_info")) == 3  # start-up's read + the 503 + its retry
        fake.replay("/generate", "service_unavailable")
        with pytest.raises(EngineError, match=r"HTTP 503: Service Unavailable \(attempt 1 of 1\)"):
            await engine.generate([1, 2, 3], PARAMS)
        assert len(fake.calls("/generate")) == 1

    run_with_server(test)


def test_loads_are_polled_while_running_one_at_a_time_and_stop_at_shutdown():
    async def wait_for(condition):
        while not condition():
            await asyncio.sleep(0.01)

    async def test(engine, fake):
        fake.replay("/v1/loads", "loads_two_dp_ranks")
        fake.delay_s = 0.02  # each poll takes a while: a second must not start meanwhile
        await wait_for(lambda: engine.load().extra["load_polls"] >= 3)
        load = engine.load()
        assert (load.running, load.waiting, load.tokens_in_use, load.token_capacity,
                load.max_running_requests) == (7, 1, 1500, 131072, 96)
        assert fake.max_in_flight["/v1/loads"] == 1
        # A failing server: polls go on, each failure counted with its cause, load kept.
        fake.replay("/v1/loads", "service_unavailable")
        await wait_for(lambda: engine.load().extra["load_poll_errors"] >= 2)
        assert "GET /v1/loads" in engine.load().extra["load_error"]
        assert "HTTP 503" in engine.load().extra["load_error"]
        assert engine.load().running == 7
        fake.replay("/v1/loads", "loads_two_dp_ranks")
        await wait_for(lambda: engine.load().extra["load_error"] == "")
        poller = engine._poller
        await engine.shutdown()
        assert poller.done() and engine._poller is None
        polls = len(fake.calls("/v1/loads"))
        await asyncio.sleep(0.05)
        assert len(fake.calls("/v1/loads")) == polls

    run_with_server(test, load_poll_interval_s=0.01)


def test_fixtures_are_well_formed():
    for name in ("generate_stop", "generate_length", "generate_aborted_midway",
                 "generate_aborted_before_prefill", "model_info", "loads_two_dp_ranks",
                 "update_weights_ok"):
        status, body = load_fixture(name)
        assert status == 200 and isinstance(body, dict), name
