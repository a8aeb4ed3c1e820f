"""Memory per GPU, planned from the model's config alone, before a GPU is allocated.

`rl-async plan` shows it (JSON: `runtime.memory`); `validate` warns past 90% of
`cluster.gpu_memory_gb` (TRAINER_MEMORY, ENGINE_MEMORY) and errs past 100%. Needs no GPU,
no megatron-core, no Transformer Engine. Every number is GiB. The formulas, their sources
and how they compare with measurements are in docs/memory.md; in short, per trainer GPU:

    static       = weights + gradients + optimizer state            (bytes per parameter)
    activations  = per layer per token x tokens per micro-batch x layers held at once
    logits       = the last stage's [tokens, vocab / TP] logits and their gradient
    publication  = two buckets on trainer rank 0 while a publication sends (between steps)
    runtime      = CUDA context, NCCL buffers, allocator slack (a fixed allowance)

and per engine GPU (SGLang): the static pool (`sglang.mem_fraction_static` of the GPU: the
weights, then the KV cache in the rest of it) plus an allowance for activations and CUDA
graphs outside it. Mixture-of-experts models (rl_async/plan/moe.py reads their experts): a
mixture layer holds the router and every routed expert instead of the dense MLP; megatron
shards the experts over train.expert_parallel and TP (its default expert_tensor_parallel_size),
the distributed optimizer over the DP / EP ranks that hold the same experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from rl_async.plan.moe import MoEDims, moe_dims

if TYPE_CHECKING:  # the GPU checks use this module on machines without pydantic
    from rl_async.plan.capacity import CapacityPlan, Warning_
    from rl_async.plan.config import RunConfig

GiB = 1024 ** 3
ASSUMED_PROMPT_TOKENS = 512     # when rollout.max_prompt_len is unset
RUNTIME_GB = 3.0                # CUDA context ~0.5-1, NCCL communicators ~1, allocator slack
ENGINE_OUTSIDE_POOL_GB = 2.5    # SGLang: activations and CUDA graphs outside the static pool
LOGITS_CHUNK = 8192             # rl_async/train/logits.py DEFAULT_CHUNK
# Device buffers trainer rank 0 sends buckets from (rl_async/state/device_buckets.py): a
# hung channel holds one, the others share the rest.
PUBLICATION_DEVICE_BUCKETS = 2


REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k
    moe: MoEDims | None = None     # None: dense
    shared_gate: bool = False      # Qwen2-MoE: a sigmoid gate (h -> 1) on the shared expert

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> Dims:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        kind = c.get("model_type")
        moe = moe_dims(c)
        return cls(vocab=int(c["vocab_size"]), hidden=hidden,
                   layers=int(c["num_hidden_layers"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or hidden // heads),
                   ffn=int(c["intermediate_size"]), tied=bool(c.get("tie_word_embeddings")),
                   qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and c.get("qkv_bias", True)),
                   qk_norm=kind in ("qwen3", "qwen3_moe"), moe=moe,
                   shared_gate=kind == "qwen2_moe" and bool(moe and moe.shared_ffn))

    @property
    def attention_params(self) -> int:
        """One layer's attention and its two norms (the part dense and mixture layers share)."""
        h, d = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * d
        bias = (self.heads + 2 * self.kv_heads) * d if self.qkv_bias else 0
        qk_norm = 2 * d if self.qk_norm else 0
        return qkv + bias + self.heads * d * h + 2 * h + qk_norm

    @property
    def layer_params(self) -> int:
        """A dense layer: attention and a SwiGLU MLP (gate, up, down)."""
        return self.attention_params + 3 * self.hidden * self.ffn

    @property
    def moe_layer_params(self) -> int:
        """A mixture layer: attention, the router (experts x h), every routed expert's SwiGLU
        and any shared expert's (with Qwen2-MoE's gate on it)."""
        m, h = self.moe, self.hidden
        if m is None:
            return self.layer_params
        return (self.attention_params + m.experts * h + m.experts * 3 * h * m.expert_ffn
                + 3 * h * m.shared_ffn + (h if self.shared_gate else 0))

    @property
    def expert_params(self) -> int:
        """Every routed expert of the model: what train.expert_parallel shards."""
        m = self.moe
        return m.moe_layers * m.experts * 3 * self.hidden * m.expert_ffn if m else 0

    @property
    def body_params(self) -> int:
        """All decoder layers, dense and mixture."""
        moe_layers = self.moe.moe_layers if self.moe else 0
        return (self.layers - moe_layers) * self.layer_params + moe_layers * self.moe_layer_params

    @property
    def params(self) -> int:
        return (self.vocab * self.hidden * (1 if self.tied else 2) + self.body_params
                + self.hidden)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: top_k of each mixture layer's experts."""
        m = self.moe
        if m is None:
            return self.params
        return self.params - m.moe_layers * (m.experts - m.top_k) * 3 * self.hidden * m.expert_ffn

    def activation_bytes_per_token(self, tp: int, elem: int, swiglu: int = 3) -> float:
        """One layer's saved activations per token, sharded over TP (linear terms only):
        input and post-attention residuals and norm outputs (4h), q/k/v, the rotated q/k and
        the attention context ((a + 2g) + (a + g) + a) d / t, and SwiGLU's `swiglu` x f / t
        (`swiglu_saved`: what the MLP path that runs keeps). A mixture layer keeps instead
        the router's scores (experts), the top_k copies of each token its experts read
        (top_k x h) and SwiGLU over top_k x expert_ffn (and a shared expert's width): the
        mean over the layers, assuming balanced routing."""
        d, a, g = self.head_dim, self.heads, self.kv_heads
        common = 4 * self.hidden + ((a + 2 * g) + (a + g) + a) * d / tp
        dense = common + swiglu * self.ffn / tp
        m = self.moe
        if m is None:
            return dense * elem
        mixture = (common + m.experts + m.top_k * self.hidden
                   + swiglu * (m.top_k * m.expert_ffn + m.shared_ffn) / tp)
        mean = ((self.layers - m.moe_layers) * dense + m.moe_layers * mixture) / self.layers
        return mean * elem


