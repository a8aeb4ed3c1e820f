"""The memory plan and validate for mixture-of-experts models (rl_async/plan/memory.py,
rl_async/plan/moe_checks.py): parameter counts equal transformers' own MoE models, expert
parallelism divides the expert weights on a trainer GPU (not their optimizer state), mixture
layers' activations follow top-k x the expert width, validate refuses the layouts megatron
cannot build, and the shipped Qwen3-30B-A3B file plans and validates."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.plan.memory import GiB, Dims, MemoryInputs, trainer_memory

QWEN3_30B = "cluster_configs/qwen3_30b_a3b.toml"
THREE_NODE = "cluster_configs/three_node.toml"   # dense Qwen2.5-7B, megatron, 8 trainers
NODE = "cluster_configs/node.toml"               # dense, torch DDP, 4 trainers

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 64}
MOE_CONFIGS = {
    # layer 1 dense (mlp_only_layers): a mixture model with a dense layer in it
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "mlp_only_layers": [1]},
    # every second layer sparse, a shared expert with its sigmoid gate, q/k/v biases
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
                  "decoder_sparse_step": 2},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
}


def _real(config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):  # shapes only: no memory, no init
        return AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_parameter_counts_equal_transformers_moe_models(kind, tied):
    config = {**TINY, **MOE_CONFIGS[kind], "tie_word_embeddings": tied}
    model = _real(config)
    dims = Dims.from_config(config)
    assert dims.moe is not None
    assert dims.params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters()
                  if ".experts." in n or n.endswith(".experts"))
    assert dims.expert_params == experts
    # one token runs through top_k of each mixture layer's experts
    m = dims.moe
    assert dims.active_params == dims.params - experts * (m.experts - m.top_k) // m.experts


def test_the_real_qwen3_30b_a3b_counts():
    """30.5B parameters, 3.3B active (the model card's figures), from the shipped file."""
    cfg = load_config(QWEN3_30B)
    dims = Dims.from_config(cfg.model.architecture)
    assert 30.5e9 <= dims.params < 30.6e9 and 3.3e9 <= dims.active_params < 3.4e9
    model = _real({**cfg.model.architecture, "num_hidden_layers": 2})  # two layers: same shapes
    two = Dims.from_config({**cfg.model.architecture, "num_hidden_layers": 2})
    assert two.params == sum(p.numel() for p in model.parameters())


def _megatron(ep: int, **kw) -> MemoryInputs:
    return MemoryInputs(backend="megatron", trainer_workers=8, trainer_gpus=8,
                        expert_parallel=ep, **kw)


def test_expert_parallel_divides_the_expert_weights_not_their_optimizer_state():
    dims = Dims.from_config(load_config(QWEN3_30B).model.architecture)
    one, eight = trainer_memory(_megatron(1), dims), trainer_memory(_megatron(8), dims)
    experts = dims.expert_params
    assert one["weights"] - eight["weights"] == pytest.approx(experts * 2 * (1 - 1 / 8))
    assert one["gradients"] - eight["gradients"] == pytest.approx(experts * 4 * (1 - 1 / 8))
    # the distributed optimizer shards an expert over the DP / EP ranks that hold it
    assert one["optimizer"] == pytest.approx(eight["optimizer"])
    assert one["optimizer"] == pytest.approx(dims.params * 12 / 8)
    # TP shards the experts too (megatron's default expert_tensor_parallel_size = TP)
    tp2 = trainer_memory(_megatron(4, tensor_parallel=2), dims)
    assert tp2["weights"] == pytest.approx(dims.params * 2 / 2 - experts * 2 / 2 * (1 - 1 / 4))


def test_mixture_layers_activations_follow_top_k_times_the_expert_width():
    base = {**TINY, **MOE_CONFIGS["mixtral"]}   # every layer a mixture, intermediate = expert
    k2, k3 = (Dims.from_config({**base, "num_experts_per_tok": k}) for k in (2, 3))
    # one more expert per token: its SwiGLU (3 x f, fused) and one more copy of the token (h)
    step = k3.activation_bytes_per_token(1, 2, 3) - k2.activation_bytes_per_token(1, 2, 3)
    assert step == (3 * 48 + 32) * 2
    dense = Dims.from_config({**TINY, "model_type": "llama"})
    assert dense.moe is None and dense.active_params == dense.params


def test_a_dense_qwen3_counts_its_q_and_k_norms():
    config = {**TINY, "model_type": "qwen3", "tie_word_embeddings": False}
    assert Dims.from_config(config).params == sum(p.numel() for p in _real(config).parameters())


def _with_arch(path: str, **arch):
    cfg = load_config(path)
    model = cfg.model.model_copy(update={"architecture": {**cfg.model.architecture, **arch}})
    return cfg.model_copy(update={"model": model})


def _errors(cfg_or_path, *overrides) -> list[str]:
    cfg = (load_config(cfg_or_path, list(overrides)) if isinstance(cfg_or_path, str)
           else cfg_or_path)
    return validate(cfg).errors


@pytest.mark.parametrize("case,needle", [
    ((NODE, "train.expert_parallel=2"), "needs train.backend = 'megatron'"),
    ((QWEN3_30B, "train.expert_parallel=16"), "must divide the 8 data-parallel"),
    ((THREE_NODE, "train.expert_parallel=2"), "is dense (no experts to split)"),
    ((THREE_NODE, "train.routing_replay=r3"), "has no routers to replay"),
])
def test_validate_refuses_what_megatron_cannot_build(case, needle):
    errors = _errors(*case)
    key = case[1].split("=")[0]
    assert [e for e in errors if needle in e and key in e], errors


def test_an_expert_parallel_that_does_not_divide_the_experts_is_refused():
    errors = _errors(_with_arch(QWEN3_30B, num_experts=100))
    assert any("train.expert_parallel = 8 does not divide the model's 100 experts" in e
               and "use a divisor of 100" in e for e in errors), errors
    assert _errors(_with_arch(QWEN3_30B, num_experts=96)) == []


def test_dense_models_keep_their_plans_and_accept_the_defaults():
    assert validate(load_config(THREE_NODE, ["train.routing_replay=off"])).ok
    report = validate(load_config(THREE_NODE))
    assert report.ok and "moe" not in report.memory.breakdown


def test_the_qwen3_30b_a3b_file_plans_and_validates():
    report = validate(load_config(QWEN3_30B))
    assert report.ok, report.errors
    memory = report.to_json()["runtime"]["memory"]
    assert memory["gpu_memory_gb"] == 141
    assert 0.5 * 141 < memory["trainer_gb_per_gpu"] < 0.9 * 141
    moe = memory["breakdown"]["moe"]
    assert (moe["experts"], moe["top_k"], moe["moe_layers"], moe["expert_parallel"]) == (
        128, 8, 48, 8)
    assert moe["routing_replay"] == "r3"  # "auto" on an MoE model
    assert moe["replay_bytes_per_sample"] == (1024 + 4096) * 48 * 8  # one byte per id
    assert not [w for w in report.warnings if w.code.endswith("_MEMORY")]
    # on 80 GB GPUs the trainer does not fit, and the error names expert parallelism
    small = validate(load_config(QWEN3_30B, ["cluster.gpu_memory_gb=80"]))
    assert any("trainer needs" in e and "train.expert_parallel" in e for e in small.errors)
    off = validate(load_config(QWEN3_30B, ["train.routing_replay=off"]))
    assert off.memory.breakdown["moe"]["replay_bytes_per_sample"] == 0


def test_rl_async_plan_prints_the_moe_facts():
    from launch.cli import main

    result = CliRunner().invoke(main, ["plan", QWEN3_30B])
    assert result.exit_code == 0, result.output
    assert "mixture of experts: 128 experts, top-8, 48 MoE layers" in result.output
    assert "3.35B active per token" in result.output and "routing replay r3" in result.output


@pytest.mark.parametrize("arch,override,needle", [
    ({"model_type": "mixtral"}, None, "model_type = 'mixtral': set train.backend = 'torch'"),
    ({"mlp_only_layers": [0]}, None, "mlp_only_layers = [0]"),
    ({}, ["train.recompute=full", "train.pipeline_parallel=2"], "train.recompute = 'full'"),
    ({}, ["train.tensor_parallel=2"], "train.tensor_parallel = 2 with an MoE model"),
])
def test_validate_refuses_what_the_megatron_backend_cannot_convert_or_replay(arch, override, needle):
    cfg = _with_arch(QWEN3_30B, **arch)
    if override:
        cfg = load_config(QWEN3_30B, override)
    assert any(needle in e for e in _errors(cfg)), _errors(cfg)


def test_validates_megatron_families_match_the_converters():
    from rl_async.plan.moe_checks import MEGATRON_MODEL_TYPES
    from rl_async.train.megatron_convert import SUPPORTED

    assert MEGATRON_MODEL_TYPES == SUPPORTED
