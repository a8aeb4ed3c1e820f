"""Trainer rank 0's publication sender (rl_async/state/sender.py) with real gloo channels to
spawned receiver processes: one channel per engine, so an engine that dies or hangs inside
a transfer costs only its own channel while the others get every byte; names are explicit;
a catch-up sends the published snapshot even after the next one was staged."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from rl_async.state.sender import PublicationSender
from rl_async.state.weights import unflatten_bucket, weights_checksum


def _receiver(port: int, name: str, metas, mode: str, results) -> None:
    """An engine's end of one channel: receive every bucket (flat), or die / hang at the
    first one, then report the checksum of what arrived."""
    import os

    import torch.distributed as dist

    from rl_async.state import collective

    group = collective.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1,
                                                 name, timeout=20)
    if mode == "die":
        os._exit(1)
    if mode == "hang":
        time.sleep(60)
        return
    named = []
    for names, dtypes, shapes, nbytes in metas:
        flat = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(flat, group=group, group_src=0)
        named += [(n, t.clone()) for n, t in unflatten_bucket(flat, names, dtypes, shapes)]
    results.put((name, weights_checksum(named)))


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, 32, generator=gen)) for i in range(6)]


def _send_to(modes: dict[str, str], timeout_s: float = 3.0):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    sender = PublicationSender("gloo")
    metas = sender.stage(_weights(0), torch.float32, 3 * 64 * 32 * 4, flat=True,
                         checksum=True)
    procs, joins = [], []
    for name, mode in modes.items():
        port = sender.open_channel(name, 20)
        procs.append(ctx.Process(target=_receiver, args=(port, name, metas, mode, results)))
        procs[-1].start()
        joins.append(threading.Thread(target=sender.join_channel, args=(name, 2)))
        joins[-1].start()
    for j in joins:
        j.join()
    started = time.monotonic()
    nbytes, failed = sender.send(list(modes), "staged", timeout_s)
    elapsed = time.monotonic() - started
    got = {}
    for _ in [m for m in modes.values() if m == "ok"]:
        name, digest = results.get(timeout=60)
        got[name] = digest
    for p in procs:
        p.kill()
        p.join()
    return sender, nbytes, failed, got, elapsed


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_an_engine_that_dies_or_hangs_costs_only_its_own_channel(mode):
    # channel names are never reused (the fleet numbers them), here nor in a product run
    a, c = f"{mode}-engine-0", f"{mode}-engine-2"
    sender, nbytes, failed, got, elapsed = _send_to({a: "ok", mode: mode, c: "ok"})
    assert set(failed) == {mode}, failed
    assert "bucket 1/2" in failed[mode]  # where it stopped
    # the survivors hold exactly the snapshot: every bucket reached them
    assert got == {a: sender.staged.checksum, c: sender.staged.checksum}
    assert nbytes == sender.staged.nbytes
    assert sender.channels() == [a, c]  # the failed channel was destroyed
    assert elapsed < 3.0 + 5.0  # at most one channel deadline, not one per bucket
    for name in sender.channels():
        sender.close_channel(name)


def test_sending_on_a_channel_that_was_never_joined_is_an_error():
    sender = PublicationSender("gloo")
    sender.stage(_weights(0), torch.float32, 1 << 20, flat=True)
    with pytest.raises(KeyError, match="not joined by trainer rank 0"):
        sender.send(["rl_async_publication"], "staged", 1.0)


def test_catch_up_sends_the_published_snapshot_not_the_one_staged_after_it():
    sender = PublicationSender("gloo")
    sender.stage(_weights(0), torch.float32, 1 << 14, flat=True, checksum=True)
    published, first = sender.staged.checksum, {b.data_ptr() for b in sender.staged.buckets}
    with pytest.raises(RuntimeError, match="no published snapshot"):
        sender.snapshot("published")
    sender.commit()
    sender.stage(_weights(1), torch.float32, 1 << 14, flat=True, checksum=True)
    assert sender.snapshot("published").checksum == published
    assert sender.snapshot("staged").checksum != published
    # the published buffers are intact while a newer snapshot is staged
    named = [n for b, m in zip(sender.published.buckets, sender.published.metas)
             for n in unflatten_bucket(b, *m[:3])]
    assert weights_checksum(named) == published
    assert not first & {b.data_ptr() for b in sender.staged.buckets}
    # ... and reused once superseded: two snapshots' worth of memory, no more
    sender.commit()
    sender.stage(_weights(2), torch.float32, 1 << 14, flat=True)
    assert {b.data_ptr() for b in sender.staged.buckets} == first


def test_snapshots_are_taken_in_the_engines_dtype_and_split_like_the_codec():
    from rl_async.state.weights import bucket_named_tensors

    weights = _weights(0)
    sender = PublicationSender("gloo")
    limit = 2 * 64 * 32 * 2 + 1
    metas = sender.stage(iter(weights), torch.bfloat16, limit, flat=False)
    expected = bucket_named_tensors([(n, t.to(torch.bfloat16)) for n, t in weights], limit)
    assert [m[0] for m in metas] == [[n for n, _ in b] for b in expected]
    assert all(d == "bfloat16" for m in metas for d in m[1])