def swiglu_saved(backend: str, fused: bool) -> int:
    """f-sized tensors one SwiGLU MLP keeps for its backward, per token (measured on
    megatron-core 0.16.1's own MLP by tests/unit/test_memory_plan.py):
    megatron fused (fused_bias_swiglu.py SwiGLUFunction saves its input): the fc1 output
      (2f) + the product fc2 reads (f) = 3;
    megatron unfused (mlp.py glu: silu saves x_glu, a view of the fc1 output; the multiply
      saves silu(x_glu) and x_linear + glu_linear_offset, a new tensor): 2f + f + f + f = 5;
    Hugging Face's LlamaMLP (torch backend): gate, silu(gate), up and the product = 4."""
    if backend == "megatron":
        return 3 if fused else 5
    return 4


@dataclass(frozen=True)
class MemoryInputs:
    """The run settings the estimates read (`inputs(cfg)` takes them from a run file)."""

    backend: str                       # train.backend
    trainer_workers: int
    trainer_gpus: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    transformer_impl: str = "auto"
    recompute: str = "none"
    micro_batch_size: int = 1
    max_tokens_per_microbatch: int | None = None
    prompt_tokens: int = ASSUMED_PROMPT_TOKENS
    max_response_len: int = 1024
    half_precision: bool = True        # model.dtype bf16 / fp16
    bucket_bytes: int = 256 * 1024 * 1024
    # megatron's fused SwiGLU; None = on GPU (rl_async/train/megatron_model.py, the same rule)
    activation_fusion: bool | None = None


def inputs(cfg: RunConfig) -> MemoryInputs:
    t, c = cfg.train, cfg.cluster
    return MemoryInputs(
        backend=t.backend, trainer_workers=c.trainer_workers, trainer_gpus=c.trainer_gpus,
        tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel,
        expert_parallel=t.expert_parallel, transformer_impl=t.transformer_impl,
        recompute=t.recompute,
        micro_batch_size=t.micro_batch_size, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        prompt_tokens=_prompt_tokens(cfg), max_response_len=_response_tokens(cfg),
        half_precision=cfg.model.dtype in ("bfloat16", "float16"),
        bucket_bytes=cfg.publication.bucket_bytes)


