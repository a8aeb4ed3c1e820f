"""Weight updates of the embedded engine: from a collective group or from tensors.

A mixin of `EmbeddedEngine` (split out to keep files small). Buckets arrive flat over the
publication group (rl_async.state.collective); after the first load of a bucket the parameters
ARE views into its receive buffer, so later publications land in the weights with no copy.
"""

from __future__ import annotations

import asyncio

import torch

from rl_async.state import collective
from rl_async.engine.base import EngineError
from rl_async.state.weights import bucket_nbytes, unflatten_bucket


class EngineWeightsMixin:
    """Needs from the engine: `device`, `_params`, `_version`, `_recv_buffers`, `_bound`,
    `_joined` (a set), `_guard()`, `_weights_changed()`, `_retract_running()`."""

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None) -> None:
        # The rendezvous blocks until every rank joined: keep the event loop free meanwhile.
        # The timeout also bounds each receive: gloo cannot abort a pending receive
        # (ProcessGroup.abort/shutdown leave it waiting), so it is the only way out of a
        # broadcast whose sender gave up when another engine died in the middle of it.
        await asyncio.to_thread(collective.init_custom_process_group, backend,
                                f"tcp://{master_address}:{master_port}", world_size,
                                rank_offset, group_name, timeout_s)
        self._joined.add(group_name)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        collective.destroy_group(group_name)
        self._joined.discard(group_name)

    def weight_update_groups(self) -> list[str]:
        return sorted(self._joined)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int | None = None, *,
                                              flush_cache: bool | None = None) -> None:
        """`flush_cache` is moot here: every update retracts running requests and empties
        the prompt cache (`_weights_changed`), so no KV of old weights survives."""
        if group_name not in self._joined:
            raise EngineError(f"update_weights_from_distributed: channel {group_name!r} was "
                              f"never joined by this engine (joined: {self.weight_update_groups()})")
        group = collective.get_group(group_name)
        # Always take part in the broadcast (the sender would hang otherwise); check after.
        # One receive buffer per bucket, kept across publications. After the first load the
        # parameters ARE views into it (zero-copy): later broadcasts land in the weights.
        key = tuple(names)
        flat = self._recv_buffers.get(key)
        if flat is None:
            flat = self._recv_buffers[key] = torch.empty(
                bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=self.device)
        if key in self._bound:
            # The bucket is the weights: receive under the guard, so no step ever runs on a
            # half-written bucket, then finish the update as update_weights_from_tensor does.
            async with self._guard():
                await asyncio.to_thread(torch.distributed.broadcast, flat, group=group,
                                        group_src=0)
                self._set_version(weight_version)
                self._weights_changed()
                self._retract_running()
            return
        # Receive outside the lock (generation may go on); load under it, between two steps.
        await asyncio.to_thread(torch.distributed.broadcast, flat, group=group, group_src=0)
        named = unflatten_bucket(flat, names, dtypes, shapes)
        await self.update_weights_from_tensor(named, weight_version)
        self._bind(key, named)

    def _bind(self, key: tuple[str, ...], named: list) -> None:
        """Make the parameters views into the receive buffer when every tensor is a view of
        the same dtype, shape and device (no clone was needed), so later loads are free."""
        views = [(self._params[n], t) for n, t in named]
        if all(t._base is not None and t.dtype == p.dtype and t.shape == p.shape
               and t.device == p.device for p, t in views):
            with torch.no_grad():
                for p, t in views:
                    p.data = t
            self._bound.add(key)

    def _check_version(self, weight_version: int | None) -> None:
        if weight_version is not None and (not isinstance(weight_version, int)
                                           or weight_version < self._version):
            raise ValueError(f"weight_version = {weight_version!r}: must be an int >= the "
                             f"current version {self._version} (versions only increase)")

    def _set_version(self, weight_version: int | None) -> None:
        self._check_version(weight_version)
        if weight_version is not None:
            self._version = weight_version

    async def update_weights_from_tensor(self, named_tensors: list,
                                         weight_version: int | None = None) -> None:
        """Copy `(hf_name, tensor)` pairs into the parameters; set the version when given
        (None keeps it: several buckets of one publication pass the version on any of them).
        Running requests are retracted so no KV of the old weights is reused."""
        named_tensors = list(named_tensors)
        self._check_names([n for n, _ in named_tensors], [list(t.shape) for _, t in named_tensors])
        async with self._guard():
            self._set_version(weight_version)
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if self._params[name].data_ptr() != tensor.data_ptr():
                        self._params[name].copy_(tensor.to(self.device))
            self._weights_changed()
            self._retract_running()

    def _check_names(self, names: list[str], shapes: list[list[int]]) -> None:
        """Validate the whole bucket before copying anything, so a bad one changes nothing."""
        for name, shape in zip(names, shapes, strict=True):
            if name not in self._params:
                raise EngineError(f"weight update: parameter {name!r} is not in the engine's "
                                  f"model (e.g. {sorted(self._params)[:3]}); names must be "
                                  f"the HF names of the same architecture")
            if list(self._params[name].shape) != [int(d) for d in shape]:
                raise EngineError(f"weight update: {name!r} has shape {list(shape)}, the "
                                  f"engine's is {list(self._params[name].shape)}")

