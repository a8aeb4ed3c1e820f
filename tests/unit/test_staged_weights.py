"""A staged publication on the embedded engine (rl_async/engine/embedded_weights.py) from the
real sender (rl_async/state/sender.py) in another process, over gloo: the engine receives
while it generates, serves (and stamps) its committed version until the switch, takes a
version only when every bucket's fingerprint and the model digest match, and is never
half-updated: a corrupted bucket leaves it on its committed weights.

Also the fingerprint itself (rl_async.state.weights.bucket_fingerprint): what it sees."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading

import pytest
import torch

from rl_async.engine.base import EngineError, SamplingParams
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.weights import Fingerprint, bucket_fingerprint, model_digest

torch.set_num_threads(1)
BUCKET = 20_000  # several buckets of the tiny model
PIECE = 8192  # and pieces of a bucket (the last one shorter)
_CHANNELS = itertools.count()


def _trainer(port_q, orders, replies, name) -> None:
    """Trainer rank 0: for each order (seed, delay, chunk_bytes), stage that model's
    weights, report the snapshot's metas, fingerprints, digest and checksum, and send it
    (in pieces of chunk_bytes) once told to."""
    import time

    from rl_async.state.sender import PublicationSender

    torch.set_num_threads(1)
    sender = PublicationSender("gloo")
    port_q.put(sender.open_channel(name, 120))
    joined = threading.Thread(target=sender.join_channel, args=(name, 2))
    joined.start()
    while (order := orders.get(timeout=120)) is not None:
        seed, delay, chunk = order
        named = build_causal_lm(tiny_llama_config(), seed=seed).named_parameters()
        metas = sender.stage(((n, p.detach()) for n, p in named), torch.float32, BUCKET,
                             flat=True, checksum=True)
        snap = sender.staged
        replies.put((metas, snap.fingerprints, snap.digest, snap.checksum))
        joined.join()
        time.sleep(delay)  # the engine is inside its receive meanwhile
        replies.put(sender.send([name], "staged", 60, chunk_bytes=chunk))
        sender.commit()


@pytest.fixture
def trainer():
    """(port queue, orders, replies, channel name): a name per test, as a process group's
    name stays taken in the engine's process after it is destroyed."""
    ctx = multiprocessing.get_context("spawn")
    port_q, orders, replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
    name = f"pub-{next(_CHANNELS)}"
    proc = ctx.Process(target=_trainer, args=(port_q, orders, replies, name))
    proc.start()
    yield port_q, orders, replies, name
    orders.put(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


async def _stage(engine, orders, replies, version: int, seed: int, delay: float = 0.0,
                 chunk: int = 0):
    orders.put((seed, delay, chunk))
    metas, fingerprints, digest, checksum = await asyncio.to_thread(replies.get, True, 120)
    (channel,) = engine.weight_update_groups()
    result = await engine.stage_weights(metas, channel, version, fingerprints, digest,
                                        chunk_bytes=chunk)
    sent = await asyncio.to_thread(replies.get, True, 120)
    assert sent[1] == {}, sent  # the channel stayed healthy
    return result, checksum, len(metas)


def test_staged_publication_overlaps_generation_commits_atomically_and_refuses_corruption(
        trainer):
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    port_q, orders, replies, channel = trainer
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=tiny_llama_config(),
                                                 max_running_requests=4))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def main():
        port = await asyncio.to_thread(port_q.get, True, 120)
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, channel, "gloo", 60)
        old = await engine.weights_checksum()
        before = await engine.generate([1, 2, 3], greedy)
        # Version 1 arrives while a long request generates: the engine keeps stepping
        # during the receive (the sender waits 1 s inside it) and stamps its committed
        # version 0 until the switch.
        long = asyncio.ensure_future(engine.generate(
            [1, 2], SamplingParams(max_new_tokens=250, temperature=1.0)))
        while engine.stats["steps"] == 0:
            await asyncio.sleep(0.01)
        steps = engine.stats["steps"]
        result, checksum, buckets = await _stage(engine, orders, replies, 1, seed=11,
                                                 delay=1.0)
        assert buckets > 1 and result["verified"] and result["error"] is None, result
        assert engine.stats["steps"] > steps  # generation went on during the transfer
        assert await engine.get_weight_version() == 0
        assert await engine.weights_checksum() == old  # staged, not served
        assert (await engine.generate([1, 2, 3], greedy)).output_ids == before.output_ids
        commit = await engine.commit_weights(1)
        assert commit["pause_seconds"] >= 0
        assert await engine.weights_checksum() == checksum  # exactly the trainer's snapshot
        out = await long
        assert set(out.token_versions) <= {0, 1} and out.token_versions[0] == 0
        assert out.token_versions == sorted(out.token_versions)  # 0 until the switch only
        assert (await engine.generate([1, 2, 3], greedy)).token_versions == [1] * 6

        # Version 2 with bucket 2 corrupted on arrival, in pieces: not verified, not
        # committable; the engine serves version 1's weights, untouched.
        engine.debug_faults["corrupt_bucket"] = 1
        bad, _, buckets = await _stage(engine, orders, replies, 2, seed=12, chunk=PIECE)
        assert not bad["verified"] and f"bucket 2/{buckets}" in bad["error"], bad
        with pytest.raises(EngineError, match="no verified staged weights"):
            await engine.commit_weights(2)
        assert await engine.get_weight_version() == 1
        assert await engine.weights_checksum() == checksum

        # The next version lands normally (into the same staging buffers), in pieces.
        good, checksum3, _ = await _stage(engine, orders, replies, 3, seed=13, chunk=PIECE)
        assert good["verified"], good
        await engine.commit_weights(3)
        assert await engine.weights_checksum() == checksum3
        assert await engine.get_weight_version() == 3
        await engine.destroy_weights_update_group(channel)
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), 300))