def architecture(cfg: RunConfig) -> tuple[dict | None, str]:
    """(the model's config fields, where they came from) or (None, why not)."""
    m = cfg.model
    if m.hf_config is not None:
        return m.hf_config, "model.hf_config"
    path = Path(m.path) / "config.json"
    if path.is_file():
        return json.loads(path.read_text()), f"{path}"
    if m.architecture is not None:
        return m.architecture, "model.architecture"
    return None, (f"{path} is not readable here and model.architecture is not set: no memory "
                  f"plan (set model.architecture to the checkpoint's config.json fields)")


@dataclass
class MemoryPlan:
    trainer_gb_per_gpu: float | None
    engine_gb_per_gpu: float | None
    gpu_memory_gb: float
    breakdown: dict[str, Any]

    def to_dict(self) -> dict:
        return {"trainer_gb_per_gpu": self.trainer_gb_per_gpu,
                "engine_gb_per_gpu": self.engine_gb_per_gpu,
                "gpu_memory_gb": self.gpu_memory_gb, "breakdown": self.breakdown}


def _prompt_tokens(cfg: RunConfig) -> int:
    if cfg.rollout.max_prompt_len is not None:
        return cfg.rollout.max_prompt_len
    if cfg.task.name == "successor":  # the built-in task: its digits and a separator
        return cfg.task.prompt_digits + 1
    return ASSUMED_PROMPT_TOKENS


def _response_tokens(cfg: RunConfig) -> int:
    """Tokens after the prompt in one sample: one turn, or a multi-turn environment's whole
    trajectory (every turn and the environment's tokens between them)."""
    budget = cfg.rollout.max_trajectory_tokens
    if cfg.task.name in ("env", "verifiers") and budget is not None:
        return max(cfg.rollout.max_response_len, budget - _prompt_tokens(cfg))
    return cfg.rollout.max_response_len


def _tokens_per_micro_batch(m: MemoryInputs) -> tuple[int, int]:
    """(tokens in the largest micro-batch, longest sequence)."""
    seq = m.prompt_tokens + m.max_response_len
    if m.max_tokens_per_microbatch is not None:  # one over-long sequence still makes one
        return max(m.max_tokens_per_microbatch, seq), seq
    return m.micro_batch_size * seq, seq


