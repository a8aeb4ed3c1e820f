"""SGLangEngine against a server that follows SGLang 0.5.23's own rules
(tests/fake_sglang_server.py, written from that release's source), launched the way SGLang is
launched: a tiny real model behind SGLang's HTTP API, weights over a real gloo channel from a
real PublicationSender. Each test here fails on the assumption it replaced:

- rollouts must stop at the stop ids and the model's EOS: SGLang checks both only when
  `ignore_eos` is false, so the old default (true) ran every response to max_new_tokens;
  and it checks them before the length cap;
- /health generates a token, which waits while the engine is paused (503 after 20 s): the
  supervisor's probe must not read a paused engine as a dead one;
- a flush requested with the last bucket fails the update (HTTP 400) while requests run,
  but not while a retract pause holds them (0.5.23 ignores the waiting queue then);
- a failed weight update, a second session, an unknown flag: errors, as on the real server;
- a TP2 engine's channel has world 3: every TP rank receives every tensor;
- a server that dies behind a live client is an error on every call, not a hang.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import threading

import pytest
import torch

from fake_sglang_server import finish_reason
from rl_async.engine.base import EngineError, SamplingParams, TransientEngineError
from rl_async.engine.sglang_engine import SGLangEngine, SGLangEngineConfig
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.sender import PublicationSender

PROMPT = [1, 5, 9, 3]


@pytest.fixture(autouse=True)
def server_importable(monkeypatch):
    """The server is `python -m fake_sglang_server`, a child process: it needs tests/ on
    its PYTHONPATH (pytest's own pythonpath setting reaches this process only)."""
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (tests, os.environ.get("PYTHONPATH")) if p))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A saved tiny Llama whose EOS id is the token greedy decoding emits first."""
    model = build_causal_lm(tiny_llama_config(max_position_embeddings=4096), seed=3)
    with torch.no_grad():
        first = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
    path = tmp_path_factory.mktemp("tiny-sglang")
    model.config.eos_token_id = first
    model.save_pretrained(path)
    return str(path), first


def serve(model_dir: str, test, **config) -> None:
    async def main():
        engine = SGLangEngine(SGLangEngineConfig(
            model_path=model_dir, port=0, launch_module="fake_sglang_server",
            startup_timeout_s=120, health_poll_interval_s=0.2, load_poll_interval_s=0,
            **config))
        await engine.start()
        try:
            await test(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_sglangs_finish_rule_gates_the_stop_ids_behind_ignore_eos():
    assert finish_reason([4, 7], 8, False, [7], set()) == {"type": "stop", "matched": 7}
    assert finish_reason([4, 7], 8, True, [7], {7}) is None  # runs on past the stop id
    assert finish_reason([4, 2], 8, False, [], {2}) == {"type": "stop", "matched": 2}
    # update_finish_state: a stop id at the length cap is a stop, not a length finish
    assert finish_reason([4, 7], 2, False, [7], set()) == {"type": "stop", "matched": 7}
    assert finish_reason([4, 5], 2, False, [7], set())["type"] == "length"
    assert finish_reason([4, 7], 2, True, [7], set())["type"] == "length"


def test_a_stop_id_at_the_length_cap_finishes_as_stop(tiny_model):
    model_dir, first = tiny_model

    async def test(engine):
        out = await engine.generate(PROMPT, SamplingParams(
            max_new_tokens=1, temperature=0.0, stop_token_ids=(first,)))
        assert out.output_ids == [first] and out.finish_reason == "stop"

    serve(model_dir, test)


def test_rollouts_stop_at_the_stop_ids_and_at_the_models_eos(tiny_model):
    model_dir, first = tiny_model
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def test(engine):
        by_stop = await engine.generate(PROMPT, SamplingParams(
            max_new_tokens=8, temperature=0.0, stop_token_ids=(first,)))
        assert by_stop.output_ids == [first] and by_stop.finish_reason == "stop"
        by_eos = await engine.generate(PROMPT, greedy)  # no stop ids: the model's own EOS
        assert by_eos.output_ids == [first] and by_eos.finish_reason == "stop"

    serve(model_dir, test)  # the default: what every rollout sends


def test_ignore_eos_runs_every_response_to_its_length(tiny_model):
    """The old default: stop ids and EOS both ignored, as SGLang does."""
    model_dir, first = tiny_model

    async def test(engine):
        out = await engine.generate(PROMPT, SamplingParams(
            max_new_tokens=8, temperature=0.0, stop_token_ids=(first,)))
        assert len(out.output_ids) == 8 and out.finish_reason == "length"

    serve(model_dir, test, ignore_eos=True)


def _publish(engine: SGLangEngine, sender: PublicationSender, name: str, version: int,
             flush: bool):
    """Trainer side in a thread, engine side over HTTP: what FleetPublication does."""
    metas = sender.staged.metas

    async def receive():
        for b, (names, dtypes, shapes, _n) in enumerate(metas):
            last = b == len(metas) - 1
            await engine.update_weights_from_distributed(
                names, dtypes, shapes, name, version if last else None,
                flush_cache=flush if last else False)

    async def both():
        sent = asyncio.ensure_future(asyncio.to_thread(sender.send, [name], "staged", 30))
        await receive()
        return await sent

    return both()


async def _channel(engine: SGLangEngine, sender: PublicationSender, name: str,
                   world: int = 2) -> None:
    port = sender.open_channel(name, 30)
    joined = threading.Thread(target=sender.join_channel, args=(name, world))
    joined.start()
    await engine.init_weights_update_group("127.0.0.1", port, 1, world, name, "gloo")
    await asyncio.to_thread(joined.join)


async def _get(engine: SGLangEngine, path: str):
    return await engine._call("GET", path, timeout_s=30, timeout_key="test")


def test_weights_reach_the_server_over_its_own_channel_and_destroy_frees_it(tiny_model):
    model_dir, _ = tiny_model
    new = build_causal_lm(tiny_llama_config(max_position_embeddings=4096), seed=11)

    async def test(engine):
        sender, name = PublicationSender("gloo"), "pub/engine-0/n0/g1"
        await _channel(engine, sender, name)
        try:
            sender.stage(new.named_parameters(), torch.float32, 1 << 14, flat=False,
                         checksum=True)
            assert len(sender.staged.metas) > 1  # several buckets, per-tensor broadcasts
            nbytes, failed = await _publish(engine, sender, name, 1, flush=True)
            assert failed == {} and nbytes == sender.staged.nbytes
            got = await _get(engine, "/fake/weights_checksum")
            assert got["checksum"] == sender.staged.checksum
            assert await engine.get_weight_version() == 1
            assert (await _get(engine, "/fake/groups"))["groups"] == [name]
            await engine.destroy_weights_update_group(name)
            assert (await _get(engine, "/fake/groups"))["groups"] == []
            assert engine.weight_update_groups() == []
        finally:
            sender.close_channel(name)
        assert sender.channels() == []

    serve(model_dir, test)


@pytest.mark.parametrize("mode", ["retract", "busy"])
def test_a_flush_with_the_last_bucket_needs_an_idle_or_retract_paused_engine(tiny_model, mode):
    """mixed_policy pauses in `retract` mode: 0.5.23 then ignores the waiting queue and the
    flush succeeds (it asserted, and killed the scheduler, before). On an engine with
    requests running (not paused), the weights load but the call fails with HTTP 400."""
    model_dir, first = tiny_model
    new = build_causal_lm(tiny_llama_config(max_position_embeddings=4096), seed=12)

    async def test(engine):
        long = SamplingParams(max_new_tokens=3000, temperature=1.0, seed=1)
        requests = [asyncio.ensure_future(engine.generate(PROMPT, long)) for _ in range(4)]
        while (await engine.refresh_load()).running < 4:
            await asyncio.sleep(0.05)
        if mode == "retract":
            await engine.pause_generation("retract")
            assert (await engine.refresh_load()).waiting == 4  # retracted: waiting, not idle
        sender, name = PublicationSender("gloo"), f"flush-{mode}"
        await _channel(engine, sender, name)
        try:
            sender.stage(new.named_parameters(), torch.float32, 1 << 20, flat=False,
                         checksum=True)
            if mode == "busy":
                with pytest.raises(EngineError, match="HTTP 400: .*cache was not flushed"):
                    await _publish(engine, sender, name, 1, flush=True)
                got = await _get(engine, "/fake/weights_checksum")
                assert got["checksum"] == sender.staged.checksum  # loaded all the same
                await engine.abort(None)
                await asyncio.gather(*requests)
                return
            assert (await _publish(engine, sender, name, 1, flush=True))[1] == {}
            await engine.continue_generation()
            outs = await asyncio.gather(*requests)
            assert all(o.refreshes >= 1 for o in outs)  # retracted, rebuilt under version 1
            assert all(1 in o.token_versions for o in outs)
        finally:
            sender.close_channel(name)

    # ignore_eos: the requests must still be running when the pause comes (no early EOS)
    serve(model_dir, test, generate_timeout_s=60, ignore_eos=True)


def test_a_paused_engines_health_probe_is_not_sglangs_generating_health(tiny_model,
                                                                         monkeypatch):
    """/health_generate on a paused engine waits at the pause gate and answers 503 after
    SGLANG_HEALTH_CHECK_TIMEOUT (20 s in SGLang; 1 s here); the supervisor's probe
    (SGLangEngine.health) must still pass, and /health is liveness on a server rl-async
    launched."""
    model_dir, _ = tiny_model
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")

    async def test(engine):
        await engine.pause_generation("abort")
        with pytest.raises(TransientEngineError, match="GET /health_generate .*HTTP 503"):
            await _get(engine, "/health_generate")
        await engine.health()  # the supervisor's probe: not a dead engine
        assert await _get(engine, "/health") == ""  # launched with generation off: 200
        await engine.continue_generation()
        assert await _get(engine, "/health_generate") == ""

    serve(model_dir, test, read_retries=0)


def test_failed_updates_and_sessions_are_http_400(tiny_model):
    model_dir, _ = tiny_model

    async def test(engine):
        with pytest.raises(EngineError, match="HTTP 400: .*between begin_weight_update"):
            await engine._call("POST", "/update_weights_from_distributed", {
                "names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
                timeout_s=30, timeout_key="test")
        await engine.begin_weight_update()
        with pytest.raises(EngineError, match="HTTP 400: .*already open"):
            await engine._call("POST", "/begin_weight_update", {}, timeout_s=30,
                               timeout_key="test")
        await engine.end_weight_update()
        with pytest.raises(EngineError, match="HTTP 400: .*no weight-update session"):
            await engine._call("POST", "/end_weight_update", {}, timeout_s=30,
                               timeout_key="test")

    serve(model_dir, test)


def test_an_unknown_launch_flag_fails_the_launch_as_sglangs_strict_parser_does(tiny_model,
                                                                               tmp_path):
    model_dir, _ = tiny_model

    async def main():
        engine = SGLangEngine(SGLangEngineConfig(
            model_path=model_dir, port=0, launch_module="fake_sglang_server",
            startup_timeout_s=120, health_poll_interval_s=0.2, load_poll_interval_s=0,
            log_path=str(tmp_path / "server.log"),
            server_args={"enable_metricz": True}))  # a typo of enable_metrics
        with pytest.raises(EngineError) as info:
            await engine.start()
        return str(info.value)

    text = asyncio.run(main())
    assert "exited with code 2" in text and "unrecognized arguments: --enable-metricz" in text


def test_a_tp2_engines_channel_has_world_three_and_every_rank_receives(tiny_model):
    model_dir, _ = tiny_model
    new = build_causal_lm(tiny_llama_config(max_position_embeddings=4096), seed=13)

    async def test(engine):
        sender, name = PublicationSender("gloo"), "pub/engine-0/n0/g-tp2"
        await _channel(engine, sender, name, world=3)
        try:
            sender.stage(new.named_parameters(), torch.float32, 1 << 14, flat=False,
                         checksum=True)
            assert (await _publish(engine, sender, name, 1, flush=True))[1] == {}
            got = await _get(engine, "/fake/weights_checksum")
            assert got == {"checksum": sender.staged.checksum,
                           "tp_ranks": [sender.staged.checksum]}
        finally:
            sender.close_channel(name)

    serve(model_dir, test, gpus_per_engine=2)


def test_a_dead_server_behind_a_live_client_fails_every_call(tiny_model):
    model_dir, _ = tiny_model

    async def test(engine):
        await engine.health()
        os.killpg(engine._process.pid, signal.SIGKILL)
        await asyncio.to_thread(engine._process.wait)
        with pytest.raises(EngineError, match="exited with code"):
            await engine.health()
        with pytest.raises(TransientEngineError):
            await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
        with pytest.raises(EngineError):
            await engine.pause_generation("abort")

    serve(model_dir, test, retry_backoff_s=0.0)
