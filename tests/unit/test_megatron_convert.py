"""Hugging Face <-> megatron-core conversion: exact round trips, layouts, TP and PP splits.

Needs no megatron-core: the converter is pure tensor code. The check against the real
megatron-core GPTModel (logits match) lives in test_megatron_backend.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from rl_async.train import megatron_convert as mc

torch.set_num_threads(1)

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)


MOE = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           norm_topk_prob=True)


def _hf_model(kind: str, tied: bool = False):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tied))
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, **MOE, tie_word_embeddings=tied))
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied))


def _hf_state(model) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # what a tied HF checkpoint stores
    # Make every tensor distinct (HF inits norms to ones and biases to zeros) so a
    # permutation or swapped name cannot pass unnoticed.
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=gen) for k, v in sd.items()}


CASES = [("llama", False), ("qwen2", False), ("qwen2", True), ("llama", True), ("qwen3", True),
         ("qwen3_moe", False)]


@pytest.mark.parametrize("kind,tied", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact(kind, tied, tp):
    model = _hf_model(kind, tied)
    hf = _hf_state(model)
    shape = mc.ModelShape.from_hf_config(model.config)
    assert shape.qkv_bias == (kind == "qwen2")
    rows = mc.padded_vocab_size(shape.vocab_size, tp, divisible_by=64)
    full = mc.hf_to_megatron(hf, shape, vocab_rows=rows)
    shards = mc.shard_tp(full, shape, tp)
    back = mc.megatron_to_hf(mc.unshard_tp(shards), shape)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("te_names", [False, True])
def test_megatron_names_and_shapes(te_names):
    model = _hf_model("qwen2")
    shape = mc.ModelShape.from_hf_config(model.config, te_norm_names=te_names)
    full = mc.hf_to_megatron(_hf_state(model), shape)
    d, h = shape.head_dim, shape.hidden_size
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * d
    assert full["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (qkv_rows, h)
    assert full["decoder.layers.1.self_attention.linear_qkv.bias"].shape == (qkv_rows,)
    assert full["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * shape.ffn_hidden_size, h)
    norm = "self_attention.linear_qkv.layer_norm_weight" if te_names else "input_layernorm.weight"
    assert f"decoder.layers.0.{norm}" in full
    assert "output_layer.weight" in full and "decoder.final_layernorm.weight" in full


def test_qwen3_moe_names_shapes_and_the_on_disk_form():
    """Experts: fused 3-D HF tensors <-> one megatron MLP per expert; the per-expert form of
    checkpoints on disk converts to the same megatron tensors; qk norms are [head_dim]."""
    model = _hf_model("qwen3_moe")
    hf = _hf_state(model)
    shape = mc.ModelShape.from_hf_config(model.config)
    assert (shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size, shape.qk_norm) == (4, 2, 24, True)
    full = mc.hf_to_megatron(hf, shape)
    layer = "decoder.layers.1."
    assert full[layer + "mlp.router.weight"].shape == (4, 32)
    fc1 = full[layer + "mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (48, 32) and full[layer + "mlp.experts.local_experts.3.linear_fc2.weight"].shape == (32, 24)
    assert full[layer + "self_attention.q_layernorm.weight"].shape == (16,)
    assert not any("linear_fc1" in k and "local_experts" not in k for k in full)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]
    on_disk = {k: v for k, v in hf.items() if ".mlp.experts." not in k}
    for i in range(shape.num_layers):
        for e in range(4):
            x = f"model.layers.{i}.mlp.experts.{e}."
            g, u = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"][e].chunk(2)
            on_disk.update({x + "gate_proj.weight": g, x + "up_proj.weight": u,
                            x + "down_proj.weight": hf[f"model.layers.{i}.mlp.experts.down_proj"][e]})
    from_disk = mc.hf_to_megatron(on_disk, shape)
    assert from_disk.keys() == full.keys() and all(torch.equal(from_disk[k], full[k]) for k in full)
    assert torch.equal(fc1[:24], gate_up[3, :24])  # gate first, as megatron's SwiGLU fc1
    rank1 = mc.shard_tp(full, shape, 2)[1][layer + "mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(rank1, torch.cat([gate_up[3, 12:24], gate_up[3, 36:]]))


def test_mixed_dense_and_moe_layers_are_refused():
    config = Qwen3MoeConfig(**TINY, **MOE, mlp_only_layers=[0])
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\].*torch backend"):
        mc.ModelShape.from_hf_config(config)


def test_qkv_interleaves_whole_groups():
    """Group g of the fused tensor is [its q heads, its k head, its v head] (megatron layout)."""
    shape = mc.ModelShape(1, 8, num_heads=4, num_kv_heads=2, head_dim=2, ffn_hidden_size=8, vocab_size=8)
    q = torch.arange(8.0).repeat_interleave(1).reshape(8, 1)  # heads 0..3, 2 rows each
    k = 100 + torch.arange(4.0).reshape(4, 1)
    v = 200 + torch.arange(4.0).reshape(4, 1)
    fused = mc.fuse_qkv(q, k, v, shape).flatten().tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(mc.split_qkv(mc.fuse_qkv(q, k, v, shape), shape), (q, k, v)))


def test_fc1_shards_hold_gate_then_up_of_their_slice():
    model = _hf_model("llama")
    hf = _hf_state(model)
    shape = mc.ModelShape.from_hf_config(model.config)
    rank1 = mc.shard_tp(mc.hf_to_megatron(hf, shape), shape, 2)[1]
    fc1 = rank1["decoder.layers.0.mlp.linear_fc1.weight"]
    f2 = shape.ffn_hidden_size // 2
    assert torch.equal(fc1[:f2], hf["model.layers.0.mlp.gate_proj.weight"][f2:])
    assert torch.equal(fc1[f2:], hf["model.layers.0.mlp.up_proj.weight"][f2:])
    proj = rank1["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, shape.hidden_size // 2:])


def test_vocab_padding_rows_are_zero_and_stripped():
    model = _hf_model("llama")
    hf = _hf_state(model)
    shape = mc.ModelShape.from_hf_config(model.config)
    full = mc.hf_to_megatron(hf, shape, vocab_rows=128)
    assert full["embedding.word_embeddings.weight"].shape[0] == 128
    assert not full["output_layer.weight"][96:].any()
    assert torch.equal(mc.megatron_to_hf(full, shape)["lm_head.weight"], hf["lm_head.weight"])


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_split_round_trip(tied):
    model = _hf_model("qwen2", tied)
    shape = mc.ModelShape.from_hf_config(model.config)
    full = mc.hf_to_megatron(_hf_state(model), shape)
    stages = mc.split_pp(full, shape, 2)
    assert "decoder.layers.0.mlp.linear_fc2.weight" in stages[1]
    assert "decoder.layers.1.mlp.linear_fc2.weight" not in stages[1]
    assert ("output_layer.weight" in stages[1]) and "embedding.word_embeddings.weight" not in stages[1]
    merged = mc.merge_pp(stages, shape)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[k], full[k]) for k in full)


def test_errors_name_the_bad_value():
    model = _hf_model("llama")
    shape = mc.ModelShape.from_hf_config(model.config)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_key_value_heads=2"):
        mc.shard_tp(mc.hf_to_megatron(_hf_state(model), shape), shape, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        mc.ModelShape(1, 8, num_heads=3, num_kv_heads=2, head_dim=2, ffn_hidden_size=8, vocab_size=8)
    bad = LlamaConfig(**TINY)
    bad.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        mc.ModelShape.from_hf_config(bad)
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf = _hf_state(model)
        hf.pop("lm_head.weight")
        mc.hf_to_megatron(hf, shape)