def trainer_memory(m: MemoryInputs, dims: Dims) -> dict[str, float | str]:
    """Bytes per trainer GPU, by part, for the run's backend and layout."""
    megatron = m.backend == "megatron"
    tp, pp, ep = ((m.tensor_parallel, m.pipeline_parallel, m.expert_parallel) if megatron
                  else (1, 1, 1))
    dp = max(1, m.trainer_workers // (tp * pp))
    layers = dims.layers // pp
    stage = layers / max(dims.layers, 1)               # the first stage's share of the layers
    experts = dims.expert_params * stage / tp          # its experts over TP ...
    shared = (dims.body_params * stage / tp - experts
              + dims.vocab * dims.hidden * (1 if pp > 1 or dims.tied else 2) / tp)
    stage_params = shared + experts / ep               # ... and over EP
    half = m.half_precision
    tokens, seq = _tokens_per_micro_batch(m)
    out: dict[str, float | str] = {"parameters": dims.params, "tokens_per_micro_batch": tokens}
    if megatron:
        impl = m.transformer_impl if m.transformer_impl != "auto" else (
            "transformer_engine" if m.trainer_gpus else "local")
        out["weights"] = stage_params * (2 if half else 4)
        out["gradients"] = stage_params * 4                       # grad_reduce_in_fp32
        # distributed optimizer: each weight's state sharded over the ranks holding a copy
        # of it (DP; an expert's over DP / EP, so EP leaves the expert state per GPU alone)
        out["optimizer"] = (shared + experts) * ((4 if half else 0) + 8) / dp
        elem = 2 if half else 4
        fused = (bool(m.trainer_gpus) if m.activation_fusion is None
                 else m.activation_fusion)
        mlp = swiglu_saved("megatron", fused)
        per_token = dims.activation_bytes_per_token(tp, elem, mlp)
        in_flight = pp  # 1F1B: the first stage holds up to PP micro-batches' activations
        if m.recompute == "full":
            per_token = dims.hidden * elem + per_token / max(layers, 1)  # inputs + one layer
        scores = 0.0
        one_layer_scores = dims.heads / tp * tokens * seq * (4 + elem) if impl == "local" else 0.0
        if m.recompute == "none":
            # megatron's unfused attention keeps the fp32 softmax and the probabilities:
            # (a / t) x tokens x longest sequence, in every layer
            scores = one_layer_scores
        out["activations"] = (per_token * tokens + scores) * layers * in_flight
        if m.recompute != "none":  # one layer's recomputed pieces exist during its backward
            out["recompute_transient"] = one_layer_scores + per_token * tokens
        out["attention"] = f"{impl}, recompute {m.recompute}"
        out["swiglu"] = f"{'fused' if fused else 'unfused'}, {mlp}f/t saved per token"
    else:  # torch: fp32 master weights, gradients, AdamW moments and DDP's gradient buckets
        out["weights"] = dims.params * 4
        out["gradients"] = dims.params * 4
        out["optimizer"] = dims.params * 8
        out["ddp_buckets"] = dims.params * 4 if m.trainer_workers > 1 else 0.0
        elem = 2 if m.trainer_gpus else 4                          # bf16 autocast on GPU
        per_token = dims.activation_bytes_per_token(1, elem, swiglu_saved("torch", False))
        out["activations"] = per_token * tokens * dims.layers
        # autocast keeps a bf16 copy of every weight it casts, for the backward
        out["autocast_weights"] = dims.params * 2 if m.trainer_gpus else 0.0
        out["attention"] = "sdpa (no s x s matrix kept on GPU)"
    out["logits"] = tokens * dims.vocab / tp * 4 + tokens * min(LOGITS_CHUNK, dims.vocab) * 12
    out["publication"] = float(m.bucket_bytes * PUBLICATION_DEVICE_BUCKETS)
    out["runtime"] = RUNTIME_GB * GiB if m.trainer_gpus else 0.0
    return {k: float(v) if isinstance(v, (int, float)) and k not in _COUNTS else v
            for k, v in out.items()}


def engine_memory(cfg: RunConfig, dims: Dims, plan: CapacityPlan) -> dict[str, float | str]:
    """GiB per engine GPU (SGLang): the static pool and what its KV cache holds."""
    tp = cfg.cluster.gpus_per_engine
    gpu = cfg.cluster.gpu_memory_gb * GiB
    pool = cfg.sglang.mem_fraction_static * gpu
    weights = dims.params * (2 if cfg.model.dtype in ("bfloat16", "float16") else 4) / tp
    kv_per_token = 2 * dims.layers * dims.kv_heads * dims.head_dim * 2 / tp
    seq = _prompt_tokens(cfg) + _response_tokens(cfg)
    return {"static_pool": pool, "weights": float(weights), "kv_cache": max(pool - weights, 0.0),
            "kv_tokens": int(max(pool - weights, 0.0) // kv_per_token),
            "kv_tokens_for_all_running": plan.max_running_requests * seq,
            "outside_pool": ENGINE_OUTSIDE_POOL_GB * GiB}


_COUNTS = ("parameters", "tokens_per_micro_batch", "kv_tokens", "kv_tokens_for_all_running")


def _bytes(parts: dict[str, Any]) -> float:
    return sum(v for k, v in parts.items() if isinstance(v, float) and k not in _COUNTS)


def _gib(parts: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v / GiB, 3) if isinstance(v, float) and k not in _COUNTS else v)
            for k, v in parts.items()}


