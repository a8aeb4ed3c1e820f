"""The memory plan (rl_async/plan/memory.py): parameter counts equal the real models', the
static parts equal what a trainer really allocates, the 7B file fits an 80 GB GPU with room
while the same file with local attention, no recompute and 8k-token micro-batches is an
error naming the estimate and the GPU's size; an unreadable checkpoint gives no plan, and a
stated architecture must match the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_cpu_shims import megatron_cpu  # noqa: F401  (fixture)
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.plan.memory import Dims, inputs, trainer_memory
from rl_async.state.models import build_causal_lm, tiny_llama_config

THREE_NODE = "cluster_configs/three_node.toml"


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True), ("qwen2", False)])
def test_parameter_counts_equal_the_real_models(model_type, tied):
    config = {**tiny_llama_config(vocab_size=50, model_type=model_type),
              "tie_word_embeddings": tied}
    model = build_causal_lm(config)
    assert Dims.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_static_memory_equals_what_the_torch_trainer_allocates():
    from test_torch_trainer import TINY, make, make_groups

    cfg = load_config("cluster_configs/local.toml", [])
    trainer = make()
    trainer.train_collection(make_groups(), 1)
    params = list(trainer.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    moments = sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values()
                  for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    plan = trainer_memory(inputs(cfg), Dims.from_config(TINY))
    assert (plan["weights"], plan["gradients"], plan["optimizer"]) == (weights, grads, moments)


def _plan(*overrides):
    cfg = load_config(THREE_NODE, list(overrides))
    return validate(cfg)


def test_the_7b_file_fits_an_80gb_gpu_with_room_and_says_so_in_json():
    report = _plan()
    assert report.ok, report.errors
    memory = report.to_json()["runtime"]["memory"]
    assert memory["gpu_memory_gb"] == 80
    assert 40 < memory["trainer_gb_per_gpu"] < 0.9 * 80
    assert memory["engine_gb_per_gpu"] < 0.9 * 80
    trainer = memory["breakdown"]["trainer"]
    assert trainer["attention"] == "transformer_engine, recompute none"
    assert memory["breakdown"]["source"] == "model.architecture"
    assert not [w for w in report.warnings if w.code.endswith("_MEMORY")]


def test_local_attention_without_recompute_on_8k_token_micro_batches_is_an_error():
    report = _plan("train.transformer_impl=local", "train.recompute=none",
                   "train.max_tokens_per_microbatch=8192")
    [error] = [e for e in report.errors if "trainer needs" in e]
    estimate = float(error.split("~")[1].split(" GiB")[0])
    assert estimate > 100 and "cluster.gpu_memory_gb = 80" in error, error
    assert "activations" in error  # the largest part is named
    # selective recompute drops the s x s scores: the same file fits again
    assert _plan("train.transformer_impl=local", "train.recompute=selective",
                 "train.max_tokens_per_microbatch=8192").ok


def test_past_90_percent_is_a_warning_and_an_h200_has_more_room():
    tight = _plan("cluster.gpu_memory_gb=68")
    assert "TRAINER_MEMORY" in [w.code for w in tight.warnings] and tight.ok
    roomy = _plan("cluster.gpu_memory_gb=141")
    assert roomy.to_json()["runtime"]["memory"]["trainer_gb_per_gpu"] < 0.5 * 141


def test_an_engine_whose_weights_do_not_fit_its_static_pool_is_an_error():
    report = _plan("cluster.gpus_per_engine=1", "cluster.inference_gpus=16",
                   "sglang.mem_fraction_static=0.1",
                   "publication.bytes_per_s=1e10")  # 16 engines' transfer in the deadline
    assert any("engine's weights" in e and "raise cluster.gpus_per_engine" in e
               for e in report.errors), report.errors


def test_no_readable_architecture_means_no_plan_not_an_error(tmp_path):
    text = open(THREE_NODE).read()
    stripped = "\n".join(line for line in text.splitlines()
                         if not line.startswith("architecture ="))
    path = tmp_path / "run.toml"
    path.write_text(stripped)
    report = validate(load_config(str(path)))
    assert report.ok and report.memory is None
    assert "not readable here" in report.to_json()["runtime"]["memory"]["unavailable"]


def test_a_stated_architecture_must_match_the_checkpoint(tmp_path):
    model = build_causal_lm(tiny_llama_config())
    model.save_pretrained(tmp_path / "ckpt")
    cfg = load_config("cluster_configs/local.toml", [])
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={
        "hf_config": None, "path": str(tmp_path / "ckpt"),
        "architecture": {"hidden_size": 128, "num_hidden_layers": 2}})})
    errors = validate(cfg).errors
    assert any("model.architecture.hidden_size = 128" in e and "has 64" in e for e in errors)
    assert not any("num_hidden_layers" in e for e in errors)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["hidden_size"] == 64


def _saved_bytes(module, x, forward) -> int:
    """Bytes of the tensors autograd keeps for `forward`'s backward, each storage once,
    without the module's parameters and its input (the plan counts that with the norm)."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(x)
    return sum(saved.values())