def test_the_fingerprint_sees_flips_shifts_and_stale_rows_and_the_digest_the_layout():
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 256, (3 * 8192 + 13,), dtype=torch.uint8, generator=gen)
    base = bucket_fingerprint(flat)
    assert bucket_fingerprint(flat.clone()) == base  # deterministic
    for edit in (lambda t: t.__setitem__(5, t[5] ^ 1),          # one bit
                 lambda t: t.__setitem__(-1, t[-1] ^ 128),      # in the tail
                 lambda t: t[8192:16384].zero_(),               # a row never written
                 lambda t: t.copy_(torch.roll(t, 8))):          # shifted by a word
        changed = flat.clone()
        edit(changed)
        assert bucket_fingerprint(changed) != base
    assert bucket_fingerprint(flat[:-1]) != base  # truncated
    # taken piece by piece as the bytes land, however they are cut: the same
    for cut in (8192, 16384, 5000, 3 * 8192 + 13):
        piecewise, landed = Fingerprint(flat), 0
        while landed < flat.numel():
            landed = min(flat.numel(), landed + cut)
            piecewise.advance(landed)
        assert piecewise.hexdigest() == base
    assert Fingerprint(flat[1:]).hexdigest() == bucket_fingerprint(flat[1:].clone())
    meta = (["a", "b"], ["float32", "float32"], [[2], [3]])
    assert model_digest([meta], [base]) != model_digest(
        [(["a", "b"], ["float32", "float32"], [[3], [2]])], [base])


def test_packed_linears_never_serve_old_weights_when_their_packing_finishes_after_commit(
        trainer):
    """engine.onednn_linear: the linears of a staged version are packed as their pieces land,
    except the last piece's, packed after the switch. Until then those run on the stock
    kernel over the NEW weights; then on their packed copies. At no point does any linear
    compute with the old weights (a stale packed copy: LESSONS miles#2782)."""
    import torch.nn.functional as F

    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    port_q, orders, replies, channel = trainer
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=tiny_llama_config(),
                                                 onednn_linear=True))
    linears, lm_head = engine._linears, engine._params["lm_head.weight"]
    gate = threading.Event()
    pack = linears.pack

    def held_pack(weights):  # the late packing (lm_head's bytes come last) waits for the test
        if any(param is lm_head for param, _ in weights):
            assert gate.wait(60)
        return pack(weights)

    linears.pack = held_pack

    def computes_with_current_weights() -> None:
        generator = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for module in linears.modules:
                x = torch.randn(3, module.in_features, generator=generator)
                want = F.linear(x, module.weight, module.bias)
                assert torch.allclose(module(x), want, atol=1e-4)

    async def main():
        port = await asyncio.to_thread(port_q.get, True, 120)
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, channel, "gloo", 60)
        result, checksum, _ = await _stage(engine, orders, replies, 1, seed=21, chunk=PIECE)
        assert result["verified"], result
        await engine.commit_weights(1)
        assert await engine.weights_checksum() == checksum
        pending = [m for m in linears.modules if id(m) not in linears._packed]
        assert pending == [engine.model.lm_head]  # on the stock kernel, new weights
        computes_with_current_weights()
        gate.set()
        await asyncio.wait_for(engine._late_task, 60)
        assert all(id(m) in linears._packed for m in linears.modules)
        computes_with_current_weights()  # the packed copies are the new weights'
        assert engine.stats["late_pack_seconds"] > 0
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
        assert (await engine.generate([1, 2, 3], greedy)).token_versions == [1] * 4
        await engine.destroy_weights_update_group(channel)
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), 300))
