"""Load a Hugging Face safetensors checkpoint into one megatron rank, slice by slice.

Loading the whole model on every rank and converting it there costs, for a 7B model on an
8-GPU node, eight full fp32 copies in host memory. Instead each rank opens the safetensors
shards lazily (`safe_open`, memory-mapped) and reads only the rows or columns its TP rank of
its PP stage holds, one tensor at a time, straight into its parameters:

- embedding / output layer: this TP rank's rows of the (padded) vocabulary;
- `linear_qkv`: this rank's query groups are one contiguous row range of each of q, k and v,
  fused with megatron's per-group interleave (`megatron_convert.fuse_qkv`);
- `linear_fc1`: this rank's rows of gate and of up, concatenated;
- `linear_proj`, `linear_fc2`: this rank's columns; norms (Qwen3's q/k norms too): whole;
- MoE experts: the same rules per expert, read from the checkpoint's per-expert tensors
  (or its fused 3-D ones), and the router whole (megatron_moe.expert_tensor).

The result is exactly `megatron_convert.shard_tp(split_pp(hf_to_megatron(full)))` for the
rank (tests/unit/test_megatron_load.py checks that), without ever holding `full`. Pure
tensor code: no megatron import, so it is testable anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from rl_async.train import megatron_convert as conv
from rl_async.train import megatron_moe as moe

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFCheckpoint:
    """Lazy reader of a Hugging Face safetensors checkpoint directory (sharded or not)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).exists():
            from safetensors import safe_open

            with safe_open(str(self.path / SINGLE), framework="pt") as f:
                weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"model.path = {str(self.path)!r} has neither {INDEX} nor {SINGLE}: the megatron "
                f"backend reads safetensors shards lazily; save the model with "
                f"save_pretrained(..., safe_serialization=True)")
        self.weight_map: dict[str, str] = weight_map
        self._stack = ExitStack()
        self._files: dict[str, object] = {}

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._files.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"{name!r} is not in the checkpoint at {str(self.path)!r}; is this a "
                           f"Llama/Qwen2/Qwen3/Qwen3-MoE checkpoint?")
        file = self.weight_map[name]
        if file not in self._files:
            from safetensors import safe_open

            self._files[file] = self._stack.enter_context(
                safe_open(str(self.path / file), framework="pt"))
        return self._files[file].get_slice(name)

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor (the whole tensor by default); reads only those."""
        return self._slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]

    def index(self, name: str, *index: slice) -> torch.Tensor:
        """A slice along every leading dim (`slice(e, e + 1), slice(a, b)`), read alone."""
        return self._slice(name)[index]

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())


def _vocab_rows(ckpt: HFCheckpoint, name: str, shape: conv.ModelShape, vocab_rows: int,
                tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's rows of the padded vocabulary; rows past the real vocabulary are zero."""
    per = vocab_rows // tp_size
    lo, hi = tp_rank * per, (tp_rank + 1) * per
    real = ckpt.rows(name, min(lo, shape.vocab_size), min(hi, shape.vocab_size))
    if real.shape[0] == per:
        return real
    return torch.cat([real, real.new_zeros(per - real.shape[0], *real.shape[1:])], dim=0)


