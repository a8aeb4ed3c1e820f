"""megatron-core GPTModel for a Hugging Face Llama / Qwen2 config: build, load, score, export.

Written against megatron-core 0.16.1 (`pip install --no-deps megatron-core==0.16.1`); the
APIs used are `parallel_state.initialize_model_parallel`,
`tensor_parallel.model_parallel_cuda_manual_seed`, `TransformerConfig`, `GPTModel`,
`get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec` and
`tensor_parallel.vocab_parallel_cross_entropy`. megatron-core is imported lazily, so this
module imports (and its config validates) without it.

Layout of one process: TP × PP × DP ranks from `torch.distributed` (already initialised by
the caller); this rank holds one pipeline stage's layers, TP-sharded. Weights travel as full
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

from rl_async.train import megatron_convert as conv

IMPLS = ("local", "transformer_engine")


def megatron_available() -> bool:
    return importlib.util.find_spec("megatron.core") is not None


@dataclass
class MegatronParallelConfig:
    """Model-parallel layout and model build options; DP = world_size / (TP × PP)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "local" runs anywhere megatron-core runs; "transformer_engine" needs TE on a GPU.
    transformer_impl: str = "local"
    params_dtype: str = "float32"       # "bfloat16" on GPU
    vocab_divisible_by: int = 128       # megatron pads the vocab to a multiple of this × TP
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "vocab_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"megatron.{key}={getattr(self, key)} must be >= 1")
        if self.transformer_impl not in IMPLS:
            raise ValueError(f"megatron.transformer_impl={self.transformer_impl!r}: use one of {IMPLS}")
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
        return world_size // model_parallel


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
    """megatron TransformerConfig equivalent to a Hugging Face Llama / Qwen2 config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = conv.ModelShape.from_hf_config(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU ('silu') models are supported")
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
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
        pipeline_dtype=cfg.dtype,
        params_dtype=cfg.dtype,
        bf16=cfg.dtype == torch.bfloat16,
        variable_seq_lengths=True,  # every collection is padded to its own length
        # Dense model: the MoE dispatcher is unused, but the default ("allgather") is
        # rejected together with variable_seq_lengths by TransformerConfig's checks.
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not on_gpu,
        # Fused CUDA kernels only where they exist.
        bias_activation_fusion=False,
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
    if cfg.transformer_impl == "transformer_engine":
        layer_spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
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
                        tp_rank: int, pp_rank: int) -> dict[str, Tensor]:
    """The megatron tensors that TP rank `tp_rank` of stage `pp_rank` holds."""
    shape = model_shape(hf_config, cfg)
    rows = conv.padded_vocab_size(shape.vocab_size, cfg.tensor_parallel_size, cfg.vocab_divisible_by)
    full = conv.hf_to_megatron(hf_state, shape, vocab_rows=rows)
    stage = conv.split_pp(full, shape, cfg.pipeline_parallel_size)[pp_rank]
    return conv.shard_tp(stage, shape, cfg.tensor_parallel_size)[tp_rank]


def load_hf_weights(model: Any, hf_state: dict[str, Tensor], hf_config: Any, cfg: MegatronParallelConfig) -> None:
    """Copy full Hugging Face weights into this rank's (TP-sharded, PP-staged) GPTModel."""
    from megatron.core import parallel_state

    local = local_state_from_hf(
        hf_state, hf_config, cfg,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
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
        parallel_state.get_pipeline_model_parallel_rank(), rows)
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
    the padding after them.
    """
    B, L = input_ids_BL.shape
    pos_BL = torch.arange(L, device=input_ids_BL.device).unsqueeze(0).expand(B, L)
    return model(input_ids_BL, pos_BL, causal_mask(L, input_ids_BL.device))


def logprobs_from_logits(logits_BLV: Tensor, targets_BT: Tensor, start: int, temperature: float,
                         vocab_size: int) -> Tensor:
    """log_softmax(logits / T) of each target over the full vocabulary, TP-aware, [B, T] fp32.

    Positions `start .. L-2` predict `targets_BT`. Padded vocab columns are excluded, so the
    distribution matches the Hugging Face model's (and the engine's).
    """
    from megatron.core import parallel_state, tensor_parallel

    L = logits_BLV.shape[1]
    logits = logits_BLV[:, start:L - 1].float() / temperature
    v_local = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * v_local
    if first + v_local > vocab_size:
        cols = torch.arange(first, first + v_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
    # megatron's cross entropy takes [T, B, V/TP] and returns −log p, reduced over TP.
    nll_TB = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), targets_BT.transpose(0, 1).contiguous()
    )
    return -nll_TB.transpose(0, 1)


@torch.no_grad()
def entropy_from_logits(logits_BLV: Tensor, start: int, temperature: float, vocab_size: int) -> Tensor:
    """Entropy of softmax(logits / T) at positions `start .. L-2`, [B, T] fp32, detached.

    The vocabulary is split over TP ranks, so the max, the partition sum and Σ e·(z − max)
    are all-reduced over the TP group: H = log Z − Σ e·(z − m) / Z with e = exp(z − m).
    Padded vocab columns are excluded (as in `logprobs_from_logits`).
    """
    from megatron.core import parallel_state

    L = logits_BLV.shape[1]
    z = logits_BLV[:, start:L - 1].detach().float() / temperature
    v_local = z.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * v_local
    real = torch.arange(first, first + v_local, device=z.device) < vocab_size
    z = z.masked_fill(~real, float("-inf"))
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    m = z.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = (z - m.unsqueeze(-1)).masked_fill(~real, 0.0)
    e = torch.exp(shifted).masked_fill(~real, 0.0)
    sums = torch.stack([e.sum(-1), (e * shifted).sum(-1)])
    if tp > 1:
        dist.all_reduce(sums, group=group)
    return torch.log(sums[0]) - sums[1] / sums[0]


def export_hf_state(model: Any, hf_config: Any, cfg: MegatronParallelConfig) -> dict[str, Tensor]:
    """Full Hugging Face tensors on every rank: all-gather over TP, then over PP stages."""
    from megatron.core import parallel_state

    shape = model_shape(hf_config, cfg)
    local = {k: v.detach() for k, v in _tensor_state(model).items()}
    tp = cfg.tensor_parallel_size
    if tp > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        per_rank: list[dict[str, Tensor]] = [{} for _ in range(tp)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            for r, p in enumerate(parts):
                per_rank[r][name] = p
        local = conv.unshard_tp(per_rank)
    if cfg.pipeline_parallel_size > 1:
        # Stages hold different tensors; objects travel via CPU pickling (export is rare).
        stages: list[Any] = [None] * cfg.pipeline_parallel_size
        cpu_local = {k: v.cpu() for k, v in local.items()}
        dist.all_gather_object(stages, cpu_local, group=parallel_state.get_pipeline_model_parallel_group())
        local = conv.merge_pp(stages, shape)
    return conv.megatron_to_hf(local, shape)
