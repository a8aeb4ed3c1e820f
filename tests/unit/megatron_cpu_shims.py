"""Test-only shims that let megatron-core's GPTModel train on a CPU.

megatron-core 0.16 assumes CUDA in a few places: the RNG tracker (`get_cuda_rng_tracker().
fork()` around dropout, `model_parallel_cuda_manual_seed`), `torch.cuda.current_device()`
(rotary frequencies, the global memory buffer, DDP buffers), `torch.cuda.synchronize()`
(pipeline send/receive), and in the optimizer: scalar
tensors created with `device='cuda'` (also in the schedules) and an assertion that gradients are
`torch.cuda.FloatTensor` in `clip_grad_by_total_norm_fp32`, and the CUDA RNG state that
activation recompute saves around each checkpointed piece. These shims replace exactly
those with CPU equivalents (the optimizer, grad-clip and schedule modules see a `torch` whose tensor factories map
'cuda' to 'cpu'; the clip is the same arithmetic without the assertion). The distributed
optimizer checks `param.type() == 'torch.cuda.FloatTensor'` when it builds its shards
(distrib_optimizer.py `_build_model_and_main_param_groups`): a parameter's `type()` here
answers with the CUDA name of its dtype, so it runs on CPU too (the same buckets, shards and
checkpoint format as on a GPU). The MoE alltoall dispatcher copies its split sizes to the host
on a side CUDA stream (token_dispatcher.py `_maybe_dtoh_and_synchronize`): on CPU there is
nothing to copy, so a stream that does nothing stands in, and the split sizes become the
numpy arrays all_to_all_single takes (`maybe_move_tensor_to_cpu` converts only CUDA tensors). Never product code.
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

    def get_states(self) -> dict:  # one stream on CPU: nothing beyond the generator's state
        return {}

    def set_states(self, states: dict) -> None:
        pass

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)


class CpuStream:
    """Stands in for a torch.cuda.Stream (and its event): one CPU stream, nothing to wait for."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> CpuStream:
        return self

    def synchronize(self) -> None:
        pass


def _split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu for CPU tensors: numpy where asked, as on a GPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CpuTorch:
    """`torch` as megatron's optimizer module sees it: tensor factories map 'cuda' to 'cpu'."""

    _FACTORIES = ("tensor", "zeros", "empty", "ones", "full")

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args, **kwargs):
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)
        return factory


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA type assertion."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            grad = p.decoupled_grad if use_decoupled_grad else p.grad
            if grad is not None:
                grad.detach().mul_(coeff)


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    """`Parameter.type()` with no argument: the CUDA tensor type's name of its dtype."""
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
        return name
    return "torch.cuda." + name.removeprefix("torch.")


def apply_cpu_shims(setattr_=setattr) -> None:
    """Install the shims; `setattr_` is monkeypatch.setattr in a fixture (undone after the
    test) or plain setattr in a spawned worker process (which exits afterwards)."""
    from megatron.core import tensor_parallel
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    tracker = CpuRngTracker()
    setattr_(torch.cuda, "current_device", lambda: torch.device("cpu"))
    setattr_(torch.cuda, "synchronize", lambda *a, **k: None)  # pipeline p2p shape exchange
    main_stream = CpuStream()
    setattr_(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", CpuStream())
    setattr_(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_to_host)
    setattr_(torch.cuda, "current_stream", lambda *a, **k: main_stream)
    setattr_(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    setattr_(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    setattr_(mrandom, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    setattr_(tensor_parallel, "model_parallel_cuda_manual_seed",
             lambda seed, *a, **k: torch.manual_seed(seed))
    # Scalars made with device='cuda' (utils: the local multi-tensor l2 norm).
    for module in (moptimizer, clip_grads, schedules, mutils):
        setattr_(module, "torch", _CpuTorch())
    setattr_(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu)
    setattr_(torch.nn.Parameter, "type", _cuda_type_name)  # the distributed optimizer's check
    # Activation recompute saves and restores the CUDA RNG state around each checkpointed
    # piece (tensor_parallel/random.py `_get_all_rng_states`): the CPU generator's here.
    setattr_(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    setattr_(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))


@pytest.fixture
def megatron_cpu(monkeypatch):
    """megatron-core parallel state for one gloo process on CPU, with the CUDA shims applied."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    apply_cpu_shims(monkeypatch.setattr)
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
