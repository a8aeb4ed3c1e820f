"""Embedded engine: exactness against a full forward, limits, abort, bad input, failures."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_async.engine import embedded as embedded_mod
from rl_async.engine.base import EngineError, InvalidRequestError, SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state.models import build_causal_lm, tiny_llama_config

torch.set_num_threads(1)

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3], [7],
           [4, 4, 4, 4, 4, 4]]


def make_engine(**overrides) -> EmbeddedEngine:
    kwargs = {"hf_config": tiny_llama_config(), "max_running_requests": 4, "init_seed": 0}
    kwargs.update(overrides)
    return EmbeddedEngine(EmbeddedEngineConfig(**kwargs))


def full_logits(model, prompt, output) -> torch.Tensor:
    """Logits predicting each output token, from ONE forward over prompt + output."""
    with torch.no_grad():
        ids = torch.tensor([prompt + output], device=next(model.parameters()).device)
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_equals_stepwise_argmax_of_full_forward(model_type):
    engine = make_engine(hf_config=tiny_llama_config(model_type=model_type))

    async def run():
        params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0)
                  for i in range(len(PROMPTS))]
        outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(PROMPTS, params)))
        await engine.close()
        return outs

    for prompt, out in zip(PROMPTS, asyncio.run(run())):
        # Step-by-step greedy with a full forward each step (no cache at all).
        seq = list(prompt)
        for _ in out.output_ids:
            with torch.no_grad():
                seq.append(int(engine.model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.output_ids == seq[len(prompt):]
        assert out.finish_reason == "length"
        assert out.token_versions == [0] * len(out.output_ids)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_logprobs_equal_full_forward(temperature):
    engine = make_engine()

    async def run():
        outs = await asyncio.gather(*(
            engine.generate(p, SamplingParams(max_new_tokens=6 + 2 * i, temperature=temperature,
                                              seed=i))
            for i, p in enumerate(PROMPTS)))
        await engine.close()
        return outs

    for prompt, out in zip(PROMPTS, asyncio.run(run())):
        logp = torch.log_softmax(full_logits(engine.model, prompt, out.output_ids) / temperature,
                                 dim=-1)
        expected = logp.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=1e-4)


def test_seeded_request_is_independent_of_batch_mates():
    async def run(with_mates: bool):
        engine = make_engine()
        target = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=12, seed=42))
        mates = ([engine.generate(p, SamplingParams(max_new_tokens=9)) for p in PROMPTS]
                 if with_mates else [])
        outs = await asyncio.gather(target, *mates)
        await engine.close()
        return outs[0].output_ids

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_stop_token_ends_request_and_is_included():
    engine = make_engine()

    async def run():
        first = await engine.generate([1, 2], SamplingParams(max_new_tokens=8, temperature=0))
        stop = first.output_ids[2]
        out = await engine.generate([1, 2], SamplingParams(max_new_tokens=8, temperature=0,
                                                           stop_token_ids=(stop,)))
        await engine.close()
        return first, out, stop

    first, out, stop = asyncio.run(run())
    cut = first.output_ids.index(stop) + 1
    assert out.output_ids == first.output_ids[:cut]
    assert out.finish_reason == "stop"


def test_never_more_than_max_running_and_token_budget(monkeypatch):
    engine = make_engine(max_running_requests=3, max_total_tokens=40)
    seen = []
    real_decode = embedded_mod.decode

    def spy(model, batch, fast=None):
        seen.append((len(batch.requests), sum(r.reserved_tokens for r in batch.requests)))
        return real_decode(model, batch, fast)

    monkeypatch.setattr(embedded_mod, "decode", spy)

    async def run():
        outs = await asyncio.gather(*(
            engine.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=3 + (i % 5) * 2))
            for i in range(12)))
        await engine.close()
        return outs

    outs = asyncio.run(run())
    assert all(o.finish_reason == "length" for o in outs)
    assert max(n for n, _ in seen) == 3  # continuous batching did fill the slots
    assert max(tokens for _, tokens in seen) <= 40


def test_abort_returns_partial_tokens_and_frees_the_slot():
    engine = make_engine(max_running_requests=1)

    async def run():
        long = asyncio.ensure_future(engine.generate(
            [1, 2], SamplingParams(max_new_tokens=200), request_id="long"))
        queued = asyncio.ensure_future(engine.generate([1, 3], SamplingParams(max_new_tokens=5)))
        while engine.load().running == 0 or not engine._batch.requests[0].output_ids:
            await asyncio.sleep(0.001)
        assert engine.load().waiting == 1
        assert await engine.abort("long") == 1
        assert await engine.abort("no-such-request") == 0
        out_long, out_queued = await asyncio.gather(long, queued)
        await engine.close()
        return out_long, out_queued

    out_long, out_queued = asyncio.run(run())
    assert out_long.finish_reason == "abort"
    assert 1 <= len(out_long.output_ids) < 200
    assert len(out_long.token_versions) == len(out_long.output_ids)
    assert out_queued.finish_reason == "length" and len(out_queued.output_ids) == 5


@pytest.mark.parametrize("input_ids, params, field", [
    ([], SamplingParams(), "input_ids"),
    (list(range(1, 30)) * 10, SamplingParams(), "max_prompt_len"),
    ([1, 2, 99], SamplingParams(), "input_ids"),
    ([1, 2, -1], SamplingParams(), "input_ids"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=0), "top_k"),
    ([1, 2], SamplingParams(max_new_tokens=1000), "max_new_tokens"),
    ([1, 2], SamplingParams(stop_token_ids=(500,)), "stop_token_ids"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(input_ids, params, field):
    engine = make_engine()

    async def run():
        good = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_new_tokens=6)))
        with pytest.raises(InvalidRequestError, match=field):
            await engine.generate(input_ids, params)
        out = await good
        await engine.close()
        return out

    assert len(asyncio.run(run()).output_ids) == 6


def test_step_failure_fails_affected_requests_then_engine_recovers(monkeypatch):
    engine = make_engine()
    calls = {"n": 0}
    real_decode = embedded_mod.decode

    def flaky(model, batch, fast=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_decode(model, batch, fast)

    monkeypatch.setattr(embedded_mod, "decode", flaky)

    async def run():
        results = await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_new_tokens=10)) for p in PROMPTS[:3]),
            return_exceptions=True)
        after = await engine.generate([1, 2], SamplingParams(max_new_tokens=4))
        await engine.close()
        return results, after

    results, after = asyncio.run(run())
    assert all(isinstance(r, EngineError) and "simulated kernel failure" in str(r)
               for r in results)
    assert len(after.output_ids) == 4 and engine.load().extra["failed"] == 3


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="max_running_requests"):
        EmbeddedEngineConfig(hf_config=tiny_llama_config(), max_running_requests=0)
    with pytest.raises(ValueError, match="exactly one"):
        EmbeddedEngineConfig()


def test_build_is_deterministic_and_loads_from_a_local_checkpoint(tmp_path):
    a = build_causal_lm(tiny_llama_config(), seed=3)
    torch.manual_seed(1234)  # the caller's RNG state must not matter
    b = build_causal_lm(tiny_llama_config(), seed=3)
    c = build_causal_lm(tiny_llama_config(), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    a.save_pretrained(tmp_path)
    engine = make_engine(hf_config=None, path=str(tmp_path))
    loaded = engine.model.state_dict()
    assert all(torch.equal(sa[k], loaded[k]) for k in sa)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_full_forward():
    engine = make_engine(device="cuda")

    async def run():
        outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=8, seed=i))
                                      for i, p in enumerate(PROMPTS)))
        await engine.close()
        return outs

    for prompt, out in zip(PROMPTS, asyncio.run(run())):
        logp = torch.log_softmax(full_logits(engine.model, prompt, out.output_ids), dim=-1)
        expected = logp.gather(1, torch.tensor(out.output_ids, device="cuda")[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.output_logprobs), expected.cpu(), atol=1e-4)


def test_steps_feed_the_decode_curve():
    """Every step is timed against the requests in it (rl_async.engine.timing.StepCurve)."""
    engine = make_engine(max_running_requests=4)

    async def run():
        params = [SamplingParams(max_new_tokens=2 + 4 * i, temperature=0.0) for i in range(4)]
        outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(PROMPTS, params)))
        await engine.close()
        return outs

    outs = asyncio.run(run())
    # each answer carries its time inside the engine (the caller's latency minus it: transit)
    assert all(o.engine_seconds > 0 for o in outs)
    curve = engine.step_curve
    assert curve.n == engine.stats["steps"] > 0
    assert curve.lo == 1 and curve.hi == 4  # 4 together, then the longest alone
    assert curve.sy > 0
    # each request's time inside the engine; the longest one spans every step
    assert engine.latency.count == 4 and engine.latency.seconds / 4 > 0
    assert engine.latency.metrics("engine/0")["engine/0/requests"] == 4


def test_a_groups_shared_prompt_is_prefilled_once_and_samples_stay_independent():
    """n samples of one prompt admitted together run ONE prefill row (kv_batch.prefill), and
    each sample's log-probs still equal a full forward over its own tokens."""
    from rl_async.state.models import cache_kwarg

    engine = make_engine(max_running_requests=8)
    cache_kwarg(engine.model)  # resolved off the real forward's signature, before the wrap
    widths = []
    forward = engine.model.forward

    def counting(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill (a decode feeds one token)
            widths.append(ids.shape[0])
        return forward(*args, **kwargs)

    engine.model.forward = counting
    group = [1, 5, 6, 7, 8]

    async def run():
        outs = await asyncio.gather(*(
            engine.generate(p, SamplingParams(max_new_tokens=5 + i, temperature=1.0, seed=i))
            for i, p in enumerate([group] * 4 + [[1, 9]])))
        await engine.close()
        return outs

    outs = asyncio.run(run())
    assert widths == [2]  # five requests, two distinct prompts: one forward of two rows
    assert len({tuple(o.output_ids) for o in outs[:4]}) > 1  # the samples did diverge
    for i, out in enumerate(outs):
        prompt = group if i < 4 else [1, 9]
        logp = torch.log_softmax(full_logits(engine.model, prompt, out.output_ids), dim=-1)
        expected = logp.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.output_logprobs), expected, atol=1e-4)


