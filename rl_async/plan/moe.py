"""What a model's config says about its experts, and whether routing replay is on.

Pure (no torch): the plan, `validate`, the engines' launch arguments and the trainer all ask
the same two questions of a Hugging Face config dict (`model.hf_config`, or
`model.architecture` / config.json for a checkpoint):

- `moe_dims(config)`: experts per MoE layer, top-k, MoE layers, the expert FFN width and any
  shared expert, or None for a dense model. The families transformers ships name these
  differently: Qwen2-MoE / Qwen3-MoE / OLMoE `num_experts`, Mixtral `num_local_experts`,
  DeepSeek-V3 / Kimi K2 / GLM-4.5 `n_routed_experts`, gpt-oss `num_local_experts`.
- `routing_replay_on(setting, config)`: `train.routing_replay` resolved ("auto" = on for MoE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass(frozen=True)
class MoEDims:
    experts: int            # routed experts per MoE layer
    top_k: int              # experts chosen per token
    moe_layers: int         # decoder layers whose MLP is a mixture (the rest are dense)
    expert_ffn: int         # one expert's intermediate width
    shared_ffn: int = 0     # a shared expert's intermediate width (Qwen2-MoE, DeepSeek), 0: none

    @property
    def id_bytes(self) -> int:
        """Bytes per recorded expert id (rl_async.base.types.RoutedExperts)."""
        return 1 if self.experts <= 256 else 2

    def replay_bytes_per_token(self) -> int:
        """Routing replay's storage per token of a sample: every MoE layer's top-k ids."""
        return self.moe_layers * self.top_k * self.id_bytes


def _first(config: dict[str, Any], names: tuple[str, ...]) -> Any:
    return next((config[n] for n in names if config.get(n) is not None), None)


def moe_layer_ids(config: dict[str, Any]) -> tuple[int, ...]:
    """Indices of the decoder layers with a mixture MLP. Qwen2/3-MoE: `mlp_only_layers` are
    dense and only every `decoder_sparse_step`-th layer is sparse; DeepSeek-V3: the first
    `first_k_dense_replace` layers are dense; the others: every layer. (SGLang reports
    routes for every decoder layer, dense ones as zeros: its engine keeps these.)"""
    layers = int(config.get("num_hidden_layers", 0))
    dense_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return tuple(i for i in range(layers)
                 if i not in dense_only and (i + 1) % step == 0 and i >= first_dense)


def moe_layer_count(config: dict[str, Any]) -> int:
    """Decoder layers with a mixture MLP (`moe_layer_ids`)."""
    return len(moe_layer_ids(config))


def moe_dims(config: dict[str, Any] | None) -> MoEDims | None:
    """The model's experts, or None for a dense model (or no config to read)."""
    if not config:
        return None
    experts = _first(config, _EXPERTS)
    if not experts or int(experts) <= 1:
        return None
    top_k = int(_first(config, _TOP_K) or 1)
    ffn = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if not shared and config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * ffn
    return MoEDims(int(experts), top_k, moe_layer_count(config), ffn, shared)


def routing_replay_on(setting: str, config: dict[str, Any] | None) -> bool:
    """`train.routing_replay` resolved: "r3" on, "off" off, "auto" on exactly for MoE."""
    if setting not in ("auto", "r3", "off"):
        raise ValueError(f"train.routing_replay = {setting!r}: use 'auto', 'r3' or 'off'")
    return setting == "r3" or (setting == "auto" and moe_dims(config) is not None)


def replay_for(cfg, setting: str) -> bool:
    """`setting` (cfg.train.routing_replay) for this run's model: whether it records and
    replays routing (the model's config where readable)."""
    from rl_async.plan.memory import architecture  # memory reads this module's dims

    return routing_replay_on(setting, architecture(cfg)[0])