def _layer_tensor(ckpt: HFCheckpoint, rest: str, layer: int, shape: conv.ModelShape,
                  tp_size: int, tp_rank: int, first_expert: int = 0) -> torch.Tensor:
    """One megatron tensor (`rest` = its name within the layer) of global layer `layer`."""
    h = f"model.layers.{layer}."
    a = h + "self_attn."
    pre_attn, pre_mlp = shape.norm_names()
    if rest == pre_attn:
        return ckpt.rows(h + "input_layernorm.weight")
    if rest == pre_mlp:
        return ckpt.rows(h + "post_attention_layernorm.weight")
    for hf_name, mc_name in conv.QK_NORMS:
        if rest == mc_name:
            return ckpt.rows(a + hf_name)
    if rest.startswith("mlp.router.") or rest.startswith("mlp.experts."):
        return moe.expert_tensor(ckpt, rest, h, shape.moe_ffn_hidden_size // tp_size, tp_rank,
                                 first_expert)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        groups = shape.num_kv_heads // tp_size  # whole query groups per rank
        d, hpg = shape.head_dim, shape.heads_per_group
        g0 = tp_rank * groups
        q = ckpt.rows(f"{a}q_proj.{kind}", g0 * hpg * d, (g0 + groups) * hpg * d)
        k = ckpt.rows(f"{a}k_proj.{kind}", g0 * d, (g0 + groups) * d)
        v = ckpt.rows(f"{a}v_proj.{kind}", g0 * d, (g0 + groups) * d)
        local = dataclasses.replace(shape, num_heads=groups * hpg, num_kv_heads=groups)
        return conv.fuse_qkv(q, k, v, local)
    ffn = shape.ffn_hidden_size // tp_size
    f0, f1 = tp_rank * ffn, (tp_rank + 1) * ffn
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([ckpt.rows(h + "mlp.gate_proj.weight", f0, f1),
                          ckpt.rows(h + "mlp.up_proj.weight", f0, f1)], dim=0)
    if rest == "mlp.linear_fc2.weight":
        return ckpt.cols(h + "mlp.down_proj.weight", f0, f1)
    if rest == "self_attention.linear_proj.weight":
        width = shape.num_heads * shape.head_dim // tp_size
        return ckpt.cols(a + "o_proj.weight", tp_rank * width, (tp_rank + 1) * width)
    raise KeyError(f"megatron tensor decoder.layers.<i>.{rest} has no Hugging Face source "
                   f"(not a Llama/Qwen2 layer?)")


def local_tensors(ckpt: HFCheckpoint, names: Iterable[str], shape: conv.ModelShape,
                  tp_size: int, tp_rank: int, pp_size: int, pp_rank: int,
                  vocab_rows: int, ep_size: int = 1, ep_rank: int = 0
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron local name, tensor) for each of `names` (this rank's parameter names, with
    stage-local layer numbers and, for MoE, local expert numbers: expert-parallel rank
    `ep_rank` holds experts ep_rank * E / ep_size onwards), read one at a time."""
    if shape.num_experts % ep_size:
        raise ValueError(f"train.expert_parallel = {ep_size} must divide the model's "
                         f"{shape.num_experts} experts")
    first_expert = ep_rank * (shape.num_experts // ep_size)
    if shape.num_kv_heads % tp_size or shape.ffn_hidden_size % tp_size or (
            shape.moe_ffn_hidden_size % tp_size):
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads="
                         f"{shape.num_kv_heads}, intermediate_size={shape.ffn_hidden_size} and "
                         f"moe_intermediate_size={shape.moe_ffn_hidden_size}")
    if shape.num_layers % pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} must divide num_hidden_layers="
                         f"{shape.num_layers}")
    per_stage = shape.num_layers // pp_size
    for name in names:
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers."):].split(".", 1)
            layer = pp_rank * per_stage + int(idx)
            yield name, _layer_tensor(ckpt, rest, layer, shape, tp_size, tp_rank, first_expert)
        elif name == "embedding.word_embeddings.weight":
            yield name, _vocab_rows(ckpt, "model.embed_tokens.weight", shape, vocab_rows,
                                    tp_size, tp_rank)
        elif name == "output_layer.weight":
            # Tied models: the last stage's own copy of the embedding (megatron syncs them).
            source = "model.embed_tokens.weight" if shape.tied_embeddings else "lm_head.weight"
            yield name, _vocab_rows(ckpt, source, shape, vocab_rows, tp_size, tp_rank)
        elif name == "decoder.final_layernorm.weight":
            yield name, ckpt.rows("model.norm.weight")
        else:
            raise KeyError(f"megatron tensor {name!r} has no Hugging Face source")
