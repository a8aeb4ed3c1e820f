"""Lazy, per-rank loading of a safetensors checkpoint (rl_async.train.megatron_load) equals
the full conversion's slice for every TP x PP rank. Pure tensors: no megatron-core."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from rl_async.train import megatron_convert as conv
from rl_async.train.megatron_load import HFCheckpoint, local_tensors

TINY = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig, {}), "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
            "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16}),
            "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig,
                          {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 24})}


def _save(tmp_path, kind, tied, shard):
    torch.manual_seed(0)
    cls, cfg_cls, extra = FAMILIES[kind]
    model = cls(cfg_cls(**TINY, **extra, tie_word_embeddings=tied))
    with torch.no_grad():  # distinct values everywhere, so a wrong slice cannot pass
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    # A small max_shard_size writes several shards plus model.safetensors.index.json.
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return model.config, state


@pytest.mark.parametrize("kind,tied,shard", [("llama", False, True), ("qwen2", True, True),
                                             ("qwen2", False, False), ("qwen3", True, False),
                                             ("qwen3_moe", False, True)])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (1, 4)])
def test_every_rank_reads_exactly_its_slice(tmp_path, kind, tied, shard, tp, pp):
    hf_config, state = _save(tmp_path, kind, tied, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    shape = conv.ModelShape.from_hf_config(hf_config)
    rows = conv.padded_vocab_size(shape.vocab_size, tp, 16)  # 100 -> 128 (or 112): padding
    full = conv.hf_to_megatron(state, shape, vocab_rows=rows)
    with HFCheckpoint(tmp_path) as ckpt:
        for pp_rank, stage in enumerate(conv.split_pp(full, shape, pp)):
            for tp_rank, want in enumerate(conv.shard_tp(stage, shape, tp)):
                got = dict(local_tensors(ckpt, list(want), shape, tp, tp_rank, pp, pp_rank, rows))
                assert got.keys() == want.keys()
                for name in want:
                    assert torch.equal(got[name], want[name]), (tp_rank, pp_rank, name)


def test_missing_checkpoint_and_tensor_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path = .* safe_serialization=True"):
        HFCheckpoint(tmp_path)
    hf_config, _ = _save(tmp_path, "llama", False, False)
    shape = conv.ModelShape.from_hf_config(hf_config)
    with HFCheckpoint(tmp_path) as ckpt:
        with pytest.raises(KeyError, match="'model.layers.9.input_layernorm.weight' is not in"):
            list(local_tensors(ckpt, ["decoder.layers.9.input_layernorm.weight"], shape, 1, 0,
                               1, 0, 128))
        with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
            list(local_tensors(ckpt, [], shape, 3, 0, 1, 0, 128))


def test_a_run_with_model_path_loads_lazily_and_a_config_model_whole(tmp_path):
    from rl_async.plan.load import resolve
    from rl_async.train.megatron_backend import hf_weights_from_run

    hf_config, state = _save(tmp_path, "qwen2", False, True)
    config, weights = hf_weights_from_run(resolve({"model": {"path": str(tmp_path)}}))
    assert isinstance(weights, HFCheckpoint) and config.num_hidden_layers == 4
    assert torch.equal(weights.rows("model.norm.weight"), state["model.norm.weight"])
    weights.close()
    tiny = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    config, weights = hf_weights_from_run(resolve({"model": {"hf_config": tiny}}))
    assert isinstance(weights, dict) and "model.embed_tokens.weight" in weights


def test_fused_expert_tensors_on_disk_read_the_same_slices(tmp_path):
    """A checkpoint written from transformers' in-memory form (fused 3-D experts) loads the
    same per-rank expert slices as the per-expert form save_pretrained writes."""
    from safetensors.torch import save_file

    hf_config, state = _save(tmp_path / "per_expert", "qwen3_moe", False, False)
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "fused" / "model.safetensors"))
    shape = conv.ModelShape.from_hf_config(hf_config)
    want = conv.shard_tp(conv.hf_to_megatron(state, shape, vocab_rows=128), shape, 2)[1]
    names = [n for n in want if ".mlp." in n]
    with HFCheckpoint(tmp_path / "fused") as fused, HFCheckpoint(tmp_path / "per_expert") as per:
        assert "model.layers.0.mlp.experts.gate_up_proj" in fused
        for ckpt in (fused, per):
            got = dict(local_tensors(ckpt, names, shape, 2, 1, 1, 0, 128))
            assert all(torch.equal(got[n], want[n]) for n in names)
