"""torch.distributed helpers for the data-parallel trainer (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(master_addr: str, master_port: int, rank: int, world_size: int,
                     backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialise the default process group (the trainer's data-parallel group).

    Called once per trainer process (e.g. by the Ray trainer actor) before `TorchTrainer`.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: call "
                           "init_distributed once per trainer process")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


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
