"""Qwen3-MoE in megatron-core: the expert and router tensors, and the TransformerConfig keys.

Layouts (megatron-core 0.16, `get_gpt_layer_local_spec(num_experts=E)` or the Transformer
Engine spec without grouped GEMM: `SequentialMLP`, one `MLP` per local expert):

    HF (transformers 5, in memory)              megatron (one layer)
    mlp.gate.weight            [E, H]           mlp.router.weight                           [E, H]
    mlp.experts.gate_up_proj   [E, 2I, H]       mlp.experts.local_experts.{e}.linear_fc1.weight [2I, H]
    mlp.experts.down_proj      [E, H, I]        mlp.experts.local_experts.{e}.linear_fc2.weight [H, I]

`gate_up_proj[e]` is `[gate; up]` (Qwen3MoeExperts chunks it in that order), exactly
megatron's SwiGLU fc1, so an expert's fc1 is that slice as is; the TP rule of a dense fc1
applies to it unchanged (megatron_convert.shard_tp matches on the name's ending). Checkpoints
on disk keep one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
`down_proj`: transformers converts them on load and back on save); `experts_to_megatron`
reads either form, `experts_to_hf` writes the in-memory one (what the torch trainer
publishes, and what `Qwen3MoeForCausalLM.load_state_dict` takes).

Routing: HF's `Qwen3MoeTopKRouter` takes softmax over all experts, the top k, and with
`norm_topk_prob` renormalises them to sum to one. megatron's `topk_routing_with_score_function`
(moe_utils.py) with score function softmax and `moe_router_pre_softmax=False` takes the top k
of the logits and a softmax over those k: the same numbers (softmax is monotone, and the
renormalised top-k softmax is the softmax of the top-k logits). Without `norm_topk_prob`,
`moe_router_pre_softmax=True` is softmax over all, then the top k, unnormalised: HF's too.

Pure tensor code here except `moe_transformer_kwargs` (which reads the config only).
"""

from __future__ import annotations

from typing import Any

import torch

Tensors = dict[str, torch.Tensor]

FC1 = "mlp.experts.local_experts.{e}.linear_fc1.weight"
FC2 = "mlp.experts.local_experts.{e}.linear_fc2.weight"
ROUTER = "mlp.router.weight"
LOAD_BALANCING = ("none", "aux_loss")
# megatron-core 0.16 refuses MoE with TP > 1 unless sequence parallelism is on
# (TransformerConfig), its local norms refuse sequence parallelism (WrappedTorchNorm), and
# the routing replay grid would need each TP rank's slice of the sequence: not done yet.
TP_REFUSAL = ("train.tensor_parallel = {tp} with an MoE model: the megatron backend runs MoE "
              "models at TP 1 for now (megatron needs sequence parallelism there); split the "
              "experts with train.expert_parallel instead, or set train.tensor_parallel = 1")


def shape_fields(config: Any) -> dict[str, int]:
    """ModelShape's MoE fields from a Hugging Face config ({} for a dense model)."""
    if getattr(config, "model_type", "") != "qwen3_moe":
        return {}
    experts = int(config.num_experts)
    sparse_step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        # megatron could mix them (moe_layer_freq), but every converter here assumes one
        # MLP kind per model; the published Qwen3-MoE checkpoints are all-MoE.
        raise ValueError(
            f"qwen3_moe with decoder_sparse_step={sparse_step} / mlp_only_layers="
            f"{dense_layers}: the megatron backend supports models whose every layer is MoE "
            f"(decoder_sparse_step=1, mlp_only_layers=[]); use the torch backend")
    return {"num_experts": experts, "moe_top_k": int(config.num_experts_per_tok),
            "moe_ffn_hidden_size": int(config.moe_intermediate_size)}


def experts_to_megatron(hf: Tensors, h: str, m: str, experts: int) -> Tensors:
    """One layer's router and experts under megatron names (`h`, `m`: the layer prefixes)."""
    out: Tensors = {m + ROUTER: hf[h + "mlp.gate.weight"]}
    fused = h + "mlp.experts.gate_up_proj"
    if fused in hf:
        gate_up, down = hf[fused], hf[h + "mlp.experts.down_proj"]
        if gate_up.shape[0] != experts:
            raise ValueError(f"{fused} holds {gate_up.shape[0]} experts; the config says "
                             f"num_experts={experts}")
        for e in range(experts):
            out[m + FC1.format(e=e)] = gate_up[e]
            out[m + FC2.format(e=e)] = down[e]
        return out
    for e in range(experts):  # the per-expert form of checkpoints on disk
        x = f"{h}mlp.experts.{e}."
        out[m + FC1.format(e=e)] = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
        out[m + FC2.format(e=e)] = hf[x + "down_proj.weight"]
    return out


def experts_to_hf(mc: Tensors, h: str, m: str, experts: int) -> Tensors:
    """Inverse of `experts_to_megatron`: transformers' fused 3-D expert tensors (new storage:
    one layer's experts at a time, which is what the export streams)."""
    return {
        h + "mlp.gate.weight": mc[m + ROUTER],
        h + "mlp.experts.gate_up_proj": torch.stack([mc[m + FC1.format(e=e)] for e in range(experts)]),
        h + "mlp.experts.down_proj": torch.stack([mc[m + FC2.format(e=e)] for e in range(experts)]),
    }