def plan_memory(cfg: RunConfig, plan: CapacityPlan
                ) -> tuple[MemoryPlan | None, str, list[Warning_], list[str]]:
    """(plan or None, the architecture's source or why none, warnings, errors)."""
    arch, source = architecture(cfg)
    if arch is None:
        return None, source, [], []
    missing = [k for k in REQUIRED if k not in arch]
    if missing:
        return None, f"{source} lacks {missing}: no memory plan", [], []
    dims = Dims.from_config(arch)
    gpu = cfg.cluster.gpu_memory_gb
    warnings: list[Warning_] = []
    errors: list[str] = []
    trainer_gb = engine_gb = None
    breakdown: dict[str, Any] = {"source": source}
    if dims.moe is not None:
        from rl_async.plan.moe_checks import moe_facts  # it reads this module's inputs()
        breakdown["moe"] = moe_facts(cfg, dims, plan)
    if cfg.train.backend != "synthetic":
        parts = trainer_memory(inputs(cfg), dims)
        trainer_gb = round(_bytes(parts) / GiB, 2)
        breakdown["trainer"] = _gib(parts)
        if cfg.cluster.trainer_gpus:
            _check("TRAINER_MEMORY", "trainer", trainer_gb, gpu, parts, warnings, errors,
                   " or train.expert_parallel" if dims.moe else "")
    if cfg.engine.backend == "sglang" and cfg.cluster.inference_gpus:
        parts = engine_memory(cfg, dims, plan)
        engine_gb = round((parts["static_pool"] + parts["outside_pool"]) / GiB, 2)
        breakdown["engine"] = _gib(parts)
        _engine_checks(cfg, parts, engine_gb, gpu, warnings, errors)
    return MemoryPlan(trainer_gb, engine_gb, gpu, breakdown), source, warnings, errors


def _check(code: str, who: str, need: float, gpu: float, parts: dict, warnings: list,
           errors: list, also: str = "") -> None:
    from rl_async.plan.capacity import Warning_

    top = sorted(((v, k) for k, v in parts.items() if isinstance(v, float)
                  and k not in _COUNTS), reverse=True)[:3]
    biggest = ", ".join(f"{k} {v / GiB:.1f}" for v, k in top)
    msg = (f"the {who} needs ~{need:.1f} GiB per GPU of cluster.gpu_memory_gb = {gpu:g} "
           f"(largest: {biggest} GiB)")
    if need > gpu:
        errors.append(f"{msg}: it does not fit; lower train.max_tokens_per_microbatch or "
                      f"train.micro_batch_size, set train.recompute = 'selective', "
                      f"train.transformer_impl = 'transformer_engine', or raise "
                      f"train.tensor_parallel{also}")
    elif need > 0.9 * gpu:
        warnings.append(Warning_(code, f"{msg}: over 90% of the GPU, little room for "
                                       f"fragmentation"))


def _engine_checks(cfg: RunConfig, parts: dict, engine_gb: float, gpu: float,
                   warnings: list, errors: list) -> None:
    from rl_async.plan.capacity import Warning_

    if parts["weights"] >= parts["static_pool"]:
        errors.append(f"the engine's weights ({parts['weights'] / GiB:.1f} GiB per GPU) do not "
                      f"fit sglang.mem_fraction_static = {cfg.sglang.mem_fraction_static} of "
                      f"cluster.gpu_memory_gb = {gpu:g}: raise cluster.gpus_per_engine")
    elif engine_gb > gpu:
        errors.append(f"the engine needs ~{engine_gb:.1f} GiB per GPU of "
                      f"cluster.gpu_memory_gb = {gpu:g}: lower sglang.mem_fraction_static")
    elif parts["kv_tokens"] < parts["kv_tokens_for_all_running"]:
        warnings.append(Warning_("ENGINE_MEMORY", (
            f"the KV cache holds ~{parts['kv_tokens']:,} tokens per engine, fewer than "
            f"sglang.max_running_requests x (prompt + rollout.max_response_len) = "
            f"{parts['kv_tokens_for_all_running']:,}: long responses will queue or be "
            f"retracted; raise sglang.mem_fraction_static or cluster.gpus_per_engine")))
