"""Hugging Face <-> megatron-core weight conversion: Llama, Qwen2, Qwen3, Qwen3-MoE.

Pure tensor code: nothing here imports megatron-core, so the round trip is testable anywhere.
Layouts follow megatron-core 0.16 (`GPTModel` with the local or Transformer Engine spec):

- `linear_qkv` fuses q, k, v *per query group*: for each of the `num_kv_heads` groups, its
  `num_heads / num_kv_heads` query heads, then its key head, then its value head (see
  `SelfAttention.get_query_key_value_tensors`). Tensor parallelism gives each rank a
  contiguous run of whole groups, so the fused tensor shards by plain chunking along dim 0.
- `linear_fc1` fuses SwiGLU as `[gate; up]` *per TP rank*: rank r holds
  `[gate_r; up_r]`, so sharding splits gate and up separately and re-concatenates.
- Row-parallel layers (`linear_proj`, `linear_fc2`) shard along dim 1; norms are replicated;
  the (vocab-parallel) embedding and output layer shard along dim 0 over a padded vocabulary.
- Qwen3's per-head `q_norm` / `k_norm` are megatron's `qk_layernorm` (`self_attention.
  q_layernorm.weight`, `k_layernorm.weight`, [head_dim], replicated over TP).
- Qwen3-MoE's experts and router: rl_async/train/megatron_moe.py.
- The Transformer Engine spec fuses the pre-attention / pre-MLP norms into the next linear
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); `te_norm_names=True`
  selects those names.

Megatron names here are "full model" names (all layers, one TP rank's view is produced by
`shard_tp`); pipeline stages renumber layers from 0 (`split_pp` / `merge_pp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_async.train import megatron_moe as moe

Tensors = dict[str, torch.Tensor]
SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")
QK_NORMS = (("q_norm.weight", "self_attention.q_layernorm.weight"),
            ("k_norm.weight", "self_attention.k_layernorm.weight"))

_HF_LAYER = "model.layers.{i}."
_MC_LAYER = "decoder.layers.{i}."


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the conversion needs, read from a Hugging Face config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    te_norm_names: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over each head's queries and keys
    num_experts: int = 0            # Qwen3-MoE: routed experts per layer (0: dense MLP)
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0    # one expert's intermediate width

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}: GQA groups must be whole"
            )

    @classmethod
    def from_hf_config(cls, config: Any, te_norm_names: bool = False) -> ModelShape:
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"model_type={model_type!r} is not supported by the megatron converter; "
                f"supported: {', '.join(map(repr, SUPPORTED))}"
            )
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported: megatron-core would need add_bias_linear")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        # Qwen2 always carries q/k/v biases; Llama and Qwen3 only with attention_bias (then
        # o_proj too, which megatron cannot give without a bias on every linear).
        qkv_bias = model_type == "qwen2"
        if model_type != "qwen2" and getattr(config, "attention_bias", False):
            raise ValueError(
                f"{model_type} attention_bias=True (bias on o_proj as well) has no megatron-core "
                f"equivalent without biases on every linear; use attention_bias=False"
            )
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{model_type} use_sliding_window=True: the megatron backend runs full "
                             f"causal attention only; set use_sliding_window=False or use the "
                             f"torch backend")
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            te_norm_names=te_norm_names,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe.shape_fields(config),
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def norm_names(self) -> tuple[str, str]:
        """Megatron names (within a layer) of the pre-attention and pre-MLP norm weights.
        Transformer Engine's MoE layer keeps its own pre-MLP norm: the router reads the
        normalised input too, so it cannot live inside an expert's fc1."""
        if self.te_norm_names:
            pre_mlp = "pre_mlp_layernorm.weight" if self.num_experts else "mlp.linear_fc1.layer_norm_weight"
            return ("self_attention.linear_qkv.layer_norm_weight", pre_mlp)
        return ("input_layernorm.weight", "pre_mlp_layernorm.weight")


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 1) -> int:
    """Vocabulary rounded up so that every TP rank holds the same number of rows."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


# ---------------------------------------------------------------- fused QKV


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[q; k; v] (HF, head-major) -> megatron's per-group interleaving; works for weight and bias."""
    rest = q.shape[1:]
    d, g = shape.head_dim, shape.num_kv_heads
    q_g = q.reshape(g, shape.heads_per_group * d, *rest)
    k_g = k.reshape(g, d, *rest)
    v_g = v.reshape(g, d, *rest)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    rest = qkv.shape[1:]
    d, g, hpg = shape.head_dim, shape.num_kv_heads, shape.heads_per_group
    grouped = qkv.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ---------------------------------------------------------------- HF <-> Megatron


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise ValueError(f"padded vocab {rows} is smaller than the vocabulary {t.shape[0]}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def hf_to_megatron(hf: Tensors, shape: ModelShape, vocab_rows: int | None = None) -> Tensors:
    """Full (unsharded) megatron-core state dict from a Hugging Face state dict (SUPPORTED).

    `vocab_rows` pads the embedding / output layer with zero rows (see `padded_vocab_size`).
    A tied model gets no `output_layer.weight` (megatron shares the embedding).
    """
    _require(hf, ["model.embed_tokens.weight", "model.norm.weight"], "Hugging Face")
    rows = vocab_rows or shape.vocab_size
    out: Tensors = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], rows)}
    pre_attn, pre_mlp = shape.norm_names()
    for i in range(shape.num_layers):
        h, m = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
        a = h + "self_attn."
        out[m + pre_attn] = hf[h + "input_layernorm.weight"]
        out[m + pre_mlp] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], shape
        )
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], shape
            )
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        if shape.qk_norm:
            for hf_name, mc_name in QK_NORMS:
                out[m + mc_name] = hf[a + hf_name]
        if shape.num_experts:
            out.update(moe.experts_to_megatron(hf, h, m, shape.num_experts))
            continue
        mlp = h + "mlp."
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not shape.tied_embeddings:
        _require(hf, ["lm_head.weight"], "Hugging Face (untied model)")
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], rows)
    return out


