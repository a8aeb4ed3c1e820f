"""Checkpoints of the megatron-core trainer: one file per rank (model shard, the distributed
optimizer's parameter state, step, policy version, RNG states).

    save: rank r writes <dir>/megatron_rank<r>/trainer_state.pt (atomic, trainer_state.py)
    load: the same layout (world size, TP, PP) reads its own file back

The distributed optimizer's state (this rank's shard of the fp32 main params and the Adam
moments, with each parameter's step) is read with megatron-core's
`get_parameter_state_dp_reshardable`, and written back here, entry by entry, into the main
param and a freshly allocated Adam state of the same shape. megatron-core 0.16.1's own way
back does not work: `load_parameter_state_from_dp_reshardable` filters on a `padding` key the
getter never sets (KeyError on every rank); its `load_state_dict` without Apex or
Transformer Engine gives every parameter's state the SAME `step` tensor (torch's Adam then
increments it once per parameter per step: wrong bias correction after a resume); and with
bf16 params it sizes its placeholder state by the parameter's bucket range while the main
param is its shard range (a size mismatch at load, seen on an H200). The entries follow the
getter's own order (gbuf -> dtype -> bucket -> param_map), so each lands on its parameter.
megatron's dist_checkpointing (resharding across layouts) is the way to lift the
same-layout restriction; not used yet (docs/engines-and-trainers.md).

Where Adam keeps its step depends on the optimizer megatron-core picked: torch's AdamW (no
Transformer Engine or Apex) keeps a `step` in each parameter's state, which the getter
returns with the moments; Transformer Engine's FusedAdam (megatron-core uses it whenever TE
imports: optimizer/__init__.py) keeps ONE `step` per parameter group (`group["step"] += 1`
in FusedAdam.step) and none per parameter, so its entries have no `step` and the group's
must be saved beside them, or a resume restarts the bias correction at step 1. Both are
saved and restored; a checkpoint taken before the first step has no moments at all (the
optimizer then creates them at its first step, as it would have).

RNG: Python, torch (CPU and CUDA) and megatron's model-parallel CUDA RNG tracker are saved
and restored.
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
        "step": trainer.step, "policy_version": trainer.policy_version, "extra": extra,
        "layout": trainer.layout(),
        "rng": {**rng_state(), "megatron_tracker": _tracker_states()},
    }
    if trainer.cfg.use_distributed_optimizer:
        # This rank's shard of fp32 main params and Adam moments, in bucket order.
        parts = _distributed_parts(trainer.optimizer)
        state["param_state"] = [opt.get_parameter_state_dp_reshardable() for opt in parts]
        # TE's FusedAdam: the step count lives in each param group (module docstring)
        state["group_steps"] = [[_copy(g.get("step")) for g in opt.optimizer.param_groups]
                                for opt in parts]
    else:
        state["optimizer"] = trainer.optimizer.state_dict()
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
    if "optimizer" in state:  # the non-distributed optimizer: its own state dict
        trainer.optimizer.load_state_dict(state["optimizer"])
    parts = _distributed_parts(trainer.optimizer)
    for part, param_state in zip(parts, state.get("param_state", [])):
        _restore_param_state(part, param_state)
    for part, steps in zip(parts, state.get("group_steps", [])):
        for group, step in zip(part.optimizer.param_groups, steps):
            if step is not None:
                group["step"] = _copy(step)
    trainer.step, trainer.policy_version = state["step"], state["policy_version"]
    rng = state.get("rng")
    if rng is not None:
        set_rng_state(rng)
        if rng.get("megatron_tracker") is not None:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(rng["megatron_tracker"])
    return state["extra"]


def _copy(step: Any) -> Any:
    """A group's step: an int, or a tensor (TE's capturable mode), kept apart from the live one."""
    return step.detach().clone() if isinstance(step, torch.Tensor) else step


def _restore_param_state(part: Any, param_state: dict) -> None:
    """Write a getter's entries back: main param values, and an Adam state (moments, and
    torch's per-parameter step) of their own shape, on the main param's device; then the
    model's (bf16) params from the main ones, as megatron does after a step."""
    inner = part.optimizer
    with torch.no_grad():
        for g, maps in enumerate(part.gbuf_ranges):
            for dtype, buckets in maps.items():
                for b, bucket_map in enumerate(buckets):
                    entries = param_state[g][dtype][b]
                    if len(entries) != len(bucket_map["param_map"]):
                        raise ValueError(f"checkpoint bucket {g}/{dtype}/{b} has {len(entries)} "
                                         f"parameters, this optimizer {len(bucket_map['param_map'])}")
                    for entry, model_param in zip(entries, bucket_map["param_map"]):
                        group, order = part.model_param_group_index_map[model_param]
                        main = inner.param_groups[group]["params"][order]
                        main.copy_(entry["param"])
                        # "step": torch's AdamW only (TE keeps it per group); no moments:
                        # saved before the first step
                        inner.state[main] = {
                            k: entry[k].to(main.device).clone() if k != "step"
                            else entry[k].clone()
                            for k in ("step", "exp_avg", "exp_avg_sq") if k in entry}
    if hasattr(part, "_copy_main_params_to_model_params"):
        part._copy_main_params_to_model_params()
