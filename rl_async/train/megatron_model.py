"""megatron-core GPTModel for a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE config: build,
load, score, export (experts and router: rl_async/train/megatron_moe.py).

Written against megatron-core 0.16.1 (`pip install --no-deps megatron-core==0.16.1`); the
APIs used are `parallel_state.initialize_model_parallel`,
`tensor_parallel.model_parallel_cuda_manual_seed`, `TransformerConfig`, `GPTModel`,
`get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec` and
`tensor_parallel.vocab_parallel_cross_entropy`. megatron-core is imported lazily, so this
module imports (and its config validates) without it.

Layout of one process: TP × PP × DP ranks from `torch.distributed` (already initialised by
the caller); this rank holds one pipeline stage's layers, TP-sharded, and for an
MoE model E / EP of each layer's experts (EP ranks are carved out of DP). Weights travel as full
Hugging Face tensors in, and full Hugging Face tensors out (gathered over TP and PP).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rl_async.train import logits as logits_lib
from rl_async.train import megatron_convert as conv
from rl_async.train import megatron_moe as moe

IMPLS = ("local", "transformer_engine")
RECOMPUTE = ("none", "selective", "full")


def resolve_transformer_impl(requested: str) -> str:
    """train.transformer_impl: "auto" is Transformer Engine when it is importable and a GPU
    is there, else megatron's local attention; an explicit "transformer_engine" without TE
    is an error naming the key (never a silent fallback to the memory-hungry local path)."""
    have_te = (importlib.util.find_spec("transformer_engine") is not None
               and torch.cuda.is_available())
    if requested == "auto":
        return "transformer_engine" if have_te else "local"
    if requested == "transformer_engine" and not have_te:
        raise RuntimeError("train.transformer_impl = 'transformer_engine' needs Transformer "
                           "Engine on a GPU (pip install transformer_engine[pytorch]); or set "
                           "'local' (its s x s attention scores: see rl-async plan's memory)")
    return requested


@dataclass
class MegatronParallelConfig:
    """Model-parallel layout and model build options; DP = world_size / (TP × PP)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE: each layer's experts split over this many ranks of the data-parallel group
    # (megatron's expert_model_parallel_size; experts keep TP = tensor_parallel_size).
    expert_parallel_size: int = 1
    # "local" runs anywhere megatron-core runs; "transformer_engine" needs TE on a GPU.
    transformer_impl: str = "local"
    params_dtype: str = "float32"       # "bfloat16" on GPU
    vocab_divisible_by: int = 128       # megatron pads the vocab to a multiple of this × TP
    seed: int = 0
    recompute: str = "none"             # activation recompute: none | selective | full
    # megatron's fused SwiGLU (bias_activation_fusion): it keeps only its input for the
    # backward (fused_bias_swiglu.py SwiGLUFunction: 3f/t saved per token) where the unfused
    # glu keeps the fc1 output, silu(x_glu), x_linear + 0 and the product (mlp.py: 5f/t).
    # None: fused on GPU (its kernel is torch.compile'd), unfused on CPU. The memory plan
    # counts the same rule (rl_async/plan/memory.py swiglu_saved).
    activation_fusion: bool | None = None
    # MoE models only (megatron_moe.moe_transformer_kwargs says why "none" is the default).
    moe_load_balancing: str = "none"
    routing_replay: bool = False        # megatron's RouterReplay forces recorded experts

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                    "vocab_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"megatron.{key}={getattr(self, key)} must be >= 1")
        if self.transformer_impl not in IMPLS:
            raise ValueError(f"megatron.transformer_impl={self.transformer_impl!r}: use one of {IMPLS}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"train.recompute={self.recompute!r}: use one of {RECOMPUTE}")
        if self.moe_load_balancing not in moe.LOAD_BALANCING:
            raise ValueError(f"train.moe_load_balancing={self.moe_load_balancing!r}: use one "
                             f"of {moe.LOAD_BALANCING}")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"megatron.params_dtype={self.params_dtype!r}: use 'float32' or 'bfloat16'")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.params_dtype)

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not a multiple of tensor_parallel_size × "
                f"pipeline_parallel_size = {model_parallel}"
            )
        dp = world_size // model_parallel
        if dp % self.expert_parallel_size:
            raise ValueError(f"train.expert_parallel = {self.expert_parallel_size} must divide "
                             f"the {dp} data-parallel ranks (experts are split over ranks "
                             f"that hold the same layers)")
        return dp


