"""Trainer rank 0's publication sender (rl_async/state/sender.py) with real gloo channels to
spawned receiver processes: one channel per engine, each going through the buckets at its own
pace, so an engine that dies or hangs inside a transfer costs only its own channel while the
others get every byte; joins run concurrently; a channel closed mid-send fails only itself;
a trainer-side error is raised, not blamed on engines; names are explicit; a catch-up sends
the published snapshot even after the next one was staged."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from rl_async.state.device_buckets import DeviceBuckets
from rl_async.state.sender import PublicationSender, TrainerSideError, engine_side
from rl_async.state.weights import unflatten_bucket, weights_checksum

BUCKET = 64 * 32 * 4  # one tensor of _weights per bucket: six buckets


def _receiver(port: int, name: str, metas, mode: str, results, release=None) -> None:
    """An engine's end of one channel: receive every bucket (flat) and report the checksum
    of what arrived; or die / hang at the first one; or ("wait") stop before bucket 2 until
    `release` is set (a hung engine that a test lets go); or never join ("absent").
    Reports ("bucket", name, i) as each bucket lands."""
    import os

    import torch.distributed as dist

    from rl_async.state import collective

    if mode == "absent":
        time.sleep(60)
        return
    try:
        group = collective.init_custom_process_group(
            "gloo", f"tcp://127.0.0.1:{port}", 2, 1, name, timeout=120)
    except Exception as exc:  # noqa: BLE001 -- the test asserts on it
        results.put(("join_failed", name, repr(exc)))
        return
    results.put(("joined", name, None))
    if mode == "die":
        os._exit(1)
    if mode == "hang":
        time.sleep(60)
        return
    named = []
    for i, (names, dtypes, shapes, nbytes) in enumerate(metas):
        if mode == "wait" and i == 1:
            release.wait(60)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(flat, group=group, group_src=0)
        named += [(n, t.clone()) for n, t in unflatten_bucket(flat, names, dtypes, shapes)]
        results.put(("bucket", name, i))
    results.put(("done", name, weights_checksum(named)))


class Receivers:
    """Spawned receivers, one per channel, and what they report."""

    def __init__(self):
        self.ctx = multiprocessing.get_context("spawn")
        self.results = self.ctx.Queue()
        self.release = self.ctx.Event()
        self.procs = []
        self.seen: list[tuple] = []  # every report read so far

    def start(self, port, name, metas, mode):
        p = self.ctx.Process(target=_receiver,
                             args=(port, name, metas, mode, self.results, self.release))
        p.start()
        self.procs.append(p)

    def until(self, kind: str, names: set[str]) -> dict[str, object]:
        """Wait (each report within 120 s) until every name in `names` reported `kind`;
        returns their payloads. Every report read is kept in `self.seen`."""
        got = {}
        while set(got) != names:
            kind_, name, payload = self.results.get(timeout=120)
            self.seen.append((kind_, name, payload))
            if kind_ == kind and name in names:
                got[name] = payload
        return got

    def stop(self):
        self.release.set()
        for p in self.procs:
            p.kill()
            p.join()


@pytest.fixture
def receivers():
    r = Receivers()
    yield r
    r.stop()


def _channels(sender, receivers, modes: dict[str, str], metas,
              timeouts: dict[str, float] | None = None):
    """Open, start the receivers, join: every deadline generous (spawning a receiver and
    importing torch on a loaded 2-core machine takes a while), unless `timeouts` says."""
    timeouts = timeouts or {}
    for name, mode in modes.items():
        port = sender.open_channel(name, timeouts.get(name, 120))
        receivers.start(port, name, metas, mode)
    return sender.join_channels(list(modes), 2)


def _staged(bucket_bytes: int = 3 * BUCKET):
    sender = PublicationSender("gloo")
    metas = sender.stage(_weights(0), torch.float32, bucket_bytes, flat=True, checksum=True)
    return sender, metas


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(64, 32, generator=gen)) for i in range(6)]


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_an_engine_that_dies_or_hangs_costs_only_its_own_channel(mode, receivers):
    # channel names are never reused (the fleet numbers them), here nor in a product run
    a, c = f"{mode}-engine-0", f"{mode}-engine-2"
    sender, metas = _staged()
    assert _channels(sender, receivers, {a: "ok", mode: mode, c: "ok"}, metas) == {}
    nbytes, failed = sender.send([a, mode, c], "staged", 30.0)
    assert set(failed) == {mode}, failed
    assert "bucket 1/2" in failed[mode]  # where it stopped
    # the survivors hold exactly the snapshot: every bucket reached them
    assert receivers.until("done", {a, c}) == {a: sender.staged.checksum,
                                               c: sender.staged.checksum}
    assert nbytes == sender.staged.nbytes
    assert sender.channels() == [a, c]  # the failed channel was destroyed
    for name in sender.channels():
        sender.close_channel(name)


def test_channels_progress_independently_one_hung_receiver_among_four(receivers):
    """The three healthy receivers get every bucket while the hung one is still blocked
    before its second bucket (no lockstep); once let go it gets the rest, and nothing fails."""
    sender, metas = _staged(BUCKET)
    assert len(metas) == 6
    modes = {"ok-0": "ok", "ok-1": "ok", "hung-2": "wait", "ok-3": "ok"}
    assert _channels(sender, receivers, modes, metas) == {}
    out = {}
    send = threading.Thread(target=lambda: out.update(
        result=sender.send(list(modes), "staged", 120.0)))
    send.start()
    healthy = {"ok-0", "ok-1", "ok-3"}
    done = receivers.until("done", healthy)
    assert done == {n: sender.staged.checksum for n in healthy}
    # ... while the hung receiver had bucket 1 at most: the others did not wait for it
    assert [p for k, n, p in receivers.seen if k == "bucket" and n == "hung-2"] in ([], [0])
    assert send.is_alive()  # the send waits for the hung channel's outcome
    receivers.release.set()
    assert receivers.until("done", {"hung-2"}) == {"hung-2": sender.staged.checksum}
    send.join(60)
    assert out["result"] == (sender.staged.nbytes, {})


def test_a_channel_closed_by_the_fleet_mid_send_fails_alone(receivers):
    """An engine lost outside a publication (the thread balancer's call) closes its channel
    on another actor thread while send() runs: that channel fails, nothing raises, and the
    other channel gets every bucket."""
    sender, metas = _staged(BUCKET)
    assert _channels(sender, receivers, {"a": "ok", "lost": "wait"}, metas) == {}
    out = {}
    send = threading.Thread(target=lambda: out.update(
        result=sender.send(["a", "lost"], "staged", 120.0)))
    send.start()
    receivers.until("bucket", {"lost"})  # it got bucket 1, and waits before bucket 2
    sender.close_channel("lost")         # the fleet's lost(), from another thread
    receivers.release.set()
    send.join(60)
    nbytes, failed = out["result"]
    assert set(failed) == {"lost"} and "closed by the fleet" in failed["lost"], failed
    assert receivers.until("done", {"a"}) == {"a": sender.staged.checksum}
    assert sender.channels() == ["a"]
    sender.close_channel("a")


def test_joins_run_concurrently_so_an_absent_engine_does_not_fail_a_healthy_one(receivers):
    """One call joins both channels: the engine that never comes costs its own channel's
    timeout (30 s), while the other's rendezvous completes meanwhile (joined one after the
    other, it waited for the absent one's 30 s first)."""
    sender, metas = _staged()
    failed = _channels(sender, receivers, {"absent": "absent", "healthy": "ok"}, metas,
                       timeouts={"absent": 30})
    assert set(failed) == {"absent"}, failed
    assert receivers.until("joined", {"healthy"}) == {"healthy": None}
    assert sender.channels() == ["healthy"]
    assert sender.send(["healthy"], "staged", 20.0) == (sender.staged.nbytes, {})
    assert receivers.until("done", {"healthy"}) == {"healthy": sender.staged.checksum}
    sender.close_channel("healthy")


def test_a_whole_receive_past_its_total_budget_loses_that_engine(receivers):
    sender, metas = _staged(BUCKET)
    assert _channels(sender, receivers, {"slow": "hang"}, metas) == {}
    _, failed = sender.send(["slow"], "staged", 60.0, total_s=2.0)
    assert "not sent within its total deadline" in failed["slow"], failed
    assert sender.channels() == []


def test_a_trainer_side_error_in_a_channel_thread_is_raised_not_blamed_on_engines(
        receivers, monkeypatch):
    sender, metas = _staged()
    assert _channels(sender, receivers, {"e0": "ok", "e1": "ok"}, metas) == {}

    def broken(name, tensors, deadline, where):  # a bug on trainer rank 0
        raise TypeError("broadcast() got an unexpected keyword argument")

    monkeypatch.setattr(sender, "_broadcast", broken)
    with pytest.raises(TrainerSideError, match="not a peer error.*TypeError"):
        sender.send(["e0", "e1"], "staged", 30.0)


def test_the_same_error_on_every_channel_at_once_is_the_trainers(receivers, monkeypatch):
    sender, metas = _staged()
    assert _channels(sender, receivers, {"s0": "ok", "s1": "ok"}, metas) == {}

    def sticky(name, tensors, deadline, where):  # e.g. a sticky CUDA error on rank 0,
        raise RuntimeError("connection closed: CUDA error: an illegal memory access")

    monkeypatch.setattr(sender, "_broadcast", sticky)
    with pytest.raises(TrainerSideError, match="every channel failed alike"):
        sender.send(["s0", "s1"], "staged", 30.0)


def test_which_channel_errors_are_the_engines():
    assert engine_side(TimeoutError("channel x bucket 1/2: not complete by its deadline"))
    assert engine_side(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]"))
    assert engine_side(RuntimeError("NCCL error: remote process exited or there was a "
                                    "network error, NCCL version 2.27"))
    assert not engine_side(TypeError("unexpected keyword"))
    assert not engine_side(RuntimeError("CUDA error: an illegal memory access"))


def test_device_buckets_share_a_slot_per_bucket_and_a_hung_channel_holds_only_one():
    """Two slots: channels at the same bucket share one; a channel stuck on bucket 0 keeps
    its slot while the others go through buckets 1, 2, ... in the other; a third distinct
    bucket waits for a free slot no longer than its deadline; closing the stuck channel
    gives its slot back."""
    ring = DeviceBuckets(torch.device("meta"), slots=2)
    host = [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]
    far = time.monotonic() + 30
    stuck = ring._acquire("hung", (0, 0), 8, far)  # held, like a broadcast that never ends
    for b in (1, 2, 3):
        with ring.hold("a", (0, b), host[b], far), ring.hold("b", (0, b), host[b], far):
            assert ring.holders() == {(0, 0): {"hung"}, (0, b): {"a", "b"}}
    with ring.hold("a", (0, 1), host[1], far):
        with pytest.raises(TimeoutError, match="no device buffer freed"):
            with ring.hold("b", (0, 2), host[2], time.monotonic() + 0.2):
                pass
    assert stuck.holders == {"hung"}
    ring.release("hung")  # close_channel
    with ring.hold("b", (0, 2), host[2], far), ring.hold("c", (0, 3), host[3], far):
        assert ring.holders() == {(0, 2): {"b"}, (0, 3): {"c"}}


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
