"""Checkpoints of the megatron-core trainer: one file per rank (model shard, optimizer,
the distributed optimizer's parameter state, step, policy version, RNG states).

    save: rank r writes <dir>/megatron_rank<r>/trainer_state.pt (atomic, trainer_state.py)
    load: the same layout (world size, TP, PP) reads its own file back

The distributed optimizer's parameter state (fp32 main params and Adam moments, this rank's
shard) goes through `get_parameter_state_dp_reshardable` / `load_parameter_state_from_dp_
reshardable`. In megatron-core 0.16.1 the getter never sets the `padding` key the loader
filters on (distrib_optimizer.py: only `sharded_param_state_dp_reshardable`, the
dist-checkpointing path, adds it), so a resume raised `KeyError: 'padding'` on every rank.
The getter emits exactly one entry per parameter (no padding entries), so every entry is
marked `padding = False` before loading. megatron's dist_checkpointing (sharded state dicts,
resharding across layouts) is the way to lift the same-layout restriction; its torch_dist
writer spawns processes and its fully_reshardable format moves state through CUDA, so it is
not used here yet (docs/engines-and-trainers.md).

The same loader, without Apex or Transformer Engine (a plain torch Adam), shares one `step`
tensor among all parameters' states: see `_unshare_step_counters`.

RNG: Python, torch (CPU and CUDA) and megatron's model-parallel CUDA RNG tracker (the
dropout streams; dropout is off in RL fine-tuning, but a resumed run must continue every
stream) are saved and restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_async.state.trainer_state import load_state, rng_state, save_state, set_rng_state
from rl_async.train import megatron_model as mm


def _rank_dir(directory: str | Path) -> Path:
    return Path(directory) / f"megatron_rank{dist.get_rank():05d}"


def _distributed_parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer(s) inside megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _tracker_states() -> dict | None:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    return tracker.get_states() if hasattr(tracker, "get_states") else None


def save(trainer: Any, directory: str | Path, extra: dict[str, Any]) -> Path:
    state: dict[str, Any] = {
        "model": {k: v.detach().cpu() for k, v in mm._tensor_state(trainer.model.module).items()},
        "optimizer": trainer.optimizer.state_dict(),
        "step": trainer.step, "policy_version": trainer.policy_version, "extra": extra,
        "layout": trainer.layout(),
        "rng": {**rng_state(), "megatron_tracker": _tracker_states()},
    }
    if trainer.cfg.use_distributed_optimizer:
        # This rank's shard of fp32 main params and Adam moments, in bucket order.
        state["param_state"] = [opt.get_parameter_state_dp_reshardable()
                                for opt in _distributed_parts(trainer.optimizer)]
    return save_state(_rank_dir(directory), state)


def load(trainer: Any, directory: str | Path) -> dict[str, Any]:
    state = load_state(_rank_dir(directory), map_location="cpu")
    if state["layout"] != trainer.layout():
        raise ValueError(f"checkpoint layout {state['layout']} differs from this run's "
                         f"{trainer.layout()}: resume with the same cluster.trainer_workers "
                         f"and train.tensor_parallel / train.pipeline_parallel")
    with torch.no_grad():
        for name, t in mm._tensor_state(trainer.model.module).items():
            t.copy_(state["model"][name])
    trainer.optimizer.load_state_dict(state["optimizer"])
    _unshare_step_counters(trainer.optimizer)
    for opt, param_state in zip(_distributed_parts(trainer.optimizer),
                                state.get("param_state", [])):
        # no_grad: with fp32 params the main params ARE views of the model's (leaf)
        # parameters, and the loader copies into them in place (its siblings are decorated
        # @torch.no_grad(); this one is not, in 0.16.1)
        with torch.no_grad():
            opt.load_parameter_state_from_dp_reshardable(_with_padding_flags(param_state))
    trainer.step, trainer.policy_version = state["step"], state["policy_version"]
    rng = state.get("rng")
    if rng is not None:
        set_rng_state(rng)
        if rng.get("megatron_tracker") is not None:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(rng["megatron_tracker"])
    return state["extra"]


def _unshare_step_counters(optimizer: Any) -> None:
    """Without Apex or Transformer Engine, megatron-core 0.16.1's DistributedOptimizer.
    load_state_dict gives every parameter's state the SAME `step` tensor; torch's Adam
    increments `state["step"]` in place once per parameter per step, so after a resume the
    shared counter ran ahead by the number of parameters at every step and Adam's bias
    correction went wrong. Each parameter gets its own copy back."""
    for part in _distributed_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        for s in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(s.get("step")):
                s["step"] = s["step"].clone()


def _with_padding_flags(param_state: dict) -> dict:
    """Mark every entry `padding = False` (see the module docstring)."""
    for key, per_dtype in param_state.items():
        if not isinstance(key, int):  # per_bucket_numel(_unpadded): metadata
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return param_state
