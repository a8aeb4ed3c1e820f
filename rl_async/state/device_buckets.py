"""The buckets a GPU sender broadcasts from: a few device buffers that channels share.

A snapshot lives in (pinned) host memory; a bucket is broadcast from device memory. Channels
progress independently (rl_async/state/sender.py), so at one moment channels may want
different buckets. Each bucket in flight holds one slot, shared by every channel sending that
bucket; a slot is refilled only once no channel holds it. With two slots, a channel stuck on
bucket b holds one slot and the others go on through the second: a hung engine costs its own
channel, not the fleet's transfer. A channel waits for a slot no longer than its own deadline.

On a CPU sender the host bucket is the buffer the collective reads: nothing is copied.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

# the memory plan's `publication` term counts this many buckets
from rl_async.plan.memory import PUBLICATION_DEVICE_BUCKETS as DEVICE_SLOTS


@dataclass
class _Slot:
    buffer: torch.Tensor
    key: tuple | None = None
    holders: set[str] = field(default_factory=set)
    ready: bool = False


class DeviceBuckets:
    def __init__(self, device: torch.device, slots: int = DEVICE_SLOTS):
        if slots < 1:
            raise ValueError(f"slots = {slots}: at least one device buffer is needed")
        self.device, self.max_slots = device, slots
        self._slots: list[_Slot] = []
        self._cond = threading.Condition()
        self._sends = itertools.count()

    def new_send(self) -> int:
        """A token for one send(): its buckets never match an older send's, whose host
        buffers may since have been reused by another snapshot."""
        return next(self._sends)

    @contextmanager
    def hold(self, channel: str, key: tuple, host: torch.Tensor, deadline: float
             ) -> Iterator[torch.Tensor]:
        """The bucket `host` on the device while `channel` broadcasts it; TimeoutError
        when no slot frees before `deadline` (time.monotonic())."""
        if host.device == self.device:
            yield host
            return
        slot = self._acquire(channel, key, host.numel(), deadline)
        try:
            if not slot.ready:
                self._fill(slot, host)
            yield slot.buffer[:host.numel()]
        finally:
            self.release(channel, slot)

    def _acquire(self, channel: str, key: tuple, nbytes: int, deadline: float) -> _Slot:
        with self._cond:
            while True:
                slot = self._find(key, nbytes)
                if slot is None:  # every slot holds a bucket other channels still send
                    if not self._cond.wait(max(deadline - time.monotonic(), 0)):
                        raise TimeoutError(
                            f"no device buffer freed by the channel's deadline (all "
                            f"{self.max_slots} hold buckets other channels are still sending)")
                    continue
                slot.holders.add(channel)
                if slot.ready or slot.holders == {channel}:
                    return slot  # ready, or this channel copies it in
                # another channel is copying it in: wait for that copy (or its failure)
                self._cond.wait_for(lambda: slot.ready or slot.key != key,
                                    max(deadline - time.monotonic(), 0))
                if slot.ready and slot.key == key:
                    return slot
                slot.holders.discard(channel)
                if time.monotonic() >= deadline:
                    raise TimeoutError("the bucket's copy to the device did not finish by the "
                                       "channel's deadline")

    def _find(self, key: tuple, nbytes: int) -> _Slot | None:
        """The slot holding `key`, else a free one claimed for it (None: all are busy)."""
        for slot in self._slots:
            if slot.key == key:
                return slot
        free = next((s for s in self._slots if not s.holders), None)
        if free is None and len(self._slots) < self.max_slots:
            free = _Slot(torch.empty(0, dtype=torch.uint8, device=self.device))
            self._slots.append(free)
        if free is None:
            return None
        if free.buffer.numel() < nbytes:
            free.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        free.key, free.ready = key, False
        return free

    def _fill(self, slot: _Slot, host: torch.Tensor) -> None:
        # A blocking copy: every channel thread then broadcasts from a complete buffer,
        # whatever stream it runs on.
        slot.buffer[:host.numel()].copy_(host)
        with self._cond:
            slot.ready = True
            self._cond.notify_all()

    def release(self, channel: str, slot: _Slot | None = None) -> None:
        """`channel` no longer reads `slot` (every slot it holds when None: a closed
        channel whose thread is abandoned gives its slot back)."""
        with self._cond:
            for s in ([slot] if slot is not None else self._slots):
                s.holders.discard(channel)
                if not s.ready:
                    s.key = None  # a copy that failed or was given up: nobody may share it
            self._cond.notify_all()

    def holders(self) -> dict[tuple, set[str]]:
        """{bucket key: channels holding it} (tests, diagnosis)."""
        with self._cond:
            return {s.key: set(s.holders) for s in self._slots if s.holders}