def _expert_index(name: str) -> tuple[str, int, str] | None:
    """(prefix, expert, rest) of a local-expert tensor name, None for any other."""
    marker = "mlp.experts.local_experts."
    if marker not in name:
        return None
    head, tail = name.split(marker, 1)
    e, rest = tail.split(".", 1)
    return head + marker, int(e), rest


def select_experts(local: Tensors, experts: int, ep_size: int, ep_rank: int) -> Tensors:
    """Expert-parallel rank `ep_rank`'s share of a (TP-sharded) state dict: experts
    ep_rank * E / ep_size onwards, renumbered from 0 (megatron's local expert names)."""
    if ep_size == 1:
        return local
    if experts % ep_size:
        raise ValueError(f"train.expert_parallel = {ep_size} must divide the model's "
                         f"{experts} experts")
    per = experts // ep_size
    out: Tensors = {}
    for name, t in local.items():
        parsed = _expert_index(name)
        if parsed is None:
            out[name] = t
        elif ep_rank * per <= parsed[1] < (ep_rank + 1) * per:
            out[f"{parsed[0]}{parsed[1] - ep_rank * per}.{parsed[2]}"] = t
    return out


def renumber_experts(unit: Tensors, offset: int) -> Tensors:
    """Local expert j -> expert offset + j (the inverse of `select_experts` for one rank)."""
    out: Tensors = {}
    for name, t in unit.items():
        parsed = _expert_index(name)
        out[name if parsed is None else f"{parsed[0]}{parsed[1] + offset}.{parsed[2]}"] = t
    return out


def moe_transformer_kwargs(hf_config: Any, shape: Any, load_balancing: str,
                           routing_replay: bool, tensor_parallel: int = 1) -> dict[str, Any]:
    """TransformerConfig keys for the experts ({} for a dense model).

    `load_balancing` (train.moe_load_balancing) is "none" by default: the auxiliary
    loss adds a gradient that is not the policy's objective (the torch trainer, like the
    HF model with output_router_logits=False, adds none), and under routing replay the
    routing it would balance is the engine's, not the router's own. "aux_loss" uses the
    model's `router_aux_loss_coef`.
    """
    if not shape.num_experts:
        return {}
    if tensor_parallel > 1:
        raise ValueError(TP_REFUSAL.format(tp=tensor_parallel))
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"train.moe_load_balancing={load_balancing!r}: use one of {LOAD_BALANCING}")
    normalise = bool(getattr(hf_config, "norm_topk_prob", False))
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": shape.moe_top_k,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax",
        # see the module docstring: pre-softmax off = softmax over the top k (renormalised)
        "moe_router_pre_softmax": not normalise,
        "moe_router_topk_scaling_factor": None,
        "moe_router_load_balancing_type": load_balancing,
        "moe_aux_loss_coeff": (float(getattr(hf_config, "router_aux_loss_coef", 0.0))
                               if load_balancing == "aux_loss" else 0.0),
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,  # SequentialMLP: the per-expert names above
        # Replay goes through the router's `router_replay` slot (megatron_replay.py), which
        # Transformer Engine's fused top-k kernel would bypass.
        **({"moe_router_fusion": False} if routing_replay else {}),
    }


def patch_router_gemm_without_te() -> None:
    """megatron-core 0.16's router GEMM (moe_utils.RouterGatingLinearFunction) tests
    `te_general_gemm is not None`, but without Transformer Engine that name is never bound
    (its import sits inside the `try` that fails), so every MoE forward raises NameError.
    Binding it to None selects the torch.mm path the code means for that case. Harmless
    where TE is installed (the name is bound and left alone)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_tensor(ckpt: Any, rest: str, h: str, ffn: int, tp_rank: int,
                  first_expert: int = 0) -> torch.Tensor:
    """One router / expert tensor of a layer (`rest`: its megatron name within the layer,
    `h`: the HF layer prefix) for TP rank `tp_rank`, whose slice of each expert's
    intermediate width is `ffn` wide, read alone from a megatron_load.HFCheckpoint: the
    per-expert tensors of a saved checkpoint, or the fused 3-D ones where those are stored.
    Local expert j is global expert `first_expert` + j (expert parallelism)."""
    if rest == ROUTER:
        return ckpt.rows(h + "mlp.gate.weight")
    e_str, kind = rest[len("mlp.experts.local_experts."):].split(".", 1)
    e, f0, f1 = first_expert + int(e_str), tp_rank * ffn, (tp_rank + 1) * ffn
    x = f"{h}mlp.experts.{e}."
    fused = h + "mlp.experts.gate_up_proj"
    if kind == "linear_fc1.weight":
        if x + "gate_proj.weight" in ckpt:
            return torch.cat([ckpt.rows(x + "gate_proj.weight", f0, f1),
                              ckpt.rows(x + "up_proj.weight", f0, f1)])
        width = ckpt.shape(fused)[1] // 2  # [gate; up] along dim 1
        one = slice(e, e + 1)
        return torch.cat([ckpt.index(fused, one, slice(f0, f1))[0],
                          ckpt.index(fused, one, slice(width + f0, width + f1))[0]])
    if kind == "linear_fc2.weight":
        if x + "down_proj.weight" in ckpt:
            return ckpt.cols(x + "down_proj.weight", f0, f1)
        down = h + "mlp.experts.down_proj"
        return ckpt.index(down, slice(e, e + 1), slice(None), slice(f0, f1))[0]
    raise KeyError(f"megatron tensor decoder.layers.<i>.{rest} has no Hugging Face source "
                   f"(expected a Qwen3-MoE router or expert)")
