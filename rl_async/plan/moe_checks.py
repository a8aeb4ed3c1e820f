"""What `validate` refuses and what `rl-async plan` shows for mixture-of-experts models.

Expert parallelism (`train.expert_parallel`) is megatron's expert_model_parallel_size: each
layer's experts are split over EP ranks that hold the same layers. With megatron's default
expert_tensor_parallel_size (= TP) the expert grid is TP x EP x (DP / EP) x PP, so EP must
divide the data-parallel size as well as the experts. The torch trainer is DDP only: every
rank holds every expert.

Routing replay (`train.routing_replay`, rl_async/plan/moe.py) stores every MoE layer's top-k
expert ids per token of a sample; the plan sizes that beside the memory per GPU.

The megatron backend converts HF weights for the families in `MEGATRON_MODEL_TYPES` only
(rl_async/train/megatron_convert.py SUPPORTED; a test keeps the two equal): validate says so
before a run starts rather than the trainer at its first rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rl_async.plan.memory import architecture, inputs
from rl_async.plan.moe import moe_dims

if TYPE_CHECKING:
    from rl_async.plan.capacity import CapacityPlan
    from rl_async.plan.config import RunConfig
    from rl_async.plan.memory import Dims

MiB = 1024 ** 2
MEGATRON_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def expert_layout_errors(cfg: RunConfig) -> list[str]:
    """train.expert_parallel against the backend and the trainer layout (no model needed)."""
    t, workers = cfg.train, cfg.cluster.trainer_workers
    ep = t.expert_parallel
    if ep == 1:
        return []
    if t.backend == "torch":
        return [f"train.expert_parallel = {ep} needs train.backend = 'megatron': the torch "
                f"trainer is DDP only (every rank holds every expert); set train.backend = "
                f"'megatron' or train.expert_parallel = 1"]
    model_parallel = t.tensor_parallel * t.pipeline_parallel
    if workers % model_parallel:  # trainer_layout_errors names that one
        return []
    dp = workers // model_parallel
    if dp % ep:
        return [f"train.expert_parallel = {ep} must divide the {dp} data-parallel trainer "
                f"ranks (cluster.trainer_workers = {workers} / (train.tensor_parallel x "
                f"train.pipeline_parallel = {model_parallel})): experts are split over ranks "
                f"that hold the same layers; use one of {_divisors(dp)}"]
    return []


def megatron_model_errors(cfg: RunConfig, config: dict[str, Any], source: str) -> list[str]:
    """What the megatron backend cannot build or replay for this model."""
    t = cfg.train
    if t.backend != "megatron":
        return []
    kind = config.get("model_type")
    if kind not in MEGATRON_MODEL_TYPES:
        return [f"train.backend = 'megatron' converts {', '.join(MEGATRON_MODEL_TYPES)} "
                f"models; the model ({source}) has model_type = {kind!r}: set train.backend = "
                f"'torch'"]
    errors = []
    dense_layers = config.get("mlp_only_layers") or []
    if kind == "qwen3_moe" and (int(config.get("decoder_sparse_step") or 1) != 1 or dense_layers):
        errors.append(f"train.backend = 'megatron' needs every layer of a qwen3_moe model to be "
                      f"MoE; the model ({source}) has decoder_sparse_step = "
                      f"{config.get('decoder_sparse_step')}, mlp_only_layers = {dense_layers}: "
                      f"set train.backend = 'torch'")
    if moe_dims(config) and t.tensor_parallel > 1:
        errors.append(f"train.tensor_parallel = {t.tensor_parallel} with an MoE model "
                      f"({source}): the megatron backend runs MoE models at TP 1 for now "
                      f"(megatron needs sequence parallelism there); split the experts with "
                      f"train.expert_parallel instead, or set train.tensor_parallel = 1")
    replay = t.routing_replay == "r3" or (t.routing_replay == "auto" and moe_dims(config))
    if replay and t.recompute == "full" and t.pipeline_parallel > 1:
        errors.append("train.recompute = 'full' with train.pipeline_parallel > 1 cannot replay "
                      "routing in the megatron backend (1F1B recomputes a router after later "
                      "micro-batches' forwards); set train.recompute = 'selective' or 'none', "
                      "or train.routing_replay = 'off'")
    return errors


def moe_errors(cfg: RunConfig) -> list[str]:
    """The layout rules above, and the model's experts against train.expert_parallel and
    train.routing_replay (where its architecture is readable: model.hf_config,
    model.path's config.json or model.architecture)."""
    errors = expert_layout_errors(cfg)
    config, source = architecture(cfg)
    if config is None:
        return errors
    errors += megatron_model_errors(cfg, config, source)
    t, moe = cfg.train, moe_dims(config)
    ep = t.expert_parallel
    if moe is None:
        if ep > 1:
            errors.append(f"train.expert_parallel = {ep} but the model ({source}) is dense (no "
                          f"experts to split); set train.expert_parallel = 1")
        if t.routing_replay == "r3":
            errors.append(f"train.routing_replay = 'r3' but the model ({source}) is dense: it "
                          f"has no routers to replay; set train.routing_replay = 'auto' or "
                          f"'off'")
    elif moe.experts % ep:
        errors.append(f"train.expert_parallel = {ep} does not divide the model's "
                      f"{moe.experts} experts ({source}); use a divisor of {moe.experts} "
                      f"({_divisors(moe.experts)})")
    return errors


def moe_facts(cfg: RunConfig, dims: Dims, plan: CapacityPlan) -> dict[str, Any]:
    """The plan's `moe` section: experts, parameters in all and per token, how the trainer
    splits the experts, and routing replay's storage (bytes per sample: every token of the
    prompt and the response carries moe_layers x top_k ids)."""
    m = dims.moe
    assert m is not None
    sizes = inputs(cfg)
    replay = cfg.train.routing_replay != "off"  # "auto" is on for an MoE model
    per_sample = (sizes.prompt_tokens + sizes.max_response_len) * m.replay_bytes_per_token()
    per_sample = per_sample if replay else 0
    return {
        "experts": m.experts, "top_k": m.top_k, "moe_layers": m.moe_layers,
        "expert_ffn": m.expert_ffn, "shared_expert_ffn": m.shared_ffn,
        "parameters_total": dims.params, "parameters_active": dims.active_params,
        "expert_parameters": dims.expert_params,
        "expert_parallel": cfg.train.expert_parallel,
        "routing_replay": "r3" if replay else "off",
        "replay_bytes_per_token": m.replay_bytes_per_token() if replay else 0,
        "replay_bytes_per_sample": per_sample,
        "replay_mib_per_collection": round(per_sample * plan.collection_samples / MiB, 1),
        "replay_mib_in_buffer": round(per_sample * plan.completed_buffer_samples / MiB, 1),
    }


def describe(facts: dict[str, Any]) -> str:
    """One line for `rl-async plan`'s table output."""
    f = facts
    line = (f"mixture of experts: {f['experts']} experts, top-{f['top_k']}, "
            f"{f['moe_layers']} MoE layers; {f['parameters_total'] / 1e9:.2f}B parameters, "
            f"{f['parameters_active'] / 1e9:.2f}B active per token "
            f"({f['expert_parameters'] / 1e9:.2f}B in experts); train.expert_parallel = "
            f"{f['expert_parallel']}; routing replay {f['routing_replay']}")
    if f["routing_replay"] != "off":
        line += (f": {f['replay_bytes_per_token']} B per token, "
                 f"{f['replay_bytes_per_sample'] / 1024:.0f} KiB per sample, "
                 f"{f['replay_mib_per_collection']:g} MiB per collection")
    return line
