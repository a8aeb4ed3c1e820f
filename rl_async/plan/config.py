"""Typed run-file config (SPEC §2): one pydantic model per section, unknown keys rejected.

Every section forbids unknown keys, so a typo fails with its full key path
(`async.max_weigth_staleness: unknown key`). Defaults live next to their owner. Values that
depend on the profile or on whether the file is *structured* are left as `None` here and
resolved once in `rl_async.plan.load` (the only place that knows where a value came from);
everything downstream reads the resolved `RunConfig` and the capacity plan.

Configs are plain pydantic models: picklable, so they travel to Ray actors as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, PositiveFloat, PositiveInt, PrivateAttr, model_validator

# The workload sections ([task], [reward], [eval], [filter], [judge]) live in config_workload.
from rl_async.algo.corrections import corrections_from
from rl_async.plan.config_base import Section
from rl_async.plan.config_workload import (EvalSection, FilterSection, JudgeSection,
                                           RewardSection, TaskSection)

PROFILES = ("local", "dev", "node", "three_node")


class RunSection(Section):
    profile: Literal["local", "dev", "node", "three_node"] = "local"
    name: str = "rl-async"
    seed: int = 0
    max_steps: PositiveInt = 20
    # Where checkpoints, the summary and W&B files go.
    output_dir: str = "runs"
    # Optimizer updates between checkpoints; 0 = only at the end (every run, and every
    # graceful stop, ends with one). Each holds the policy as a Hugging Face dir (`hf/`).
    checkpoint_every: int = Field(0, ge=0)
    # Complete checkpoints kept per run directory, newest first; 0 keeps all.
    keep_checkpoints: int = Field(3, ge=0)
    # Stop the run when nothing progresses (no group reaches the buffer, no optimizer step
    # finishes) for this long; the error carries what every stage holds.
    stall_timeout_s: PositiveFloat = 900.0
    # Failure budget: stop when more than this share of the most recent
    # failure_window_groups groups failed (a few always-failing prompts never stop a run).
    max_failed_group_fraction: float = Field(0.5, gt=0, le=1)
    failure_window_groups: PositiveInt = 100
    # Bit-reproducible runs where the hardware allows (docs/reproducibility.md): embedded
    # engines decode batch-invariantly (one forward per request, so a request's tokens and
    # log-probs never depend on what shares its step). Sampling seeds, canonical collection
    # order and lag-0 = sync hold without it.
    deterministic: bool = False
    # Write every trained collection (tokens, log-probs, versions, rewards) to
    # <run dir>/rollouts/ so `rl-async replay RUN_DIR` can re-train it; about
    # (prompt + response) x 3 numbers per sample per step, gzipped.
    record_rollouts: bool = False
    # The provenance audit (rl_async/train/audit.py): trainer rank 0 recomputes the
    # behaviour log-probs of this fraction of trained samples under the weights of the
    # version each token claims; 0 = off. It keeps that many recent published snapshots on
    # the host (max_weight_staleness + 2) and one more model copy.
    audit_fraction: float = Field(0.0, ge=0, le=1)
    # A recomputed log-prob further than this from the recorded one is a mismatch. None: 0
    # under run.deterministic on CPU engines (the replay is then bit-exact), else what
    # batching and kernels change by rounding (1e-3 for float32, 5e-2 for bf16/fp16).
    audit_tolerance: float | None = Field(None, ge=0)


class ClusterSection(Section):
    inference_gpus: int = Field(0, ge=0)
    gpus_per_engine: PositiveInt = 1
    cpu_engines: PositiveInt = 1
    trainer_gpus: int = Field(0, ge=0)
    trainer_workers: PositiveInt = 1
    # CPU cores reserved for each engine / trainer worker actor (Ray resources).
    engine_cpus: PositiveFloat = 1.0
    trainer_cpus: PositiveFloat = 1.0
    # torch threads on CPU: "auto" starts from the reservations above (engine.torch_threads
    # per engine) and, after a measured window, gives the side that bounds the loop the cores
    # the other leaves idle (rl_async/loop/threads.py); "fixed" keeps the start split.
    cpu_threads: Literal["auto", "fixed"] = "auto"
    # CPU engine and trainer processes keep freed tensor memory for reuse instead of handing
    # it back to the OS and page-faulting it in again (rl_async/base/allocator.py): "reuse",
    # or glibc's default ("system"; the process then returns memory it no longer uses).
    cpu_allocator: Literal["reuse", "system"] = "reuse"
    # Memory of one GPU, for the memory plan (`rl-async plan`): 80 (H100/A100), 141 (H200).
    gpu_memory_gb: PositiveFloat = 80.0


class ModelSection(Section):
    """The policy model. Exactly one of `hf_config` (a transformers config built with random
    weights from `init_seed`, for tests and the CPU demo) or `path` (a local checkpoint)."""

    hf_config: dict[str, Any] | None = None
    path: str | None = None
    # With `path`: the checkpoint's architecture (config.json's fields) for `rl-async plan`
    # on a machine that cannot read the checkpoint; checked against config.json where it can.
    architecture: dict[str, Any] | None = None
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path is not None and self.path.startswith("~"):
            self.path = str(Path(self.path).expanduser())
        if (self.hf_config is None) == (self.path is None):
            raise ValueError(
                "set exactly one of model.hf_config (random weights from a config) or "
                "model.path (a local Hugging Face checkpoint directory)"
            )
        if self.architecture is not None and self.path is None:
            raise ValueError("model.architecture describes model.path's checkpoint; with "
                             "model.hf_config the architecture is hf_config itself: remove it")
        return self


class EngineSection(Section):
    # "synthetic": a load generator with realistic latencies, no model (see [synthetic]).
    backend: Literal["embedded", "sglang", "synthetic"] | None = None  # profile default
    # Embedded engine: token budget over running requests (prompt + generated tokens).
    max_total_tokens: PositiveInt = 8192
    # Embedded engine: prompt KV kept for a group's samples admitted in later steps, in
    # tokens; omitted -> a quarter of max_total_tokens, 0 -> off.
    prefix_cache_tokens: int | None = Field(None, ge=0)
    # Embedded engine on CPU: linear layers through oneDNN on weights packed once. Omitted ->
    # where measured clearly faster at start (real models; not the tiny test ones).
    onednn_linear: bool | None = None
    torch_threads: PositiveInt = 1
    # Restart dead or unresponsive engines. Default: on, except with
    # refresh.mode = "mixed_policy" (a restarted engine cannot rebuild retracted prefixes).
    fault_tolerance: bool | None = None
    # Probe every engine this often; one that is dead, or does not answer (or makes no
    # decode progress with requests running) within the timeout, leaves routing at once.
    health_check_interval_s: PositiveFloat = 5.0
    health_check_timeout_s: PositiveFloat = 30.0
    # Engine restarts allowed per run; past them the run stops naming the engine and causes.
    max_restarts: int = Field(3, ge=0)


class SGLangSection(Section):
    max_running_requests: PositiveInt = 8
    # HTTP permits per engine; omitted -> 2 x max_running_requests in structured async files.
    server_concurrency: PositiveInt | None = None
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    # Engine i listens on port_base + i; 0 = an ephemeral port per engine.
    port_base: int = Field(30000, ge=0, le=65000)
    startup_timeout_s: PositiveFloat = 600.0
    request_timeout_s: PositiveFloat = 600.0
    speculative_algorithm: str | None = None
    disaggregation_mode: Literal["null", "prefill", "decode"] = "null"
    # true: responses never stop at EOS or stop ids (SGLang skips both): fixed-length
    # benchmarks only, never rollouts.
    ignore_eos: bool = False
    # The interpreter that runs the server (`<python> -m <launch_module>`): SGLang 0.5.23
    # pins torch 2.14.1 and transformers 5.19.0, so give it a virtual env of its own, e.g.
    # "/opt/sglang-venv/bin/python", on every engine node. "" = the run's own interpreter.
    python: str = ""
    # The module run as `python -m <launch_module>` (a site's wrapper around SGLang's).
    launch_module: str = "sglang.launch_server"
    # Passed through to `sglang.launch_server` as --key value.
    extra_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _port_base(self) -> SGLangSection:
        if 0 < self.port_base < 1024:
            raise ValueError(f"sglang.port_base = {self.port_base}: use 0 (ephemeral ports) "
                             f"or a port >= 1024")
        return self


class RolloutSection(Section):
    rollout_batch_size: PositiveInt = 4
    n_samples_per_prompt: PositiveInt = 4
    max_response_len: PositiveInt = 8
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    # Tokens that end a response. None: the built-in task's EOS, or the model's
    # eos_token_id (from model.path's config) for JSONL tasks.
    stop_token_ids: list[int] | None = None
    # Longest prompt in tokens: the embedded engine refuses longer ones, and the memory plan
    # sizes sequences as max_prompt_len + max_response_len (it assumes 512 when unset).
    max_prompt_len: PositiveInt | None = None
    # Multi-turn environments: tokens of a whole trajectory (prompt, every assistant and
    # environment turn); reaching it truncates the trajectory (counted). None: no budget
    # beyond max_turns x max_response_len per assistant turn.
    max_trajectory_tokens: PositiveInt | None = None

    @model_validator(mode="after")
    def _top_k(self) -> RolloutSection:
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k = {self.top_k}: use -1 (off) or an integer >= 1")
        return self


class TrainSection(Section):
    # "synthetic": spends [synthetic] train_seconds_per_sample per sample, no model.
    backend: Literal["torch", "megatron", "synthetic"] = "torch"
    # Samples per optimizer step; omitted -> one step per collection.
    global_batch_size: PositiveInt | None = None
    micro_batch_size: PositiveInt = 8
    lr: PositiveFloat = 1e-3
    # "cosine" decays lr to lr * min_lr_ratio over lr_schedule_steps updates.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # The schedule's horizon; None: run.max_steps. A resumed run keeps the horizon it started
    # with when run.max_steps changes (set this key to change it on purpose).
    lr_schedule_steps: PositiveInt | None = None
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: PositiveFloat = 1.0
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float = Field(0.2, gt=0)
    use_tis: bool = True
    tis_clip: PositiveFloat = 2.0
    tis_clip_low: float = Field(0.0, ge=0)
    # The objective and the behaviour-gap mask (rl_async/algo/corrections.py, which
    # validates them and holds each mask's default bounds).
    policy_loss: Literal["ppo_tis", "cispo", "gspo", "m2po", "decoupled_ppo"] = "ppo_tis"
    is_mask: Literal["none", "token_mis", "seq_mis", "icepop", "geo_rs"] = "none"
    is_mask_low: float | None = Field(None, ge=0)
    is_mask_high: float | None = Field(None, ge=0)
    gspo_eps_low: float = Field(3e-4, ge=0, lt=1)
    gspo_eps_high: float = Field(4e-4, ge=0)
    cispo_ratio_low: float = Field(0.0, ge=0)
    cispo_ratio_high: PositiveFloat = 4.0
    m2po_tau: PositiveFloat = 0.04
    use_rollout_logprobs: bool = False
    advantage: Literal["group_norm", "mean_only"] = "group_norm"
    tensor_parallel: PositiveInt = 1
    pipeline_parallel: PositiveInt = 1
    # Micro-batches by a padded-token budget (rows x longest sequence) instead of
    # micro_batch_size rows: long responses then never share a micro-batch with many others.
    max_tokens_per_microbatch: PositiveInt | None = None
    # torch backend: each distinct prompt of a micro-batch runs once and the group's samples
    # continue from its keys/values (rl_async/train/prefix.py): the same gradient, less compute.
    share_prompts: bool = True
    # Mixture-of-experts models: the trainer reuses the experts each engine chose ("r3",
    # docs/models.md); "auto" = r3 for MoE models, off for dense ones.
    routing_replay: Literal["auto", "r3", "off"] = "auto"
    # megatron, MoE models: ranks each layer's experts are split over (expert_model_parallel);
    # divides the experts and the data-parallel size (rl_async/plan/moe_checks.py).
    expert_parallel: PositiveInt = 1
    # megatron, MoE models: "none" adds no load-balancing loss (it is not the policy's
    # objective, and the torch trainer adds none); "aux_loss" adds megatron's with the
    # model's router_aux_loss_coef (rl_async/train/megatron_moe.py).
    moe_load_balancing: Literal["none", "aux_loss"] = "none"
    # megatron: "transformer_engine" (fused/flash attention, no s x s matrix; needs TE on a
    # GPU), "local" (megatron's unfused attention: builds the s x s scores in fp32), or
    # "auto" (TE when it is importable on a GPU, else local; the memory plan assumes TE on GPU).
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    # megatron activation recompute: "selective" recomputes core attention in the backward
    # (the s x s scores are never kept), "full" recomputes each layer from its input.
    recompute: Literal["none", "selective", "full"] = "none"
    # An update with a non-finite gradient norm is skipped; more than this many in a row
    # stop the run naming the step and the quantity (rl_async/train/guard.py).
    max_nonfinite_updates: int = Field(3, ge=0)

    @model_validator(mode="after")
    def _corrections(self) -> "TrainSection":
        corrections_from(self)  # the mask's bounds against its defaults; errors name the keys
        return self


class AsyncSection(Section):
    fully_async: bool | None = None  # profile default
    async_max_concurrent_samples: int | None = None
    async_data_buffer_capacity_factor: float = Field(1.0, ge=0)
    rollout_submission_granularity: Literal["group", "sample"] = "sample"
    max_weight_staleness: int | None = Field(None, ge=0)
    # Where the lag is enforced: "admission" opens no group that would be older than the
    # lag when the trainer reaches it (rl_async/loop/admission.py; the dequeue filter stays
    # as a fallback); "dequeue" discards and regenerates groups found too old.
    staleness_bound: Literal["admission", "dequeue"] = "dequeue"
    # Collections the trainer leaves in the buffer behind the one it takes: every group then
    # waits that many more collections (forced-lag experiments, benchmarks/offpolicy_lag.py).
    hold_back_collections: int = Field(0, ge=0)
    # Off-policy health to pacing (rl_async/loop/health.py): past a threshold publish sooner,
    # then lower the producer budget; loosen after health_patience healthy collections.
    health_control: bool = False
    health_kl_max: PositiveFloat = 0.05
    health_ln2_fraction_max: float = Field(0.05, gt=0, le=1)
    health_ess_min: float = Field(0.5, ge=0, le=1)
    health_patience: PositiveInt = 3
    buffer_order: Literal["fifo", "lifo"] = "fifo"
    buffer_overflow: Literal["block", "evict"] = "block"
    unused_samples_handler: Literal["retry", "drop"] = "retry"
    # Attempts per prompt before it is marked failed (retry handler).
    max_retries: int = Field(3, ge=0)


class CoreSection(Section):
    """Low-level native keys. Native defaults: synchronous, zero policy lag."""

    fully_async: bool = False
    max_policy_lag: int | None = Field(None, ge=0)
    async_max_concurrent_samples: int | None = None
    async_data_buffer_capacity_factor: float = Field(1.0, ge=0)
    rollout_submission_granularity: Literal["group", "sample"] = "group"


class MilesSection(Section):
    max_weight_staleness: int | None = Field(None, ge=0)


class RefreshSection(Section):
    mode: Literal["off", "mixed_policy"] = "off"


class PublicationSection(Section):
    # refresh.mode = off: how long in-flight requests may finish under old weights.
    drain_timeout_s: PositiveFloat = 30.0
    # Bigger buckets mean fewer round trips; the snapshot is the whole model either way.
    bucket_bytes: PositiveInt = 256 * 1024 * 1024
    # Compare engine weight checksums to the trainer's after each publication (slow).
    # How a publication reaches several staging (embedded) engines: "chain" (trainer rank 0
    # sends once, each engine forwards to the next while receiving: rl_async/engine/relay.py)
    # or "off" (rank 0 sends to every engine itself). SGLang engines are always sent to
    # directly. Where the engines share one machine's cores and nothing crosses a network,
    # "off" is faster (docs/benchmarks.md, publication at fleet size).
    relay: Literal["chain", "off"] = "chain"
    verify_checksum: bool = False
    # Deadline for one whole publication (snapshot to resume): a hung publication fails the
    # run with the stage and bucket named.
    timeout_s: PositiveFloat = 300.0
    # Each engine's channel: joining it, and each bucket on it, must finish within this;
    # past it that engine is lost (restarted) and the others' transfers go on.
    channel_timeout_s: PositiveFloat = 60.0
    # Trainer rank 0's sending bandwidth, for validate's deadline arithmetic only (rank 0
    # sends the model once per engine): 2 GB/s is TCP between nodes; InfiniBand gives 10+.
    # A past run's figure: publish/bytes x engines / publish/transfer_seconds.
    bytes_per_s: PositiveFloat = 2e9
    # Publish once the trainer is this many optimizer updates past the engines' version
    # (1: after every collection). Each publication drains the engines (refresh.mode = off),
    # so an async run whose lag leaves room may publish less often; evaluations and the end
    # of the run always publish first. validate bounds it by the lag.
    every_updates: PositiveInt = 1


class SyntheticSection(Section):
    """Synthetic engines and trainers: real load generators for dry runs and orchestration
    benchmarks. Defaults: a 7-8B bf16 model on H100/H200 with SGLang; sources and the models
    themselves in rl_async/engine/timing.py."""

    # Multiplies every simulated latency: 1 = real time, 0.1 = ten times faster, 0 = instant.
    time_scale: float = Field(1.0, ge=0)
    prefill_tokens_per_s: PositiveFloat = 20_000.0
    prefill_overhead_s: float = Field(0.005, ge=0)
    decode_step_base_s: float = Field(0.008, ge=0)
    decode_step_per_request_s: float = Field(0.00015, ge=0)
    decode_step_per_kv_token_s: float = Field(2e-8, ge=0)
    # Response lengths: lognormal(median, sigma), capped at rollout.max_response_len.
    response_len_median: PositiveFloat = 512.0
    response_len_sigma: float = Field(1.0, ge=0)
    vocab_size: PositiveInt = 32_000
    # Prompt tokens per request in `rl-async simulate` (prefill work); dry runs use the
    # task's own prompts. A calibration file's measured mean replaces it.
    prompt_tokens: PositiveInt = 256
    # Publication: the trainer "publishes" this many bytes in publication.bucket_bytes buckets
    # (default: Qwen2.5-7B in bf16), taking bytes / weight_sync_bytes_per_s per bucket.
    publish_bytes: int = Field(15_230_000_000, ge=0)
    weight_sync_bytes_per_s: PositiveFloat = 10e9
    bucket_latency_s: float = Field(0.005, ge=0)
    group_init_s: float = Field(1.0, ge=0)
    # Trainer-group compute per sample of a collection (all ranks together).
    train_seconds_per_sample: float = Field(0.05, ge=0)


class WandbSection(Section):
    mode: Literal["online", "offline", "disabled"] | None = None  # profile default
    project: str = "rl-async"
    entity: str | None = None


class RunConfig(Section):
    """The whole run file, after profile defaults and alias resolution (see config_load)."""

    run: RunSection = Field(default_factory=RunSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    sglang: SGLangSection = Field(default_factory=SGLangSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    train: TrainSection = Field(default_factory=TrainSection)
    async_: AsyncSection = Field(default_factory=AsyncSection, alias="async")
    core: CoreSection = Field(default_factory=CoreSection)
    miles: MilesSection = Field(default_factory=MilesSection)
    refresh: RefreshSection = Field(default_factory=RefreshSection)
    publication: PublicationSection = Field(default_factory=PublicationSection)
    task: TaskSection = Field(default_factory=TaskSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    filter: FilterSection = Field(default_factory=FilterSection)
    judge: JudgeSection = Field(default_factory=JudgeSection)
    wandb: WandbSection = Field(default_factory=WandbSection)
    synthetic: SyntheticSection = Field(default_factory=SyntheticSection)
    # True when the file has an [async] table (SPEC §2); set by the loader, not a user key.
    _structured: bool = PrivateAttr(True)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @property
    def structured(self) -> bool:
        return self._structured

    @property
    def fully_async(self) -> bool:
        return bool(self.async_.fully_async)

    @property
    def fault_tolerance(self) -> bool:
        """engine.fault_tolerance, resolved: on unless mixed-policy refresh is asked for."""
        ft = self.engine.fault_tolerance
        return self.refresh.mode != "mixed_policy" if ft is None else ft

    @property
    def max_weight_staleness(self) -> int:
        return int(self.async_.max_weight_staleness or 0)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (for W&B's run config and the summary)."""
        return self.model_dump(mode="json", by_alias=True)
