"""The megatron-core trainer with its distributed optimizer (the default) on CPU: a checkpoint
saved after one collection, loaded into a fresh trainer, continues exactly as the trainer that
was never interrupted, with fp32 and bf16 params (megatron-core's own loaders raised
KeyError: 'padding', shared one Adam step counter among all parameters, and with bf16 params
mis-sized their state: seen on an H200); micro-batches by a token budget and activation recompute change memory,
not the result. Marked `megatron` (skipped without megatron-core)."""

from __future__ import annotations

import pytest
import torch

from megatron_cpu_shims import megatron_cpu  # noqa: F401  (fixture)
from test_megatron_trainer import assert_same_metrics, groups, run_config

pytestmark = pytest.mark.megatron


def trainer(cfg, **overrides):
    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    mcfg = trainer_config_from_run(cfg, 4)
    for key, value in overrides.items():
        setattr(mcfg, key, value)
    hf_config, weights = hf_weights_from_run(cfg)
    return MegatronTrainer(hf_config, weights, mcfg)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_distributed_optimizer_resume_continues_exactly(megatron_cpu, tmp_path, params_dtype):
    from rl_async.train import megatron_checkpoint
    from rl_async.train import megatron_model as mm

    cfg = run_config()
    parallel = mm.MegatronParallelConfig(params_dtype=params_dtype, seed=cfg.model.init_seed)
    first = trainer(cfg, parallel=parallel)
    assert first.cfg.use_distributed_optimizer
    first.train_collection(groups(11, 1), 1)
    first.save_checkpoint(tmp_path, {"version": 1})
    torch.manual_seed(1234)  # the RNG moves on; the checkpoint restores it
    uninterrupted = first.train_collection(groups(12, 2), 2)
    want = dict(first.named_tensors_for_publication())

    resumed = trainer(cfg, parallel=parallel)
    assert resumed.load_checkpoint(tmp_path) == {"version": 1}
    assert resumed.step == 2 and resumed.policy_version == 1
    got = resumed.train_collection(groups(12, 2), 2)
    assert_same_metrics(got, uninterrupted)
    weights = dict(resumed.named_tensors_for_publication())
    assert all(torch.equal(weights[k], want[k]) for k in want)

    # Why the loader needed help: megatron-core's own getter/loader pair does not round-trip.
    raw = megatron_checkpoint._distributed_parts(first.optimizer)[0]
    with pytest.raises(KeyError, match="padding"):
        raw.load_parameter_state_from_dp_reshardable(raw.get_parameter_state_dp_reshardable())


def test_token_budget_micro_batches_give_the_fixed_splits_loss(megatron_cpu):
    cfg = run_config()
    fixed = trainer(cfg).train_collection(groups(11, 1), 1)
    # samples are 7-10 tokens long: a 20-token budget makes micro-batches of 1 or 2 rows
    budget = trainer(cfg, max_tokens_per_microbatch=20).train_collection(groups(11, 1), 1)
    assert_same_metrics(budget, fixed)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_changes_memory_not_the_result(megatron_cpu, recompute):
    from rl_async.train import megatron_model as mm

    cfg = run_config()
    plain = trainer(cfg).train_collection(groups(11, 1), 1)
    parallel = mm.MegatronParallelConfig(params_dtype="float32", seed=cfg.model.init_seed,
                                         recompute=recompute)
    again = trainer(cfg, parallel=parallel)
    assert again.model.module.config.recompute_granularity == recompute
    assert_same_metrics(again.train_collection(groups(11, 1), 1), plain)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_resume_with_transformer_engines_fused_adam_keeps_the_group_step(
        megatron_cpu, tmp_path, monkeypatch, params_dtype):
    """With Transformer Engine installed megatron-core trains with TE's FusedAdam, which
    keeps `step` per parameter group and none per parameter (tests/unit/te_fused_adam_double
    .py, written from TE's fused_adam.py): the resume read a per-parameter `step`
    (KeyError: 'step'), and without the group's step the bias correction would restart."""
    from te_fused_adam_double import FusedAdamDouble, install

    from rl_async.train import megatron_checkpoint
    from rl_async.train import megatron_model as mm

    install(monkeypatch)
    cfg = run_config()
    parallel = mm.MegatronParallelConfig(params_dtype=params_dtype, seed=cfg.model.init_seed)
    first = trainer(cfg, parallel=parallel)
    [inner] = [p.optimizer for p in megatron_checkpoint._distributed_parts(first.optimizer)]
    assert isinstance(inner, FusedAdamDouble)  # the class megatron picked
    first.train_collection(groups(11, 1), 1)
    assert all("step" not in s for s in inner.state.values())
    steps = [g["step"] for g in inner.param_groups if g["params"]]
    assert steps and all(s >= 1 for s in steps)
    first.save_checkpoint(tmp_path, {"version": 1})
    uninterrupted = first.train_collection(groups(12, 2), 2)
    want = dict(first.named_tensors_for_publication())

    resumed = trainer(cfg, parallel=parallel)
    assert resumed.load_checkpoint(tmp_path) == {"version": 1}
    [again] = [p.optimizer for p in megatron_checkpoint._distributed_parts(resumed.optimizer)]
    assert [g["step"] for g in again.param_groups if g["params"]] == steps
    assert_same_metrics(resumed.train_collection(groups(12, 2), 2), uninterrupted)
    weights = dict(resumed.named_tensors_for_publication())
    assert all(torch.equal(weights[k], want[k]) for k in want)


def test_a_checkpoint_before_the_first_step_resumes(megatron_cpu, tmp_path, monkeypatch):
    """No optimizer step yet: no moments and no step anywhere; the resumed trainer's first
    step creates them, as the uninterrupted one's does."""
    from te_fused_adam_double import install

    install(monkeypatch)
    cfg = run_config()
    first = trainer(cfg)
    first.save_checkpoint(tmp_path, {"version": 0})
    uninterrupted = first.train_collection(groups(11, 1), 1)
    resumed = trainer(cfg)
    resumed.load_checkpoint(tmp_path)
    assert_same_metrics(resumed.train_collection(groups(11, 1), 1), uninterrupted)
