"""A torch.distributed process group for weight publication that is NOT the default group.

The trainer's rank 0 may already use the default group for DDP, and an engine process has no
default group at all, so the publication group is created directly with
`_new_process_group_helper` over its own TCPStore rendezvous, under a prefixed store so
several groups can share one master port namespace. The same approach as SGLang's
`init_custom_process_group` and torch's own `init_process_group` internals; checked against
torch 2.13. Ranks in the group are used as-is (rank 0 = the trainer's publisher).

Collectives on the returned group must use `group_src=` / `group_dst=` (group ranks); the
group is also registered with identity rank mapping so a plain `src=` works too.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_GROUPS: dict[str, dist.ProcessGroup] = {}


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: timedelta | float | None = None
                              ) -> dist.ProcessGroup:
    """Join the group `group_name` of `world_size` ranks as `rank`; blocks until all joined.

    `init_method` is a `tcp://host:port` URL (rank 0 hosts the store). `timeout` (seconds or
    a timedelta; default 5 minutes) bounds the rendezvous and every collective on the group.
    """
    if group_name in _GROUPS:
        raise ValueError(f"group_name = {group_name!r}: this process already joined a group of "
                         f"that name; destroy_group() it first or use another name")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank!r}: must be in [0, world_size = {world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend = {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if timeout is None:
        timeout = timedelta(minutes=5)
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    # Identity mapping so `src=0` means group rank 0 even without a default group.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _GROUPS[group_name] = group
    return group


def get_group(group_name: str) -> dist.ProcessGroup:
    if group_name not in _GROUPS:
        raise KeyError(f"group_name = {group_name!r}: not joined in this process; joined: "
                       f"{sorted(_GROUPS)}; call init_weights_update_group first")
    return _GROUPS[group_name]


def destroy_group(group_name: str) -> None:
    """Leave and destroy the group; unknown names are an error (a typo must not pass)."""
    group = get_group(group_name)
    dist.destroy_process_group(group)
    del _GROUPS[group_name]