@pytest.mark.megatron
@pytest.mark.parametrize("fused", [False, True])
def test_the_swiglu_term_is_what_megatrons_own_mlp_keeps(megatron_cpu, fused):
    """megatron-core 0.16.1's MLP, unfused (mlp.py glu) and fused (fused_bias_swiglu.py),
    keeps exactly the plan's 5f/t and 3f/t per token (the fused kernel's torch.compile is
    switched off here: the same autograd function, run eagerly on CPU)."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core import parallel_state

    from rl_async.plan.memory import swiglu_saved

    parallel_state.initialize_model_parallel()
    tokens, hidden, ffn = 20, 64, 96
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn,
                            num_attention_heads=4, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=fused, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            gradient_accumulation_fusion=False)
    mlp = MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                 linear_fc2=RowParallelLinear))
    x = torch.randn(tokens // 2, 2, hidden, requires_grad=True)
    with _eager():
        saved = _saved_bytes(mlp, x, mlp)
    assert saved == swiglu_saved("megatron", fused) * ffn * tokens * 4


def test_the_torch_backends_swiglu_term_is_what_llamas_mlp_keeps():
    from transformers.models.llama.modeling_llama import LlamaMLP

    from rl_async.plan.memory import swiglu_saved

    config = build_causal_lm(tiny_llama_config()).config
    mlp = LlamaMLP(config)
    x = torch.randn(3, 5, config.hidden_size, requires_grad=True)
    assert (_saved_bytes(mlp, x, mlp)
            == swiglu_saved("torch", False) * config.intermediate_size * 15 * 4)


def test_three_node_counts_the_fused_swiglu_that_runs_on_gpu_and_two_publication_buckets():
    """On GPU megatron runs the fused SwiGLU (3f/t): 63.9 GiB; the unfused path (5f/t)
    would need 73.0 GiB, past 90% of an 80 GB GPU."""
    import dataclasses

    from rl_async.plan.memory import GiB, _bytes, architecture

    cfg = load_config(THREE_NODE, [])
    dims = Dims.from_config(architecture(cfg)[0])
    fused = trainer_memory(inputs(cfg), dims)
    assert fused["swiglu"] == "fused, 3f/t saved per token"
    assert fused["publication"] == 2 * cfg.publication.bucket_bytes
    unfused = trainer_memory(dataclasses.replace(inputs(cfg), activation_fusion=False), dims)
    assert round(_bytes(fused) / GiB, 1) == 63.9 and round(_bytes(unfused) / GiB, 1) == 73.0
    assert _bytes(unfused) > 0.9 * 80 * GiB


class _eager:
    """torch.compile off: megatron wraps its fused kernels with it (megatron/core/jit.py)."""

    def __enter__(self):
        self.before = torch._dynamo.config.disable
        torch._dynamo.config.disable = True

    def __exit__(self, *exc):
        torch._dynamo.config.disable = self.before