def initialize_parallel(cfg: MegatronParallelConfig) -> None:
    """Create megatron's TP/PP/DP groups and RNG states; torch.distributed must be initialised."""
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed (rl_async.train.distributed) before megatron")
    cfg.data_parallel_size(dist.get_world_size())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_parallel_size,
            expert_model_parallel_size=cfg.expert_parallel_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)


def _rope_theta(hf_config: Any) -> float:
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported by the megatron backend yet; use a "
            f"model with default RoPE or the torch backend"
        )
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))


def transformer_config(hf_config: Any, cfg: MegatronParallelConfig) -> Any:
    """megatron TransformerConfig equivalent to a Hugging Face config (conv.SUPPORTED)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = conv.ModelShape.from_hf_config(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU ('silu') models are supported")
    on_gpu = torch.cuda.is_available()
    recompute: dict[str, Any] = {}
    if cfg.recompute == "selective":  # core attention: its s x s scores are never kept
        recompute = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    elif cfg.recompute == "full":  # every layer from its input, one layer at a time
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 1}
    # Dense model: the MoE dispatcher is unused, but the default ("allgather") is rejected
    # together with variable_seq_lengths by TransformerConfig's checks.
    experts = {"moe_token_dispatcher_type": "alltoall"}
    experts.update(moe.moe_transformer_kwargs(hf_config, shape, cfg.moe_load_balancing,
                                              cfg.routing_replay, cfg.tensor_parallel_size))
    return TransformerConfig(
        **recompute,
        **experts,
        transformer_impl=cfg.transformer_impl,  # forward_logits reads it (the mask)
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        qk_layernorm=shape.qk_norm,  # Qwen3: RMSNorm per head (the same `normalization`)
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,  # RL fine-tuning: log-probs must match the engine's
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
        pipeline_dtype=cfg.dtype,
        params_dtype=cfg.dtype,
        bf16=cfg.dtype == torch.bfloat16,
        variable_seq_lengths=True,  # every collection is padded to its own length
        use_cpu_initialization=not on_gpu,
        # Fused CUDA kernels only where they exist; the SwiGLU one saves 2f/t per token.
        bias_activation_fusion=(on_gpu if cfg.activation_fusion is None
                                else cfg.activation_fusion),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def build_gpt_model(hf_config: Any, cfg: MegatronParallelConfig) -> Any:
    """This rank's GPTModel stage (parallel state must be initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    tcfg = transformer_config(hf_config, cfg)
    shape = conv.ModelShape.from_hf_config(hf_config)
    spec_args = {"num_experts": shape.num_experts or None, "moe_grouped_gemm": False,
                 "qk_layernorm": shape.qk_norm}
    if cfg.transformer_impl == "transformer_engine":
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec(**spec_args)
    else:
        layer_spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **spec_args)
    if shape.num_experts:
        moe.patch_router_gemm_without_te()
    vocab = conv.padded_vocab_size(hf_config.vocab_size, cfg.tensor_parallel_size, cfg.vocab_divisible_by)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def model_shape(hf_config: Any, cfg: MegatronParallelConfig) -> conv.ModelShape:
    return conv.ModelShape.from_hf_config(hf_config, te_norm_names=cfg.transformer_impl == "transformer_engine")


