"""The timing models (pure functions) and the synthetic engine's interface behaviour."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from rl_async.engine.base import InvalidRequestError, SamplingParams
from rl_async.engine.synthetic import (SyntheticEngine, SyntheticEngineConfig, payload_checksum,
                                       payload_nbytes)
from rl_async.engine.timing import (EngineTiming, ResponseLengths, TrainerTiming,
                                    TransferTiming, bucket_sizes)


def test_decode_step_grows_with_running_requests_and_kv_tokens():
    t = EngineTiming()
    assert t.step_seconds(0, 0) == 0.0
    assert t.step_seconds(1, 100) < t.step_seconds(128, 100) < t.step_seconds(128, 300_000)
    # batching: more running requests -> more tokens/s in total, fewer per stream
    assert t.tokens_per_second(128, 0) > 10 * t.tokens_per_second(1, 0)
    assert t.step_seconds(128, 0) == pytest.approx(0.008 + 0.00015 * 128)
    assert t.prefill_seconds(0) == 0.0
    assert t.prefill_seconds(20_000) == pytest.approx(0.005 + 1.0)


def test_response_lengths_are_long_tailed_capped_and_seeded():
    lengths = ResponseLengths(median=100, sigma=1.0)
    draws = [lengths.sample(random.Random(i), 1000) for i in range(4000)]
    assert min(draws) >= 1 and max(draws) == 1000  # the cap is hit by the tail
    assert 85 <= statistics.median(draws) <= 115
    assert statistics.fmean(draws) > 1.3 * statistics.median(draws)  # long tail
    assert statistics.fmean(draws) == pytest.approx(lengths.mean(1000), rel=0.06)
    assert lengths.sample(random.Random(7), 1000) == lengths.sample(random.Random(7), 1000)
    assert ResponseLengths(median=50, sigma=0).sample(random.Random(0), 20) == 20


def test_transfer_trainer_and_buckets():
    assert TransferTiming(bytes_per_s=1e9, bucket_latency_s=0.0).bucket_seconds(2e9) == 2.0
    assert TrainerTiming(0.1).collection_seconds(30) == pytest.approx(3.0)
    assert bucket_sizes(10, 4) == [4, 4, 2] and bucket_sizes(8, 4) == [4, 4]
    assert bucket_sizes(0, 4) == [0]
    assert payload_nbytes(["bfloat16", "torch.float32"], [[2, 3], [5]]) == 12 + 20


def engine(**kw) -> SyntheticEngine:
    timing = EngineTiming(prefill_overhead_s=0.0, prefill_tokens_per_s=1e9,
                          decode_step_base_s=0.001, decode_step_per_request_s=0.0,
                          decode_step_per_kv_token_s=0.0)
    opts = dict(max_running_requests=4, timing=timing,
                lengths=ResponseLengths(median=20, sigma=1.0),
                transfer=TransferTiming(bucket_latency_s=0.0, group_init_s=0.0),
                time_scale=1.0, vocab_size=50)
    opts.update(kw)
    return SyntheticEngine(SyntheticEngineConfig(**opts))


PARAMS = SamplingParams(max_new_tokens=64, stop_token_ids=(3,))


def test_generate_records_tokens_logprobs_and_versions():
    async def main():
        e = engine()
        outs = await asyncio.gather(*(e.generate([1, 2, 5], PARAMS) for _ in range(10)))
        for out in outs:
            n = len(out.output_ids)
            assert 1 <= n <= 64 and len(out.output_logprobs) == len(out.token_versions) == n
            assert all(lp <= 0 for lp in out.output_logprobs)
            assert set(out.token_versions) == {0}
            assert all(0 <= t < 50 for t in out.output_ids)
            if out.finish_reason == "stop":
                assert out.output_ids[-1] == 3 and 3 not in out.output_ids[:-1]
            else:
                assert out.finish_reason == "length" and n == 64
        assert len({tuple(o.output_ids) for o in outs}) == 10
        await e.close()
    asyncio.run(main())


def test_running_requests_never_exceed_the_slots_and_shorter_ones_finish_first():
    async def main():
        e = engine(max_running_requests=4)
        order, peak = [], 0
        reqs = [e.submit([1], PARAMS) for _ in range(4)]
        for r in reqs:
            r.future.add_done_callback(lambda f: order.append(len(f.result().output_ids)))
        more = [e.submit([1], PARAMS) for _ in range(8)]
        while not all(r.future.done() for r in reqs + more):
            peak = max(peak, e.load().running)
            assert e.load().running <= 4
            await asyncio.sleep(0.002)
        assert peak == 4
        assert order == sorted(order)  # admitted together: the shortest response leaves first
        await e.close()
    asyncio.run(main())


def test_invalid_requests_are_refused():
    async def main():
        e = engine()
        with pytest.raises(InvalidRequestError, match="input_ids"):
            await e.generate([], PARAMS)
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            await e.generate([1], SamplingParams(max_new_tokens=0))
        with pytest.raises(InvalidRequestError, match="mode"):
            await e.pause_generation("sideways")
    asyncio.run(main())


FIXED = dict(lengths=ResponseLengths(median=400, sigma=0.0))
LONG = SamplingParams(max_new_tokens=400)


def test_pause_abort_returns_partial_tokens():
    async def main():
        # 20,000 tokens at 1 ms a step: the engine's clock is the wall clock, so 0.1 s in it
        # has decoded ~100 of them however loaded the machine, and is far from done
        e = engine(lengths=ResponseLengths(median=20_000, sigma=0.0))
        task = asyncio.ensure_future(e.generate([1, 2], SamplingParams(max_new_tokens=20_000)))
        await asyncio.sleep(0.1)
        await e.pause_generation("abort")
        out = await task
        assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 20_000
        assert len(out.token_versions) == len(out.output_ids)
        await e.continue_generation()
        assert (await e.generate([1], SamplingParams(max_new_tokens=5))).finish_reason == "length"
    asyncio.run(main())


def test_retract_and_weight_update_keep_old_tokens_versions_and_rebuild_the_prefix():
    async def main():
        e = engine(**FIXED)
        await e.init_weights_update_group("127.0.0.1", 0, 1, 2, "pub", "gloo")
        task = asyncio.ensure_future(e.generate([1, 2], LONG))
        await asyncio.sleep(0.1)
        await e.pause_generation("retract")
        assert e.load().running == 0 and e.load().waiting == 1
        await e.update_weights_from_distributed(["w"], ["bfloat16"], [[8]], "pub", 1)
        assert await e.get_weight_version() == 1
        await e.continue_generation()
        out = await task
        assert len(out.output_ids) == 400 and out.refreshes == 1
        versions = out.token_versions
        assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
        assert await e.weights_checksum() == payload_checksum(["w"], 16)
        with pytest.raises(Exception, match="never"):
            await e.update_weights_from_distributed(["w"], ["bfloat16"], [[8]], "other", 2)
    asyncio.run(main())


def test_in_place_pause_freezes_without_refresh_and_flush_while_frozen_rebuilds():
    async def main():
        e = engine(**FIXED)
        a = asyncio.ensure_future(e.generate([1], LONG))
        await asyncio.sleep(0.05)
        await e.pause_generation("in_place")
        assert e.load().running == 1
        frozen_at = e._step
        await asyncio.sleep(0.05)
        assert e._step == frozen_at  # no progress while paused
        await e.continue_generation()
        out = await a
        assert out.refreshes == 0 and len(out.output_ids) == 400
        b = asyncio.ensure_future(e.generate([1], LONG))
        await asyncio.sleep(0.05)
        await e.pause_generation("in_place")
        await e.flush_cache()
        await e.continue_generation()
        assert (await b).refreshes == 1
    asyncio.run(main())


def test_abort_one_and_cancelled_caller_free_their_slot():
    async def main():
        e = engine(max_running_requests=1, **FIXED)
        first = asyncio.ensure_future(e.generate([1], LONG, request_id="a"))
        await asyncio.sleep(0.01)
        assert await e.abort("a") == 1 and (await first).finish_reason == "abort"
        second = asyncio.ensure_future(e.generate([1], LONG))
        await asyncio.sleep(0.01)
        second.cancel()
        await asyncio.sleep(0.01)
        assert e.load().running == 0
        short = await e.generate([1], SamplingParams(max_new_tokens=3))
        assert len(short.output_ids) == 3
    asyncio.run(main())


def test_instant_time_scale_serves_many_requests():
    async def main():
        e = engine(time_scale=0.0, max_running_requests=8)
        outs = await asyncio.gather(*(e.generate([1], PARAMS) for _ in range(500)))
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        assert e.stats["finished"] == 500 and e.load().running == 0
    asyncio.run(main())


def test_generate_batch_streams_results_and_fails_only_the_bad_request():
    async def main():
        e = engine(max_running_requests=8)
        requests = [([1], PARAMS), ([], PARAMS), ([1, 2], PARAMS)]
        seen = {}
        async for finished in e.generate_batch(requests):
            for index, value in finished:
                assert index not in seen
                seen[index] = value
        assert sorted(seen) == [0, 1, 2]
        assert isinstance(seen[1], InvalidRequestError)
        assert seen[0].finish_reason in ("stop", "length") and seen[2].prompt_len == 2
    asyncio.run(main())


def test_the_engine_reports_its_decode_curve_as_run():
    """The curve calibration reads back: the model's steps at the batch sizes that ran."""
    timing = EngineTiming(prefill_overhead_s=0.0, prefill_tokens_per_s=1e9,
                          decode_step_base_s=0.001, decode_step_per_request_s=0.0005,
                          decode_step_per_kv_token_s=0.0)

    async def main():
        e = engine(timing=timing, max_running_requests=8)
        await asyncio.gather(*(e.generate([1], PARAMS) for _ in range(16)))
        await e.close()
        return e.step_curve

    curve = asyncio.run(main())
    assert curve.lo < curve.hi <= 8  # the batch shrank as short responses left
    base, per = curve.fit()
    assert base == pytest.approx(0.001) and per == pytest.approx(0.0005)


