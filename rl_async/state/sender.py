"""Trainer rank 0's side of weight publication: snapshots, and one channel per engine.

    stage(named tensors)    -> the STAGED snapshot: flat buckets in the engines' dtype. GPU
                               trainers keep it in (pinned) host memory, so the GPU holds
                               one bucket at a time while sending, never a model copy.
    open_channel/join       -> one process group per engine incarnation: trainer rank 0 plus
                               that engine's TP ranks, under a name the fleet chose and
                               passes in every call (no implicit "current group").
    send(names, which)      -> every bucket of the staged (or the last PUBLISHED) snapshot
                               to each named channel. A channel whose broadcast fails or
                               misses its deadline is reported and destroyed; the others
                               go on: one engine's death never stalls another's transfer.
    commit()                -> staged becomes published: what a catch-up sends. A catch-up
                               therefore never sees a snapshot half-rewritten by the next
                               stage() (the buffers of the older one are reused only then).

Every channel has its own worker thread: a collective that blocks its thread (an NCCL
communicator's first use waits for its peer) blocks only that channel, and the sender gives
up on it at the deadline. The cost of isolation is bandwidth: rank 0 sends the model once
per engine instead of once per fleet (docs/gpu.md says when that matters).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_async.state import collective
from rl_async.state.weights import (flatten_bucket, require_finite, unflatten_bucket,
                                    weights_checksum)

Meta = tuple[list[str], list[str], list[list[int]], int]  # names, dtypes, shapes, bytes


@dataclass
class Snapshot:
    buckets: list[torch.Tensor]  # one flat uint8 buffer per bucket
    metas: list[Meta]
    flat: bool                   # one broadcast per bucket, or one per tensor (SGLang)
    checksum: str | None

    @property
    def nbytes(self) -> int:
        return sum(m[3] for m in self.metas)


class PublicationSender:
    def __init__(self, backend: str, device: str = "cpu"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend = {backend!r}: 'gloo' or 'nccl'")
        self.backend = backend
        self.device = torch.device(device)  # where the collectives run
        self.staged: Snapshot | None = None
        self.published: Snapshot | None = None
        self._spare: list[torch.Tensor] = []  # buffers of a superseded snapshot, reused
        self._device_buffer: torch.Tensor | None = None
        self._pending: dict[str, tuple[dist.Store, float]] = {}  # opened, not joined yet
        self._channels: dict[str, ThreadPoolExecutor] = {}

    # ---- channels -------------------------------------------------------------------------
    def open_channel(self, name: str, timeout_s: float) -> int:
        """Host the rendezvous of channel `name`; returns the port the engine joins on."""
        if name in self._pending or name in self._channels:
            raise ValueError(f"channel {name!r} is already open; channel names are per "
                             f"engine incarnation and never reused")
        store = collective.create_store(timeout_s)
        self._pending[name] = (store, timeout_s)
        return store.port

    def join_channel(self, name: str, world_size: int) -> None:
        """Join channel `name` as rank 0; blocks until the engine's ranks joined (gloo) or
        returns at once (NCCL creates its communicator at the first broadcast)."""
        store, timeout_s = self._pending.pop(name)
        collective.init_custom_process_group(self.backend, None, world_size, 0, name,
                                             timeout_s, store=store)
        self._channels[name] = ThreadPoolExecutor(1, thread_name_prefix=f"pub-{name}")

    def close_channel(self, name: str) -> None:
        """Destroy channel `name` (an NCCL group is aborted); unknown names are ignored, so
        the fleet may close a channel the sender already closed after a failure."""
        self._pending.pop(name, None)
        executor = self._channels.pop(name, None)
        if executor is None:
            return
        collective.destroy_group(name)
        executor.shutdown(wait=False, cancel_futures=True)  # a stuck thread is abandoned

    def channels(self) -> list[str]:
        return sorted(self._channels)

    # ---- snapshots -----------------------------------------------------------------------
    def stage(self, named, dtype: torch.dtype, bucket_bytes: int, flat: bool,
              checksum: bool = False) -> list[Meta]:
        """Copy the weights, as `dtype`, into the staged snapshot's flat buckets. `named`
        may be a generator: at most one bucket's tensors are held beside the snapshot."""
        host = "cpu"
        pin = self.device.type == "cuda"
        buckets, metas = [], []
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
        self.staged = Snapshot(buckets, metas, flat, digest)
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
        if self.published is not None:
            self._spare.extend(self.published.buckets)
        self.published, self.staged = self.staged, None

    def snapshot(self, which: str) -> Snapshot:
        snap = {"staged": self.staged, "published": self.published}[which]
        if snap is None:
            raise RuntimeError(f"no {which} snapshot: stage() (and commit() for 'published') "
                               f"before sending it")
        return snap

    # ---- sending ---------------------------------------------------------------------------
    def send(self, names: list[str], which: str, timeout_s: float) -> tuple[int, dict[str, str]]:
        """Every bucket of the `which` snapshot to each channel in `names`; each bucket has
        `timeout_s` on each channel. Returns (bytes per engine, {channel: error}) for the
        channels that failed (they are destroyed)."""
        snap = self.snapshot(which)
        unknown = [n for n in names if n not in self._channels]
        if unknown:
            raise KeyError(f"channels {unknown} are not joined by trainer rank 0 (joined: "
                           f"{self.channels()}); the fleet must name a channel it formed")
        live, failures = list(names), {}
        for i, (flat_host, meta) in enumerate(zip(snap.buckets, snap.metas)):
            if not live:
                break
            flat_t = self._on_device(flat_host)
            tensors = [flat_t] if snap.flat else [t for _, t in unflatten_bucket(flat_t, *meta[:3])]
            deadline = time.monotonic() + timeout_s
            where = f"bucket {i + 1}/{len(snap.buckets)}"
            futures = {n: self._channels[n].submit(self._broadcast, n, tensors, deadline, where)
                       for n in live}
            for n, future in futures.items():
                try:
                    future.result(timeout=max(deadline - time.monotonic(), 0) + 1.0)
                except FutureTimeout:
                    failures[n] = f"{where} not sent within {timeout_s:g} s"
                except Exception as exc:  # noqa: BLE001 -- reported per channel
                    failures[n] = f"{where}: {type(exc).__name__}: {exc}"
            for n in failures:
                if n in live:
                    live.remove(n)
                    self.close_channel(n)
        return snap.nbytes, failures

    def _broadcast(self, name: str, tensors: list[torch.Tensor], deadline: float,
                   where: str) -> None:
        group = collective.get_group(name)
        works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
        for work in works:
            collective.wait(work, deadline, f"channel {name} {where}", self.backend)

    def _on_device(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket where the collectives run: as is on CPU, copied into one reused device
        buffer on GPU (the previous bucket's broadcasts have completed by now)."""
        if flat.device == self.device:
            return flat
        n = flat.numel()
        if self._device_buffer is None or self._device_buffer.numel() < n:
            self._device_buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
        out = self._device_buffer[:n]
        out.copy_(flat, non_blocking=True)
        return out
