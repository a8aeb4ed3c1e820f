"""Weight codec (bucketing, flattening, checksum) and a real two-process gloo publication."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from two_ranks import run_pair  # tests/ is on the path

from rl_async.state.collective import create_store, destroy_group, init_custom_process_group
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.weights import (bucket_named_tensors, dtype_name, flatten_bucket,
                              unflatten_bucket, weights_checksum)

MIXED = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
         ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
         ("c", torch.arange(5, dtype=torch.int64)),
         ("d", torch.randn(4, 4, dtype=torch.float16)),
         ("e", torch.tensor(3.0))]


def test_buckets_keep_order_and_respect_the_limit():
    buckets = bucket_named_tensors(MIXED, max_bucket_bytes=40)
    assert [n for b in buckets for n, _ in b] == ["a", "b", "c", "d", "e"]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 40 or len(bucket) == 1
    assert len(bucket_named_tensors(MIXED, max_bucket_bytes=10**9)) == 1
    with pytest.raises(ValueError, match="max_bucket_bytes"):
        bucket_named_tensors(MIXED, 0)


def test_flatten_roundtrip_is_bit_exact_for_mixed_dtypes():
    flat, names, dtypes, shapes = flatten_bucket(MIXED)
    assert flat.dtype == torch.uint8 and dtypes[1] == "bfloat16" and shapes[4] == []
    back = unflatten_bucket(flat, names, dtypes, shapes)
    for (n0, t0), (n1, t1) in zip(MIXED, back):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)
    with pytest.raises(ValueError, match="metadata"):
        unflatten_bucket(flat[:-1], names, dtypes, shapes)


def test_checksum_detects_any_change_and_ignores_order():
    base = weights_checksum(MIXED)
    assert weights_checksum(list(reversed(MIXED))) == base
    changed = [(n, t.clone()) for n, t in MIXED]
    changed[0][1][0, 0] += 1
    assert weights_checksum(changed) != base


def _rank_main(rank: int, queue) -> None:
    torch.set_num_threads(1)
    if rank == 0:
        _trainer(queue)
    else:
        asyncio.run(_engine(queue))


def _trainer(queue) -> None:
    # The trainer already owns a default group (as under DDP); the publication group is extra.
    # Both without a port picked in advance (another process may take it meanwhile): the
    # default group in memory, the publication store on a port it binds and then reports.
    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    store = create_store(60)
    queue.put(("port", store.port))
    group = init_custom_process_group("gloo", None, 2, 0, "pub", 60, store=store)
    named = list(build_causal_lm(tiny_llama_config(), seed=11).named_parameters())
    buckets = bucket_named_tensors([(n, t.detach()) for n, t in named], 20_000)
    queue.put(("meta", len(buckets), weights_checksum(named)))
    for bucket in buckets:
        flat, names, dtypes, shapes = flatten_bucket(bucket)
        queue.put(("bucket", names, dtypes, shapes))
        dist.broadcast(flat, group=group, group_src=0)
    destroy_group("pub")
    dist.destroy_process_group()


async def _engine(queue) -> None:
    from rl_async.engine.base import SamplingParams
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=tiny_llama_config()))
    before = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
    _, port = queue.get()
    await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "pub", "gloo")
    await engine.pause_generation("retract")
    _, n_buckets, checksum = queue.get()
    for i in range(n_buckets):
        _, names, dtypes, shapes = queue.get()
        version = 1 if i == n_buckets - 1 else None
        await engine.update_weights_from_distributed(names, dtypes, shapes, "pub", version)
    await engine.continue_generation()
    after = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
    queue.put(("result", n_buckets, checksum, await engine.weights_checksum(),
               before.token_versions, after.token_versions))
    await engine.destroy_weights_update_group("pub")
    await engine.close()


def test_distributed_bucketed_update_between_two_processes():
    ctx = mp.get_context("spawn")
    to_engine, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(0, to_engine)),
             ctx.Process(target=_rank_main, args=(1, _Relay(to_engine, results)))]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        _, n_buckets, sent, received, before, after = results.get(timeout=5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert n_buckets > 1  # really bucketed
    assert received == sent
    assert before == [0, 0, 0] and after == [1, 1, 1]


class _Relay:
    """The engine reads metadata from the trainer's queue and reports on its own queue."""

    def __init__(self, inbox, outbox):
        self.inbox, self.outbox = inbox, outbox

    def get(self):
        return self.inbox.get(timeout=60)

    def put(self, item):
        self.outbox.put(item)


# ---- an engine's receive is bounded by the group timeout ---------------------------------

def _silent_sender_or_engine(rank: int, port: int, results, release) -> None:
    """Rank 0 joins and never sends: a trainer whose broadcast failed on another engine that
    died. Rank 1 is an embedded engine waiting for that bucket (a survivor)."""
    torch.set_num_threads(1)
    if rank == 0:
        # its own timeout only bounds the rendezvous here: the engine may be slow to build
        init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "pub", 120)
        release.get(timeout=120)  # alive and silent until the engine has reported
        return
    asyncio.run(_survivor(port, results))


async def _survivor(port: int, results) -> None:
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=tiny_llama_config()))
    name, param = next(iter(engine.model.named_parameters()))
    await engine.init_weights_update_group("127.0.0.1", port, 1, 2, "pub", "gloo", 2.0)
    try:
        await engine.update_weights_from_distributed([name], [dtype_name(param.dtype)],
                                                     [list(param.shape)], "pub", 1)
        results.put("returned")
    except RuntimeError as exc:
        results.put(f"{type(exc).__name__}: {exc}")


def test_an_engine_receive_whose_sender_gave_up_errors_at_the_group_timeout():
    """Gloo cannot abort a pending receive; the group timeout the fleet passes to engines
    (publication.timeout_s / 3) is what frees a survivor, so the publication can be redone."""
    outcome = run_pair(_silent_sender_or_engine)
    assert outcome != "returned" and "timed out" in outcome.lower(), outcome


def test_the_finite_check_reads_a_finite_tensor_without_a_flag_per_element(monkeypatch):
    """A publication's snapshot checks every weight; `isfinite(t).all()` wrote a bool per
    element (140 ms for 104 MB, most of the snapshot). A finite sum proves the same; only a
    non-finite one pays for the exact check, and an overflowing sum is not an error."""
    from rl_async.state.weights import NonFiniteWeights, require_finite

    seen = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: seen.append(t.numel()) or real(t))
    require_finite("w", torch.randn(1000), "test")
    assert seen == [1]  # the sum's verdict only
    require_finite("w", torch.full((4,), 3e38), "test")  # the sum overflows; all finite
    bad = torch.randn(1000)
    bad[3] = float("nan")
    with pytest.raises(NonFiniteWeights, match="'w' has 1 NaN/inf values of 1000"):
        require_finite("w", bad, "test")
    half = torch.full((100,), 60000.0, dtype=torch.float16)  # an fp16 sum overflows early
    require_finite("h", half, "test")