def megatron_to_hf(mc: Tensors, shape: ModelShape, emit_tied_lm_head: bool = False) -> Tensors:
    """Hugging Face state dict from a full megatron-core state dict; vocab padding removed.

    A tied model gets no `lm_head.weight` unless `emit_tied_lm_head` (HF checkpoints of tied
    models omit it, and SGLang skips it).
    """
    _require(mc, ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"], "megatron")
    out = embedding_to_hf(mc, shape)
    for i in range(shape.num_layers):
        out.update(layer_to_hf(mc, i, shape))
    out.update(final_to_hf(mc, shape, emit_tied_lm_head, out["model.embed_tokens.weight"]))
    return out


def embedding_to_hf(mc: Tensors, shape: ModelShape) -> Tensors:
    return {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:shape.vocab_size]}


def layer_to_hf(mc: Tensors, i: int, shape: ModelShape) -> Tensors:
    """Layer i's HF tensors from its megatron tensors (global layer names). gate/up are
    views of the fused fc1: a writer that needs separate storage copies them. An MoE
    layer's experts come out as transformers' fused 3-D tensors (what its model holds)."""
    h, m = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
    a = h + "self_attn."
    pre_attn, pre_mlp = shape.norm_names()
    out: Tensors = {h + "input_layernorm.weight": mc[m + pre_attn],
                    h + "post_attention_layernorm.weight": mc[m + pre_mlp]}
    q, k, vv = split_qkv(mc[m + "self_attention.linear_qkv.weight"], shape)
    out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, vv
    if shape.qkv_bias:
        qb, kb, vb = split_qkv(mc[m + "self_attention.linear_qkv.bias"], shape)
        out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = qb, kb, vb
    out[a + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
    if shape.qk_norm:
        for hf_name, mc_name in QK_NORMS:
            out[a + hf_name] = mc[m + mc_name]
    if shape.num_experts:
        out.update(moe.experts_to_hf(mc, h, m, shape.num_experts))
        return out
    fc1, f = mc[m + "mlp.linear_fc1.weight"], shape.ffn_hidden_size
    out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
    out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    return out


def final_to_hf(mc: Tensors, shape: ModelShape, emit_tied_lm_head: bool = False,
                embedding: torch.Tensor | None = None) -> Tensors:
    out: Tensors = {"model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][:shape.vocab_size]
    elif emit_tied_lm_head:
        out["lm_head.weight"] = embedding
    return out


def _require(sd: Tensors, keys: list[str], what: str) -> None:
    missing = [k for k in keys if k not in sd]
    if missing:
        raise KeyError(f"{what} state dict lacks {missing}; is this a Llama/Qwen2/Qwen3 checkpoint?")


# ---------------------------------------------------------------- tensor parallelism


def _tp_rule(name: str) -> str:
    """How a megatron tensor is laid out across TP ranks: 'rows', 'cols', 'fc1' or 'replicated'."""
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "fc1"
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"  # norms, row-parallel biases


def shard_tp(mc: Tensors, shape: ModelShape, tp_size: int) -> list[Tensors]:
    """Split a full megatron state dict into `tp_size` per-rank state dicts."""
    if shape.num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide num_key_value_heads="
            f"{shape.num_kv_heads} (each rank holds whole query groups)"
        )
    shards: list[Tensors] = [{} for _ in range(tp_size)]
    for name, t in mc.items():
        rule = _tp_rule(name)
        if rule == "replicated":
            parts = [t] * tp_size
        elif rule == "fc1":
            gate, up = t.chunk(2, dim=0)
            parts = [torch.cat(gu, dim=0) for gu in zip(gate.chunk(tp_size), up.chunk(tp_size))]
        else:
            dim = 0 if rule == "rows" else 1
            if t.shape[dim] % tp_size:
                raise ValueError(
                    f"{name} has {t.shape[dim]} along dim {dim}, not divisible by "
                    f"tensor_parallel_size={tp_size} (pad the vocabulary with padded_vocab_size)"
                )
            parts = list(t.chunk(tp_size, dim=dim))
        for rank, part in enumerate(parts):
            shards[rank][name] = part.contiguous()
    return shards


def unshard_tp(shards: list[Tensors]) -> Tensors:
    """Inverse of `shard_tp`: per-rank state dicts (rank order) -> full state dict."""
    out: Tensors = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        rule = _tp_rule(name)
        if rule == "replicated":
            out[name] = parts[0]
        elif rule == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[name] = torch.cat(parts, dim=0 if rule == "rows" else 1)
    return out


# ---------------------------------------------------------------- pipeline parallelism


def split_pp(mc: Tensors, shape: ModelShape, pp_size: int) -> list[Tensors]:
    """Per-stage state dicts; layers renumbered from 0 on every stage (megatron's local names).

    With tied embeddings and more than one stage, the last stage holds its own copy of the
    embedding as `output_layer.weight` (megatron keeps the two in sync).
    """
    if shape.num_layers % pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} must divide num_hidden_layers={shape.num_layers}"
        )
    per = shape.num_layers // pp_size
    stages: list[Tensors] = [{} for _ in range(pp_size)]
    for name, t in mc.items():
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers."):].split(".", 1)
            stage, local = divmod(int(idx), per)
            stages[stage][f"decoder.layers.{local}.{rest}"] = t
        elif name.startswith("embedding."):
            stages[0][name] = t
        else:  # final norm, output layer
            stages[-1][name] = t
    if shape.tied_embeddings and pp_size > 1:
        stages[-1]["output_layer.weight"] = mc["embedding.word_embeddings.weight"]
    return stages


def merge_pp(stages: list[Tensors], shape: ModelShape) -> Tensors:
    """Inverse of `split_pp`."""
    per = shape.num_layers // len(stages)
    out: Tensors = {}
    for s, stage in enumerate(stages):
        for name, t in stage.items():
            if name.startswith("decoder.layers."):
                idx, rest = name[len("decoder.layers."):].split(".", 1)
                out[f"decoder.layers.{s * per + int(idx)}.{rest}"] = t
            elif name == "output_layer.weight" and shape.tied_embeddings:
                continue  # the last stage's copy of the shared embedding
            else:
                out[name] = t
    return out
