"""A staged publication on the embedded engine (rl_async/engine/embedded_weights.py) from the
real sender (rl_async/state/sender.py) in another process, over gloo: the engine receives
while it generates, serves (and stamps) its committed version until the switch, takes a
version only when every bucket's fingerprint and the model digest match, and is never
half-updated: a corrupted bucket leaves it on its committed weights.

Also the fingerprint itself (rl_async.state.weights.bucket_fingerprint): what it sees."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import pytest
import torch

from rl_async.engine.base import EngineError, SamplingParams
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.weights import bucket_fingerprint, model_digest

torch.set_num_threads(1)
BUCKET = 20_000  # several buckets of the tiny model


def _trainer(port_q, orders, replies) -> None:
    """Trainer rank 0: for each order (seed, delay), stage that model's weights, report the
    snapshot's metas, fingerprints, digest and checksum, and send it once told to."""
    import time

    from rl_async.state.sender import PublicationSender

    torch.set_num_threads(1)
    sender = PublicationSender("gloo")
    port_q.put(sender.open_channel("pub", 120))
    joined = threading.Thread(target=sender.join_channel, args=("pub", 2))
    joined.start()
    while (order := orders.get(timeout=120)) is not None:
        seed, delay = order
        named = build_causal_lm(tiny_llama_config(), seed=seed).named_parameters()
        metas = sender.stage(((n, p.detach()) for n, p in named), torch.float32, BUCKET,
                             flat=True, checksum=True)
        snap = sender.staged
        replies.put((metas, snap.fingerprints, snap.digest, snap.checksum))
        joined.join()
        time.sleep(delay)  # the engine is inside its receive meanwhile
        replies.put(sender.send(["pub"], "staged", 60))
        sender.commit()


@pytest.fixture
def trainer():
    ctx = multiprocessing.get_context("spawn")
    port_q, orders, replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_trainer, args=(port_q, orders, replies))
    proc.start()
    yield port_q, orders, replies
    orders.put(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


async def _stage(engine, orders, replies, version: int, seed: int, delay: float = 0.0):
    orders.put((seed, delay))
    metas, fingerprints, digest, checksum = await asyncio.to_thread(replies.get, True, 120)
    result = await engine.stage_weights(metas, "pub", version, fingerprints, digest)
    sent = await asyncio.to_thread(replies.get, True, 120)
    assert sent[1] == {}, sent  # the channel stayed healthy
    return result, checksum, len(metas)


def test_staged_publication_overlaps_generation_commits_atomically_and_refuses_corruption(
        trainer):
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    port_q, orders, replies = trainer
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=tiny_llama_config(),
                                                 max_running_requests=4))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)

    async def main():
        port = await asyncio.to_thread(port_q.get, True, 120)
        await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "pub", "gloo", 60)
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

        # Version 2 with bucket 2 corrupted on arrival: not verified, not committable; the
        # engine serves version 1's weights, untouched.
        engine.debug_faults["corrupt_bucket"] = 1
        bad, _, buckets = await _stage(engine, orders, replies, 2, seed=12)
        assert not bad["verified"] and f"bucket 2/{buckets}" in bad["error"], bad
        with pytest.raises(EngineError, match="no verified staged weights"):
            await engine.commit_weights(2)
        assert await engine.get_weight_version() == 1
        assert await engine.weights_checksum() == checksum

        # The next version lands normally (into the same staging buffers).
        good, checksum3, _ = await _stage(engine, orders, replies, 3, seed=13)
        assert good["verified"], good
        await engine.commit_weights(3)
        assert await engine.weights_checksum() == checksum3
        assert await engine.get_weight_version() == 3
        await engine.destroy_weights_update_group("pub")
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
    meta = (["a", "b"], ["float32", "float32"], [[2], [3]])
    assert model_digest([meta], [base]) != model_digest(
        [(["a", "b"], ["float32", "float32"], [[3], [2]])], [base])
