"""Trainer rank 0's side of weight publication: snapshots, and one channel per engine.

    stage(named tensors)    -> the STAGED snapshot: flat buckets in the engines' dtype. GPU
                               trainers keep it in (pinned) host memory; the device holds at
                               most DEVICE_SLOTS buckets while sending, never a model copy.
    open_channel/join       -> one process group per engine incarnation: trainer rank 0 plus
                               that engine's TP ranks, under a name the fleet chose and
                               passes in every call (no implicit "current group"). Joins run
                               on each channel's own thread, concurrently: a replacement that
                               never joins does not hold up another's rendezvous.
    send(names, which)      -> every bucket of the staged (or the last PUBLISHED) snapshot
                               to each named channel. Each channel goes through the buckets
                               at its own pace, on its own thread, each bucket within
                               `timeout_s` and the whole snapshot within `total_s`. A channel
                               that fails or misses a deadline is reported and destroyed; the
                               others are not held back by it (a hung engine holds one device
                               slot, the others share the other). What it costs them is the
                               wait for the send() call to return: up to the failed
                               channel's deadline, since the fleet learns every channel's
                               outcome from that one reply.
    commit()                -> staged becomes published: what a catch-up sends. A catch-up
                               therefore never sees a snapshot half-rewritten by the next
                               stage() (the buffers of the older one are reused only then).

Who failed: a channel's failure is the ENGINE's (reported by name, that engine is lost) only
when it looks like a peer that went away or stopped answering: a deadline, a reset or closed
connection, a remote NCCL error, or the fleet closing the channel. Anything else raised in a
channel thread (a bug, a CUDA error on rank 0) is the trainer's, and so is the same error on
every channel at the same bucket: send() raises TrainerSideError, and the run stops naming
trainer rank 0 instead of restarting every engine.

The channel dicts are shared with the fleet's calls on other actor threads (a CPU trainer
runs a publication beside training; an engine lost outside a publication closes its channel
then): they change only under `_lock`, and a channel closed mid-send fails that channel only.
Sent to every engine, the cost of isolation is bandwidth: rank 0 sends the model once per
engine; with the relay (rl_async/engine/relay.py) it sends once, to the head of a chain, in
pieces (`chunk_bytes`). `bytes_sent` counts what it sent.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_async.state import collective
from rl_async.state.device_buckets import DeviceBuckets
from rl_async.state.weights import (bucket_fingerprint, flatten_bucket, model_digest, pieces,
                                    require_finite, unflatten_bucket, weights_checksum)

Meta = tuple[list[str], list[str], list[list[int]], int]  # names, dtypes, shapes, bytes


@dataclass
class Snapshot:
    buckets: list[torch.Tensor]  # one flat uint8 buffer per bucket
    metas: list[Meta]
    flat: bool                   # one broadcast per bucket, or one per tensor (SGLang)
    checksum: str | None         # weights_checksum (publication.verify_checksum)
    fingerprints: list[str]      # bucket_fingerprint of each bucket: engines check theirs
    digest: str                  # model_digest: what a staged engine must hold to commit

    @property
    def nbytes(self) -> int:
        return sum(m[3] for m in self.metas)


class TrainerSideError(RuntimeError):
    """A publication failed on trainer rank 0's side: fatal, never blamed on an engine."""


class ChannelClosed(RuntimeError):
    """The fleet closed the channel (its engine was lost) while it was sending."""


class ChannelFailure(Exception):
    """One channel's send failed: where, and the cause."""

    def __init__(self, bucket: int, where: str, cause: BaseException):
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")
        self.bucket, self.where, self.cause = bucket, where, cause


# Text of errors that mean the peer went away or stopped answering (gloo's pair.cc, NCCL's
# ncclRemoteError, socket errors), lower-cased.
_PEER_GONE = ("timed out", "timeout", "closed by peer", "reset by peer", "connection reset",
              "connection closed", "connection refused", "broken pipe",
              "remote process exited", "ncclremoteerror", "communicator was aborted")


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, (TimeoutError, FutureTimeout)) or "timed out" in str(exc).lower()


