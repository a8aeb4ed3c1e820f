"""torch.distributed process groups for weight publication that are NOT the default group.

The trainer's rank 0 may already use the default group for DDP, and an engine process has no
default group at all, so a publication group is created directly with
`_new_process_group_helper` over its own TCPStore rendezvous, under a prefixed store so
several groups can share one store. The same approach as SGLang's
`init_custom_process_group` and torch's own `init_process_group` internals; checked against
torch 2.13. Ranks in the group are used as-is (rank 0 = the trainer's publisher).

The publisher (rank 0) hosts the store: `create_store` binds an ephemeral port ONCE and
keeps it, so no other process can take the port between a free-port probe and the bind
(the old bind-close-rebind race). Members join with `tcp://host:port`.

Collectives on a returned group must use `group_src=` / `group_dst=` (group ranks); the
group is also registered with identity rank mapping so a plain `src=` works too.

NCCL (see docs/gpu.md, "Weight publication over NCCL"): both ends of a channel run with
`NCCL_ENV`: `NCCL_CUMEM_ENABLE=0` is what SGLang sets in its own processes
(`_set_envs_and_config`), and the two ends of a communicator must agree (NeMo-RL #564,
SkyRL #143, verl #5522). The processes rl-async owns (trainers, embedded GPU engines) also
get `TORCH_NCCL_ASYNC_ERROR_HANDLING=2` (CleanUpOnly): torch's watchdog then aborts a
communicator whose collective timed out or failed and reports an error, instead of its
default (3, SkipCleanUp) of tearing down the whole process: a broadcast stuck on one dead
engine must be an error trainer rank 0 handles, not the end of trainer rank 0. The sender
also polls each broadcast against its own deadline (`wait`) and aborts the group itself,
so it never waits for the watchdog.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}
OWN_PROCESS_NCCL_ENV = {**NCCL_ENV, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

_GROUPS: dict[str, tuple[dist.ProcessGroup, str, timedelta]] = {}  # name -> group


def _timedelta(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return timedelta(minutes=5)
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def create_store(timeout: timedelta | float | None = None) -> dist.TCPStore:
    """The rendezvous store a publisher hosts, on an ephemeral port bound once (`.port`)."""
    return dist.TCPStore("0.0.0.0", 0, None, True, _timedelta(timeout),
                         wait_for_workers=False)


def init_custom_process_group(backend: str, init_method: str | None, world_size: int,
                              rank: int, group_name: str,
                              timeout: timedelta | float | None = None,
                              store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join the group `group_name` of `world_size` ranks as `rank`; blocks until all joined.

    `init_method` is a `tcp://host:port` URL (the publisher's store); the publisher passes
    its own `store` from `create_store` instead. `timeout` (seconds or a timedelta; default
    5 minutes) bounds the rendezvous and every collective on the group.
    """
    if group_name in _GROUPS:
        raise ValueError(f"group_name = {group_name!r}: this process already joined a group of "
                         f"that name; destroy_group() it first or use another name")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank!r}: must be in [0, world_size = {world_size})")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend = {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    timeout = _timedelta(timeout)
    if store is None:
        if init_method is None:
            raise ValueError("init_custom_process_group: give init_method or store")
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size,
                                                       timeout=timeout))
    store.set_timeout(timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, prefixed, group_name=group_name, timeout=timeout)
    # Identity mapping so `src=0` means group rank 0 even without a default group.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _GROUPS[group_name] = (group, backend, timeout)
    return group


def get_group(group_name: str) -> dist.ProcessGroup:
    if group_name not in _GROUPS:
        raise KeyError(f"group_name = {group_name!r}: not joined in this process; joined: "
                       f"{sorted(_GROUPS)}; call init_weights_update_group first")
    return _GROUPS[group_name][0]


def group_backend(group_name: str) -> tuple[str, float]:
    """(backend, timeout in seconds) of a joined group."""
    get_group(group_name)
    _, backend, timeout = _GROUPS[group_name]
    return backend, timeout.total_seconds()


def joined_groups() -> list[str]:
    """The publication groups this process is a member of (tests check none leak)."""
    return sorted(_GROUPS)


def destroy_group(group_name: str) -> None:
    """Leave and destroy the group; unknown names are an error (a typo must not pass). An
    NCCL group is aborted, so a collective stuck on a dead peer does not block it. A gloo
    group cannot abort a pending operation: destroying it would wait for the operation's
    own timeout WITH the GIL held, stalling every thread of the process. So it is forgotten
    at once and destroyed once that timeout has passed (then nothing is pending)."""
    group = get_group(group_name)
    _, backend, timeout = _GROUPS.pop(group_name)
    if backend == "nccl":
        c10d._abort_process_group(group)
        return
    timer = threading.Timer(timeout.total_seconds() + 1.0, dist.destroy_process_group, (group,))
    timer.daemon = True
    timer.start()


def wait(work, deadline: float, what: str, backend: str) -> None:
    """Wait for an async collective until `deadline` (time.monotonic()); raise naming
    `what` past it or on the collective's own error. Gloo waits with a timeout; an NCCL
    wait would only order streams, so NCCL polls `is_completed`, then `wait()` surfaces
    the collective's own error, if it had one."""
    remaining = deadline - time.monotonic()
    if backend == "gloo":
        try:
            work.wait(timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as exc:
            raise RuntimeError(f"{what}: {exc}") from exc
        return
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not complete by its deadline")
        time.sleep(0.001)
    work.wait()
