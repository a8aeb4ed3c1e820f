"""Embedded engine: pause modes, continue, flush, weight updates and per-token versions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_async.engine.base import EngineError, InvalidRequestError, SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.weights import weights_checksum

torch.set_num_threads(1)
PROMPT = [1, 5, 9, 3]


def make_engine(**overrides) -> EmbeddedEngine:
    kwargs = {"hf_config": tiny_llama_config(), "max_running_requests": 4}
    kwargs.update(overrides)
    return EmbeddedEngine(EmbeddedEngineConfig(**kwargs))


def new_weights(seed: int = 7) -> list:
    return list(build_causal_lm(tiny_llama_config(), seed=seed).named_parameters())


async def wait_for_tokens(engine: EmbeddedEngine, n: int) -> None:
    """Yield until the first running request has at least n tokens (no timing assumptions)."""
    while engine._batch is None or len(engine._batch.requests[0].output_ids) < n:
        await asyncio.sleep(0.001)


def logprobs_under(model, prompt, output, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_retract_rebuilds_prefix_under_new_weights_without_resampling():
    engine = make_engine()
    old_model = build_causal_lm(tiny_llama_config(), seed=0)
    weights = new_weights()

    async def run():
        task = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=30,
                                                                            seed=1)))
        await wait_for_tokens(engine, 3)
        await engine.pause_generation("retract")
        assert engine.load().running == 0 and engine.load().waiting == 1
        kept = list(engine.scheduler.waiting[0].output_ids)
        await engine.update_weights_from_tensor(weights, weight_version=1)
        await engine.continue_generation()
        out = await task
        await engine.close()
        return kept, out

    kept, out = asyncio.run(run())
    n_old = len(kept)
    assert out.output_ids[:n_old] == kept  # nothing resampled
    assert out.refreshes == 1
    assert out.token_versions == [0] * n_old + [1] * (30 - n_old)
    lp = torch.tensor(out.output_logprobs)
    assert torch.allclose(lp[:n_old], logprobs_under(old_model, PROMPT, kept), atol=1e-4)
    # New tokens: log-probs of the NEW weights over the whole (mixed) prefix.
    assert torch.allclose(lp[n_old:], logprobs_under(engine.model, PROMPT, out.output_ids)[n_old:],
                          atol=1e-4)


def test_in_place_freezes_and_continues_with_identical_tokens():
    async def run(pause: bool):
        engine = make_engine()
        task = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=25,
                                                                            seed=3)))
        if pause:
            await wait_for_tokens(engine, 2)
            await engine.flush_cache()  # not paused: live requests are untouched
            await wait_for_tokens(engine, 4)
            await engine.pause_generation("in_place")
            frozen = len(engine._batch.requests[0].output_ids)
            for _ in range(20):
                await asyncio.sleep(0.002)
            assert len(engine._batch.requests[0].output_ids) == frozen
            assert engine.load().running == 1
            await engine.continue_generation()
        out = await task
        await engine.close()
        return out

    paused, straight = asyncio.run(run(True)), asyncio.run(run(False))
    assert paused.output_ids == straight.output_ids
    assert paused.output_logprobs == pytest.approx(straight.output_logprobs, abs=1e-5)
    assert paused.refreshes == 0


@pytest.mark.parametrize("flush", [False, True])
def test_in_place_then_update_or_flush_never_reuses_old_kv(flush):
    engine = make_engine()
    weights = new_weights()

    async def run():
        task = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=20,
                                                                            seed=5)))
        await wait_for_tokens(engine, 3)
        await engine.pause_generation("in_place")
        n_old = len(engine._batch.requests[0].output_ids)
        if flush:
            await engine.flush_cache()
        await engine.update_weights_from_tensor(weights, weight_version=4)
        await engine.continue_generation()
        out = await task
        await engine.close()
        return n_old, out

    n_old, out = asyncio.run(run())
    assert out.refreshes == 1
    assert out.token_versions == [0] * n_old + [4] * (20 - n_old)
    lp = torch.tensor(out.output_logprobs)
    expected = logprobs_under(engine.model, PROMPT, out.output_ids)
    assert torch.allclose(lp[n_old:], expected[n_old:], atol=1e-4)


def test_pause_abort_aborts_in_flight_and_queues_new_requests():
    engine = make_engine()

    async def run():
        running = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=50)))
        await wait_for_tokens(engine, 2)
        await engine.pause_generation("abort")
        aborted = await running
        later = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=5)))
        for _ in range(10):
            await asyncio.sleep(0.002)
        assert not later.done() and engine.load().waiting == 1
        await engine.continue_generation()
        out = await later
        await engine.close()
        return aborted, out

    aborted, out = asyncio.run(run())
    assert aborted.finish_reason == "abort" and 2 <= len(aborted.output_ids) < 50
    assert len(aborted.output_logprobs) == len(aborted.token_versions) == len(aborted.output_ids)
    assert out.finish_reason == "length" and len(out.output_ids) == 5


def test_weight_update_changes_outputs_versions_and_checksum():
    engine = make_engine()
    weights = new_weights()
    greedy = SamplingParams(max_new_tokens=12, temperature=0)

    async def run():
        before = await engine.generate(PROMPT, greedy)
        await engine.update_weights_from_tensor(weights, weight_version=2)
        after = await engine.generate(PROMPT, greedy)
        checksum = await engine.weights_checksum()
        version = await engine.get_weight_version()
        await engine.close()
        return before, after, checksum, version

    before, after, checksum, version = asyncio.run(run())
    assert before.output_ids != after.output_ids
    assert before.token_versions == [0] * 12 and after.token_versions == [2] * 12
    assert version == 2 and checksum == weights_checksum(weights)


def test_bad_weight_updates_are_refused_without_changing_anything():
    engine = make_engine()

    async def run():
        checksum = await engine.weights_checksum()
        good = new_weights()
        with pytest.raises(EngineError, match="no.such"):
            await engine.update_weights_from_tensor([good[0], ("no.such", torch.zeros(1))], 1)
        with pytest.raises(EngineError, match="shape"):
            await engine.update_weights_from_tensor([(good[0][0], torch.zeros(3))], 1)
        await engine.update_weights_from_tensor([], weight_version=3)
        with pytest.raises(ValueError, match="weight_version"):
            await engine.update_weights_from_tensor([], weight_version=2)
        with pytest.raises(InvalidRequestError, match="mode"):
            await engine.pause_generation("sideways")
        assert await engine.weights_checksum() == checksum
        await engine.close()

    asyncio.run(run())