def engine_side(exc: BaseException) -> bool:
    """Whether a channel error is the engine's: it went away or stopped answering."""
    if isinstance(exc, (TimeoutError, FutureTimeout, ConnectionError, ChannelClosed)):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_GONE)


class PublicationSender:
    def __init__(self, backend: str, device: str = "cpu"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend = {backend!r}: 'gloo' or 'nccl'")
        self.backend = backend
        self.device = torch.device(device)  # where the collectives run
        self.staged: Snapshot | None = None
        self.published: Snapshot | None = None
        self._spare: list[torch.Tensor] = []  # buffers of a superseded snapshot, reused
        # The provenance audit keeps published snapshots (rl_async/train/audit.py): their
        # buffers are then never reused, and no copy is needed.
        self.retain_published = False
        self.bytes_sent = 0  # over every channel, since the start
        self._on_device = DeviceBuckets(self.device)
        self._lock = threading.Lock()  # the two dicts below change only under it
        self._pending: dict[str, tuple[dist.Store, float, ThreadPoolExecutor]] = {}  # opened
        self._channels: dict[str, ThreadPoolExecutor] = {}  # joined

    # ---- channels -------------------------------------------------------------------------
    def open_channel(self, name: str, timeout_s: float) -> int:
        """Host the rendezvous of channel `name`; returns the port the engine joins on."""
        with self._lock:
            if name in self._pending or name in self._channels:
                raise ValueError(f"channel {name!r} is already open; channel names are per "
                                 f"engine incarnation and never reused")
            store = collective.create_store(timeout_s)
            thread = ThreadPoolExecutor(1, thread_name_prefix=f"pub-{name}")
            self._pending[name] = (store, timeout_s, thread)
        return store.port

    def join_channels(self, names: list[str], world_size: int) -> dict[str, str]:
        """Join the opened channels `names` as rank 0, each on its own thread, all at once;
        returns {name: error} for those that failed (closed). Blocks until every join ended
        (gloo: the engine's ranks joined; NCCL: at once, its communicator is created at the
        first broadcast), each within its channel's timeout."""
        with self._lock:
            missing = [n for n in names if n not in self._pending]
            if missing:
                raise KeyError(f"channels {missing} were never opened (or already joined)")
            jobs = {n: (self._pending[n][2].submit(self._join, n, world_size),
                        time.monotonic() + self._pending[n][1]) for n in names}
        failed = {}
        for name, (job, deadline) in jobs.items():
            try:
                job.result(timeout=max(deadline - time.monotonic(), 0) + 1.0)
            except FutureTimeout:
                failed[name] = "joining did not finish within the channel's timeout"
            except Exception as exc:  # noqa: BLE001 -- reported per channel, then closed
                failed[name] = f"joining: {type(exc).__name__}: {exc}"
        for name in failed:
            self.close_channel(name)
        return failed

    def join_channel(self, name: str, world_size: int) -> None:
        """One channel (scripts, tests); raises its failure."""
        failed = self.join_channels([name], world_size)
        if failed:
            raise RuntimeError(f"channel {name!r}: {failed[name]}")

    def _join(self, name: str, world_size: int) -> None:
        with self._lock:
            store, timeout_s, thread = self._pending[name]
        collective.init_custom_process_group(self.backend, None, world_size, 0, name,
                                             timeout_s, store=store)
        with self._lock:
            if self._pending.pop(name, None) is None:  # closed while joining
                collective.destroy_group(name)
                raise ChannelClosed(f"channel {name!r} was closed while it was joined")
            self._channels[name] = thread

    def close_channel(self, name: str) -> None:
        """Destroy channel `name` (an NCCL group is aborted); unknown names are ignored, so
        the fleet may close a channel the sender already closed after a failure. Safe while
        send() runs on another thread: that channel fails, the others go on."""
        with self._lock:
            pending = self._pending.pop(name, None)
            thread = self._channels.pop(name, None)
            if thread is not None:
                collective.destroy_group(name)
        for executor in (thread, pending[2] if pending else None):
            if executor is not None:  # a stuck thread is abandoned
                executor.shutdown(wait=False, cancel_futures=True)
        self._on_device.release(name)

    def channels(self) -> list[str]:
        with self._lock:
            return sorted(self._channels)

    # ---- snapshots -----------------------------------------------------------------------
    def stage(self, named, dtype: torch.dtype, bucket_bytes: int, flat: bool,
              checksum: bool = False) -> list[Meta]:
        """Copy the weights, as `dtype`, into the staged snapshot's flat buckets. `named`
        may be a generator: at most one bucket's tensors are held beside the snapshot."""
        host = "cpu"
        pin = self.device.type == "cuda"
        buckets, metas, fingerprints = [], [], []
        pending: list[tuple[str, torch.Tensor]] = []

        def pack() -> None:
            nbytes = sum(t.numel() * t.element_size() for _, t in pending)
            out = self._buffer(nbytes, host, pin)
            if pending[0][1].device == out.device:
                _, names, dtypes, shapes = flatten_bucket(pending, out=out)
            else:  # device weights: packed on the device (one bucket), one copy to the host
                flat, names, dtypes, shapes = flatten_bucket(pending)
                out.copy_(flat)
            buckets.append(out)
            metas.append((names, dtypes, shapes, nbytes))
            fingerprints.append(bucket_fingerprint(out))
            pending.clear()

        # The splitting rule of weights.bucket_named_tensors (order kept, a new bucket when
        # the next tensor would pass bucket_bytes), applied as tensors arrive.
        size = 0
        for name, tensor in named:
            require_finite(name, tensor, "publication snapshot")
            t = tensor.detach().to(dtype)
            n = t.numel() * t.element_size()
            if pending and size + n > bucket_bytes:
                pack()
                size = 0
            pending.append((name, t))
            size += n
        if pending:
            pack()
        digest = (weights_checksum(n for b, m in zip(buckets, metas)
                                   for n in unflatten_bucket(b, *m[:3]))
                  if checksum else None)
        if self.staged is not None:  # a staged snapshot never sent: its buffers are free
            self._spare.extend(self.staged.buckets)
        self.staged = Snapshot(buckets, metas, flat, digest, fingerprints,
                               model_digest(metas, fingerprints))
        return metas

    def _buffer(self, nbytes: int, device: str, pin: bool) -> torch.Tensor:
        for i, buf in enumerate(self._spare):
            if buf.numel() == nbytes:
                return self._spare.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)

    def commit(self) -> None:
        """The staged snapshot was sent: it is now the published one (catch-ups send it)."""
        if self.staged is None:
            raise RuntimeError("commit: nothing staged")
        if self.published is not None and not self.retain_published:
            self._spare.extend(self.published.buckets)
        self.published, self.staged = self.staged, None

    def recycle(self, buffers: list[torch.Tensor]) -> None:
        """Buffers of a retained snapshot that is no longer kept: reused by the next stage()
        (pinned host memory is slow to allocate)."""
        self._spare.extend(buffers)

    def snapshot(self, which: str) -> Snapshot:
        snap = {"staged": self.staged, "published": self.published}[which]
        if snap is None:
            raise RuntimeError(f"no {which} snapshot: stage() (and commit() for 'published') "
                               f"before sending it")
        return snap

    # ---- sending ---------------------------------------------------------------------------
    def send(self, names: list[str], which: str, timeout_s: float,
             total_s: float | None = None, chunk_bytes: int = 0) -> tuple[int, dict[str, str]]:
        """Every bucket of the `which` snapshot to each channel in `names`, each channel at
        its own pace: each bucket within `timeout_s`, the whole snapshot within `total_s`
        (default: `timeout_s` per bucket). Returns (bytes per engine, {channel: error}) for
        the channels that failed (they are destroyed); raises TrainerSideError when the
        failure is rank 0's own (module docstring)."""
        snap = self.snapshot(which)
        total_s = timeout_s * len(snap.buckets) if total_s is None else total_s
        deadline = time.monotonic() + total_s
        token = self._on_device.new_send()
        with self._lock:
            unknown = [n for n in names if n not in self._channels]
            if unknown:
                raise KeyError(f"channels {unknown} are not joined by trainer rank 0 (joined: "
                               f"{sorted(self._channels)}); the fleet must name a channel it "
                               f"formed")
            jobs = {n: self._channels[n].submit(self._send_channel, n, snap, token, timeout_s,
                                                deadline, chunk_bytes) for n in names}
        failures: dict[str, ChannelFailure] = {}
        for name, job in jobs.items():
            try:
                job.result(timeout=max(deadline - time.monotonic(), 0) + 1.0)
            except FutureTimeout as exc:
                failures[name] = ChannelFailure(-1, f"the snapshot ({len(snap.buckets)} "
                                                    f"buckets) not sent within {total_s:g} s",
                                                exc)
            except ChannelFailure as failure:
                failures[name] = failure
        for name in failures:
            self.close_channel(name)
        _raise_if_trainer_side(failures, len(jobs))
        return snap.nbytes, {n: str(f) for n, f in failures.items()}

    def _send_channel(self, name: str, snap: Snapshot, token: int, timeout_s: float,
                      total_deadline: float, chunk_bytes: int = 0) -> None:
        """One channel's whole transfer, on its own thread; flat buckets in pieces of
        `chunk_bytes` when it heads a relay (rl_async/engine/relay.py)."""
        count = len(snap.buckets)
        for i, (flat_host, meta) in enumerate(zip(snap.buckets, snap.metas)):
            where = f"bucket {i + 1}/{count}"
            deadline = min(time.monotonic() + timeout_s, total_deadline)
            try:
                self._require_open(name)
                with self._on_device.hold(name, (token, i), flat_host, deadline) as flat_t:
                    tensors = (pieces(flat_t, chunk_bytes) if snap.flat
                               else [t for _, t in unflatten_bucket(flat_t, *meta[:3])])
                    self._broadcast(name, tensors, deadline, where)
            except Exception as exc:  # noqa: BLE001 -- classified by send()
                if deadline == total_deadline and _timed_out(exc):  # the total ran out
                    exc = TimeoutError(f"the whole snapshot not sent within its total "
                                       f"deadline ({exc})")
                raise ChannelFailure(i, where, exc) from exc
        try:
            self._require_open(name)  # closed after its last bucket: the fleet lost it
        except ChannelClosed as exc:
            raise ChannelFailure(count - 1, "after the last bucket", exc) from exc

    def _require_open(self, name: str) -> None:
        with self._lock:
            if name not in self._channels:
                raise ChannelClosed(f"channel {name} was closed by the fleet (its engine was "
                                    f"lost) while it was sending")

    def _broadcast(self, name: str, tensors: list[torch.Tensor], deadline: float,
                   where: str) -> None:
        group = collective.get_group(name)
        works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
        for work in works:
            collective.wait(work, deadline, f"channel {name} {where}", self.backend)
        with self._lock:  # what rank 0 sent (the relay's point: once per publication)
            self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)


def _raise_if_trainer_side(failures: dict[str, ChannelFailure], channels: int) -> None:
    """Trainer-side failures are fatal (module docstring): an error that is not a peer's,
    or every channel (two or more) failing at the same bucket with the same error type."""
    if not failures:
        return
    own = {n: f for n, f in failures.items() if not engine_side(f.cause)}
    same = (len(failures) == channels >= 2
            and len({(f.bucket, type(f.cause)) for f in failures.values()}) == 1
            and not isinstance(next(iter(failures.values())).cause,
                               (TimeoutError, FutureTimeout, ChannelClosed)))
    if own or same:
        name, failure = next(iter((own or failures).items()))
        raise TrainerSideError(
            f"weight publication failed on trainer rank 0, not on an engine "
            f"({'every channel failed alike' if same and not own else 'not a peer error'}): "
            f"channel {name} {failure}") from failure.cause
