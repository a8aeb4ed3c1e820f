"""torch.distributed helpers for the data-parallel trainer (gloo on CPU, NCCL on GPU).

The trainers' default group forms around a TCPStore that rank 0 hosts (`host_store`): its
port is bound once and kept, so no other process can take it between choosing the port and
binding it (a probed free port, closed and bound again by init_process_group, could be
taken in between), and the other ranks join it at tcp://addr:port.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from rl_async.state.collective import create_store


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def trainer_backend(trainer_gpus: int) -> str:
    """The trainers' backend from cluster.trainer_gpus, never from whether CUDA happens to
    be visible: CPU DDP trainers on a GPU node must all-reduce CPU tensors over gloo."""
    return default_backend("cuda" if trainer_gpus else "cpu")


def host_store(timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, on an ephemeral port bound once (`.port`)."""
    return create_store(timeout_s)


def init_distributed(master_addr: str, master_port: int, rank: int, world_size: int,
                     backend: str, timeout_s: float = 600.0,
                     store: dist.Store | None = None) -> None:
    """Initialise the default process group (the trainer's data-parallel group).

    Called once per trainer process (e.g. by the Ray trainer actor) before `TorchTrainer`.
    Rank 0 passes the `store` it hosts (host_store); the others reach it at
    master_addr:master_port. `backend` is explicit ("gloo" or "nccl": trainer_backend).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: call "
                           "init_distributed once per trainer process")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend = {backend!r}: 'gloo' (CPU trainers) or 'nccl' (GPU)")
    timeout = timedelta(seconds=timeout_s)
    if store is not None:  # the prefix init_process_group gives a store it made itself
        store.set_timeout(timeout)
        dist.init_process_group(backend=backend, store=PrefixStore("default_pg", store),
                                rank=rank, world_size=world_size, timeout=timeout)
        return
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timeout)


def is_distributed(world_size: int) -> bool:
    """True when gradients must be reduced across `world_size` > 1 ranks."""
    if world_size <= 1:
        return False
    if not dist.is_initialized():
        raise RuntimeError(f"world_size = {world_size} but torch.distributed is not initialised: "
                           f"call rl_async.train.distributed.init_distributed first")
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"world_size = {world_size} but the default process group has "
                           f"{dist.get_world_size()} ranks: pass the group's size")
    return True


def reduce_stats(sums: Mapping[str, float], maxes: Mapping[str, float], world_size: int,
                 device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """Sum `sums` and take the max of `maxes` over all ranks (identity on one rank)."""
    if not is_distributed(world_size):
        return dict(sums), dict(maxes)
    sum_keys, max_keys = sorted(sums), sorted(maxes)
    s = torch.tensor([float(sums[k]) for k in sum_keys], dtype=torch.float64, device=device)
    m = torch.tensor([float(maxes[k]) for k in max_keys], dtype=torch.float64, device=device)
    if sum_keys:
        dist.all_reduce(s, op=dist.ReduceOp.SUM)
    if max_keys:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return (dict(zip(sum_keys, s.tolist())), dict(zip(max_keys, m.tolist())))


def check_same_on_all_ranks(name: str, value: int, world_size: int,
                            device: torch.device) -> None:
    """Raise on every rank when ranks disagree on `value` (a mismatch would hang DDP)."""
    if not is_distributed(world_size):
        return
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, lo = int(t[0]), -int(t[1])
    if hi != lo:
        raise ValueError(f"{name} differs across trainer ranks (between {lo} and {hi}): every "
                         f"rank must receive a shard of the same size")