def test_prefill_samples_the_first_token_and_arrivals_join_at_the_next_step():
    """A response of n tokens takes its prefill and n - 1 decode steps (the prefill samples
    the first token), and a request arriving mid-step waits for that step's end: requests
    join a running batch only between steps, as in SGLang's and the embedded engine's loops."""
    from rl_async.base import clock
    from rl_async.sim.virtual_loop import run_virtual

    timing = EngineTiming(prefill_overhead_s=0.002, prefill_tokens_per_s=1e9,
                          decode_step_base_s=0.010, decode_step_per_request_s=0.0,
                          decode_step_per_kv_token_s=0.0)
    params = SamplingParams(max_new_tokens=64)

    async def main():
        e = engine(timing=timing, lengths=ResponseLengths(median=3, sigma=0))
        done = {}

        async def run(name, delay):
            await asyncio.sleep(delay)
            out = await e.generate([1], params)
            done[name] = (round(clock.now(), 6), len(out.output_ids))
            assert out.engine_seconds == pytest.approx(clock.now() - delay)  # arrival to answer

        await asyncio.gather(run("first", 0.0), run("second", 0.005))
        await e.close()
        return done

    done = run_virtual(main())
    # first: prefill 0-2 ms, steps 2-12 and (after the second's prefill, 12-14) 14-24 ms
    assert done["first"] == (0.024, 3)
    # second: arrived at 5 ms, mid-step; admitted at 12 ms; steps 14-24 and 24-34 ms
    assert done["second"] == (0.034, 3)


def test_a_prefill_residue_below_the_clocks_resolution_does_not_stall_the_engine():
    """Late in a simulation (t = 300 s) float time cannot advance by 1e-14 s; a prefill
    left with such a residue once spun the engine's loop forever (three_node.toml with
    publication.drain_timeout_s=10): the residue counts as done."""
    from rl_async.base import clock
    from rl_async.engine.synthetic_types import _Segment
    from rl_async.sim.virtual_loop import run_virtual

    async def main():
        await asyncio.sleep(302.8629631959119)
        e = engine()
        e._seg = _Segment(clock.now(), prefill_left=1.4432899320127035e-14, step_s=0.0278,
                          steps_left=0.0)
        e._advance()
        return e._seg.prefill_left

    assert run_virtual(main()) == 0.0
