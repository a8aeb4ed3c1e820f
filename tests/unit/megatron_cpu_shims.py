"""Test-only shims that let megatron-core's GPTModel run forward/backward on a CPU.

megatron-core 0.16 assumes CUDA in three places the model touches: the RNG tracker
(`get_cuda_rng_tracker().fork()` around dropout, `model_parallel_cuda_manual_seed`), and
`torch.cuda.current_device()` (rotary frequencies, the global memory buffer). These shims
replace exactly those with CPU equivalents for the duration of a test. Never product code.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


class CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker: forks the CPU generator's state."""

    def is_initialized(self) -> bool:
        return True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def megatron_cpu(monkeypatch):
    """megatron-core parallel state for one gloo process on CPU, with the CUDA shims applied."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRngTracker()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    monkeypatch.setattr(mrandom, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed",
                        lambda seed, *a, **k: torch.manual_seed(seed))
    created = not dist.is_initialized()
    if created:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