def test_growing_kv_layer_holds_exactly_what_concatenation_would():
    """kv_batch.GrowingLayer writes decode columns in place (no whole-cache copy per step):
    its keys/values equal the concatenation of everything written, across growths and after
    an outside assignment (prefill's padding zeroing, a re-packed batch)."""
    from rl_async.engine.kv_batch import GrowingLayer, new_cache

    g = torch.Generator().manual_seed(0)
    layer = GrowingLayer()
    written_k, written_v = [], []
    for n in [5, 1, 1, 70, 1, 1, 200, 1]:  # crosses several growths
        k, v = torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)
        written_k.append(k)
        written_v.append(v)
        keys, values = layer.update(k, v)
        assert torch.equal(keys, torch.cat(written_k, dim=2))
        assert torch.equal(values, torch.cat(written_v, dim=2))
        assert layer.get_seq_length() == keys.shape[2]
    layer.keys, layer.values = keys[:, :, :10] * 0, values[:, :, :10] * 0  # adopted as is
    k = torch.randn(3, 2, 1, 4, generator=g)
    keys, _ = layer.update(k, k)
    assert keys.shape[2] == 11 and torch.equal(keys[:, :, 10:], k) and not keys[:, :, :10].any()
    cache = new_cache([(keys, keys)])
    assert torch.equal(cache.layers[0].keys, keys) and cache.get_seq_length() == 11