def local_state_from_hf(hf_state: dict[str, Tensor], hf_config: Any, cfg: MegatronParallelConfig,
                        tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict[str, Tensor]:
    """The megatron tensors that TP rank `tp_rank` of stage `pp_rank` (and expert-parallel
    rank `ep_rank`: its share of each layer's experts) holds."""
    shape = model_shape(hf_config, cfg)
    rows = conv.padded_vocab_size(shape.vocab_size, cfg.tensor_parallel_size, cfg.vocab_divisible_by)
    full = conv.hf_to_megatron(hf_state, shape, vocab_rows=rows)
    stage = conv.split_pp(full, shape, cfg.pipeline_parallel_size)[pp_rank]
    local = conv.shard_tp(stage, shape, cfg.tensor_parallel_size)[tp_rank]
    return moe.select_experts(local, shape.num_experts, cfg.expert_parallel_size, ep_rank)


def load_hf_weights(model: Any, hf_state: dict[str, Tensor], hf_config: Any, cfg: MegatronParallelConfig) -> None:
    """Copy full Hugging Face weights into this rank's (TP-sharded, PP-staged) GPTModel."""
    from megatron.core import parallel_state

    local = local_state_from_hf(
        hf_state, hf_config, cfg,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_rank(),
    )
    params = _tensor_state(model)
    missing = sorted(set(params) - set(local))
    unexpected = sorted(set(local) - set(params))
    if missing or unexpected:
        raise KeyError(f"megatron model and converted weights disagree: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, tensor in params.items():
            if tensor.shape != local[name].shape:
                raise ValueError(f"{name}: model shape {tuple(tensor.shape)} vs converted {tuple(local[name].shape)}")
            tensor.copy_(local[name])


def load_hf_checkpoint(model: Any, ckpt: Any, hf_config: Any, cfg: MegatronParallelConfig) -> None:
    """Copy this rank's slices of a safetensors checkpoint (megatron_load.HFCheckpoint) into
    its GPTModel, one tensor at a time: no rank ever holds the full model on the host."""
    from megatron.core import parallel_state

    from rl_async.train import megatron_load

    shape = model_shape(hf_config, cfg)
    rows = conv.padded_vocab_size(shape.vocab_size, cfg.tensor_parallel_size, cfg.vocab_divisible_by)
    params = _tensor_state(model)
    tensors = megatron_load.local_tensors(
        ckpt, list(params), shape, cfg.tensor_parallel_size,
        parallel_state.get_tensor_model_parallel_rank(), cfg.pipeline_parallel_size,
        parallel_state.get_pipeline_model_parallel_rank(), rows,
        cfg.expert_parallel_size, parallel_state.get_expert_model_parallel_rank())
    with torch.no_grad():
        for name, tensor in tensors:
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: model shape {tuple(params[name].shape)} vs checkpoint "
                                 f"slice {tuple(tensor.shape)}")
            params[name].copy_(tensor)


def _tensor_state(model: Any) -> dict[str, Tensor]:
    """Parameters and buffers by megatron name, without TE `_extra_state` entries."""
    sd = model.state_dict(keep_vars=True)
    return {k: v for k, v in sd.items() if isinstance(v, Tensor) and not k.endswith("_extra_state")}


def causal_mask(seq_len: int, device: torch.device) -> Tensor:
    """megatron's boolean mask convention: True = masked (future positions)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def forward_logits(model: Any, input_ids_BL: Tensor) -> Tensor:
    """[B, L, V/TP] logits (last stage) or hidden states (other stages); right padding only.

    Right padding needs no padding mask under causal attention: real tokens never attend to
    the padding after them. Transformer Engine's layers apply the causal mask themselves
    (attn_mask_type=causal in its layer spec) and take no mask tensor.
    """
    B, L = input_ids_BL.shape
    pos_BL = torch.arange(L, device=input_ids_BL.device).unsqueeze(0).expand(B, L)
    te = getattr(model, "config", None) is not None and getattr(
        model.config, "transformer_impl", "local") == "transformer_engine"
    return model(input_ids_BL, pos_BL, None if te else causal_mask(L, input_ids_BL.device))


def token_logprobs(logits_BLV: Tensor, targets_BT: Tensor, start: int, temperature: float,
                   vocab_size: int, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / T) of each target over the full vocabulary, and the entropy of
    that distribution (detached) when asked: [B, T] fp32, TP-aware, over vocabulary chunks
    (rl_async/train/logits.py: no fp32 copy of the logits). Positions `start .. L-2`
    predict `targets_BT`; padded vocab columns are excluded, so the distribution matches the
    Hugging Face model's (and the engine's)."""
    from megatron.core import parallel_state

    L, v_local = logits_BLV.shape[1], logits_BLV.shape[-1]
    return logits_lib.token_logprobs(
        logits_BLV[:, start:L - 1], targets_BT, temperature, vocab_size=vocab_size,
        group=parallel_state.get_tensor_model_parallel_group(),
        first_column=parallel_state.get_tensor_model_parallel_rank() * v_local,
        with_entropy=with_entropy)
