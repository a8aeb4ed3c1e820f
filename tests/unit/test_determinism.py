"""run.deterministic reaches the trainer: deterministic algorithms on, cuBLAS's workspace
setting, seeded RNGs (it only changed the engines before); off by default."""

from __future__ import annotations

import os
import random

import torch

from actors.trainer import build_trainer
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config


def test_deterministic_runs_build_their_trainer_with_deterministic_kernels(monkeypatch):
    # what the trainer sets process-wide is put back for the tests after this one
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # registers the undo (absent -> absent)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    rng = (random.getstate(), torch.get_rng_state())
    try:
        cfg = load_config("cluster_configs/dev.toml", ["run.deterministic=true"])
        build_trainer(cfg, validate(cfg).plan, 0, 1)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        first = torch.rand(3)
        build_trainer(cfg, validate(cfg).plan, 0, 1)
        assert torch.equal(torch.rand(3), first)  # seeded from model.init_seed
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        random.setstate(rng[0])
        torch.set_rng_state(rng[1])


def test_the_default_leaves_kernels_alone(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cfg = load_config("cluster_configs/dev.toml")
    build_trainer(cfg, validate(cfg).plan, 0, 1)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_gpu_trainer_actors_get_cublas_setting_in_their_environment():
    from actors.fleet import nccl_env

    env = nccl_env(True, deterministic=True)["runtime_env"]["env_vars"]
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["NCCL_CUMEM_ENABLE"] == "0"
    assert "CUBLAS_WORKSPACE_CONFIG" not in nccl_env(True)["runtime_env"]["env_vars"]
    assert nccl_env(False, deterministic=True) == {}
