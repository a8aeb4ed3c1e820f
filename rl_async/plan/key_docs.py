"""One entry per run-file key: what it means, its unit and the plan rule it feeds.

The reference in docs/configuration.md is generated from these entries and the config
classes (type and default come from the classes): `rl-async config --reference --write
docs/configuration.md`. A key added to a config class without an entry here fails
tests/unit/test_docs_config_reference.py, naming the key and this file.

An entry is `"section.key": Doc(meaning, unit, rule)`: meaning is one line, unit is empty
for unitless keys, rule names the capacity plan field, validate check or warning the key
feeds ("" when it feeds none).
"""

from __future__ import annotations

from typing import NamedTuple


class Doc(NamedTuple):
    meaning: str
    unit: str = ""
    rule: str = ""


SECTIONS = {
    "run": "the run as a whole: name, length, where it writes, failure budget",
    "cluster": "what the run reserves: GPUs, CPU engines, trainer workers",
    "model": "the policy: a local checkpoint or a config with random weights",
    "engine": "the inference engines (embedded torch engine, SGLang, synthetic)",
    "sglang": "SGLang servers, and the slots every engine backend honours",
    "rollout": "sampling: collection size, response budget, sampling settings",
    "train": "the trainer: backend, optimizer, loss, parallelism, memory",
    "async": "asynchrony: producer budget, buffer, policy lag",
    "core": "low-level native aliases of [async] (files without an [async] table)",
    "miles": "low-level native alias of the policy lag",
    "refresh": "what happens to in-flight requests at a publication",
    "publication": "sending the trainer's weights to the engines",
    "task": "what is trained on: prompts, environments, generated datasets",
    "reward": "how a sample is scored",
    "eval": "held-out evaluation",
    "filter": "dynamic sampling",
    "judge": "a judge model served and autoscaled by Ray Serve",
    "wandb": "Weights & Biases logging",
    "synthetic": "timings of synthetic engines and trainers (dry runs, the simulator)",
}

_LAG = "the lag (policy versions) a group may reach before it is discarded"
_SGL = "UNUSED_KEY unless engine.backend = 'sglang'"

KEYS: dict[str, Doc] = {
    # [run]
    "run.profile": Doc("defaults for engine.backend, async.fully_async and wandb.mode "
                       "(see Profiles)", rule="profile defaults"),
    "run.name": Doc("names the run's actors (`<name>/producer`, ...) and its output folder"),
    "run.seed": Doc("seeds the prompt order and every sample's sampling seed",
                    rule="refused on resume if changed"),
    "run.max_steps": Doc("optimizer updates in the whole run (a resumed run continues the "
                         "count)", "updates", "a multiple of the updates per collection"),
    "run.output_dir": Doc("checkpoints, summary.json, trained.jsonl, W&B files go under "
                          "`<output_dir>/<name>/run-<time>/`", "path",
                          "OUTPUT_DIR_NOT_SHARED on multi-node runs"),
    "run.checkpoint_every": Doc("updates between checkpoints; 0 = only at the end and on a "
                                "graceful stop", "updates",
                                "a multiple of the updates per collection"),
    "run.keep_checkpoints": Doc("newest complete checkpoints kept per run directory; 0 keeps "
                                "all", "checkpoints"),
    "run.stall_timeout_s": Doc("stop the run when no group reaches the buffer and no update "
                               "finishes for this long", "s"),
    "run.max_failed_group_fraction": Doc("stop when more than this share of the last "
                                         "failure_window_groups groups failed", "fraction"),
    "run.failure_window_groups": Doc("groups the failure budget looks back over", "groups"),
    "run.deterministic": Doc("bit-reproducible where the hardware allows: batch-invariant "
                             "decoding, deterministic torch ops, fixed threads"),
    "run.record_rollouts": Doc("write every trained collection to `<run dir>/rollouts/` for "
                               "`rl-async replay`"),
    "run.audit_fraction": Doc("share of trained samples whose behaviour log-probs trainer rank "
                              "0 recomputes under the weights of the version each token "
                              "claims (summary `provenance`); 0 = off", "fraction",
                              "0 to 1; embedded engines"),
    "run.audit_tolerance": Doc("largest difference between a recomputed and a recorded "
                               "log-prob that is not a mismatch; unset: 0 with "
                               "run.deterministic on CPU engines, else 1e-3 (float32) or "
                               "5e-2 (bf16/fp16)", "nats", ">= 0"),
    # [cluster]
    "cluster.inference_gpus": Doc("GPUs for engines; 0 = engines on CPU", "GPUs",
                                  "engines = inference_gpus / gpus_per_engine; both sides on "
                                  "GPU or both on CPU"),
    "cluster.gpus_per_engine": Doc("GPUs per engine (SGLang tensor parallelism)", "GPUs",
                                   "must divide inference_gpus; 1 for the embedded engine"),
    "cluster.cpu_engines": Doc("engines when inference_gpus = 0", "engines",
                               "engines = cpu_engines on CPU"),
    "cluster.trainer_gpus": Doc("GPUs for trainer workers; 0 = train on CPU", "GPUs",
                                "must equal trainer_workers when > 0"),
    "cluster.trainer_workers": Doc("trainer processes (data x tensor x pipeline parallel)",
                                   "processes", "a multiple of tensor_parallel x "
                                   "pipeline_parallel; divides global_batch_size"),
    "cluster.engine_cpus": Doc("CPU cores Ray reserves per engine actor", "cores",
                               "the CPU thread split"),
    "cluster.trainer_cpus": Doc("CPU cores Ray reserves per trainer worker", "cores",
                                "the CPU thread split"),
    "cluster.cpu_threads": Doc("'auto' gives the side that bounds the loop the other's idle "
                               "cores once, after a measured window; 'fixed' keeps the split",
                               rule="UNUSED_KEY on GPU or SGLang"),
    "cluster.cpu_allocator": Doc("'reuse' keeps freed tensor memory in CPU engine and trainer "
                                 "processes; 'system' is glibc's default",
                                 rule="UNUSED_KEY when nothing runs on CPU"),
    "cluster.gpu_memory_gb": Doc("one GPU's memory: 80 (A100/H100), 141 (H200)", "GiB",
                                 "memory plan: TRAINER_MEMORY / ENGINE_MEMORY past 90%, "
                                 "error past 100%"),
    # [model]
    "model.hf_config": Doc("a transformers config built with random weights (tests, the CPU "
                           "demo); exactly one of hf_config or path", "table",
                           "memory plan architecture"),
    "model.path": Doc("a local Hugging Face checkpoint directory, on every node; no hub "
                      "downloads at run time", "path",
                      "needed by SGLang; refused on resume if changed"),
    "model.architecture": Doc("the checkpoint's config.json fields, for planning where "
                              "model.path is not mounted", "table",
                              "memory plan; checked against config.json when readable"),
    "model.init_seed": Doc("seed of hf_config's random weights and of the trainer's torch "
                           "generators"),
    "model.dtype": Doc("weights dtype of engines, publications and exports",
                       rule="memory plan (bytes per weight)"),
    # [engine]
    "engine.backend": Doc("'embedded' (torch, CPU or one GPU), 'sglang' (GPU servers) or "
                          "'synthetic' (no model)", rule="profile default; synthetic needs "
                          "train.backend = 'synthetic'"),
    "engine.max_total_tokens": Doc("embedded engine: token budget over running requests "
                                   "(prompt + max_new_tokens reserved each)", "tokens",
                                   "UNUSED_KEY unless embedded"),
    "engine.prefix_cache_tokens": Doc("embedded engine: prompt KV kept for a group's later "
                                      "samples; unset = a quarter of max_total_tokens, 0 = off",
                                      "tokens"),
    "engine.onednn_linear": Doc("embedded engine on CPU: linears through oneDNN on packed "
                                "weights; unset = where timed faster at start"),
    "engine.torch_threads": Doc("CPU threads of one embedded engine at start", "threads",
                                "UNUSED_KEY unless embedded on CPU"),
    "engine.fault_tolerance": Doc("restart dead or unresponsive engines; unset = on, except "
                                  "with refresh.mode = 'mixed_policy'",
                                  rule="must be off with mixed_policy"),
    "engine.health_check_interval_s": Doc("how often every engine is probed", "s"),
    "engine.health_check_timeout_s": Doc("an engine that does not answer (or make progress) "
                                         "within this leaves routing", "s"),
    "engine.max_restarts": Doc("engine restarts allowed per run; past them the run stops",
                               "restarts"),
    # [sglang]
    "sglang.max_running_requests": Doc("requests one engine runs at once (every backend "
                                       "honours it)", "requests",
                                       "engine_slots = engines x max_running_requests"),
    "sglang.server_concurrency": Doc("HTTP permits per engine; unset = 2 x "
                                     "max_running_requests (structured files)", "requests",
                                     "http_slots = server_concurrency x engines; "
                                     "HTTP_GATE_BELOW_ENGINE"),
    "sglang.mem_fraction_static": Doc("share of GPU memory for SGLang's weights and KV cache",
                                      "fraction", "memory plan (engine); " + _SGL),
    "sglang.port_base": Doc("engine i listens on port_base + i; 0 = an ephemeral port each",
                            "port", "0 or >= 1024; " + _SGL),
    "sglang.startup_timeout_s": Doc("deadline for a server to answer its health check", "s",
                                    _SGL),
    "sglang.request_timeout_s": Doc("deadline of one generate request (then aborted and "
                                    "regenerated)", "s"),
    "sglang.speculative_algorithm": Doc("SGLang's --speculative-algorithm; draft-model flags go "
                                        "in extra_args", rule="needs engine.backend = 'sglang'; "
                                        "refused with mixed_policy"),
    "sglang.disaggregation_mode": Doc("prefill/decode disaggregation; only 'null' runs",
                                      rule="anything but 'null' is an error"),
    "sglang.ignore_eos": Doc("responses never stop at EOS or stop ids: fixed-length "
                             "benchmarks only", rule="IGNORE_EOS"),
    "sglang.python": Doc("the interpreter that runs each server (SGLang's own virtual env: "
                         "it pins its own torch); unset = the run's", "path", _SGL),
    "sglang.launch_module": Doc("the module run as `python -m` for each server (a site's "
                                "wrapper)", rule=_SGL),
    "sglang.extra_args": Doc("passed to the server as --key value flags", "table", _SGL),
    # [rollout]
    "rollout.rollout_batch_size": Doc("groups (prompts) per collection", "groups",
                                      "collection_samples = rollout_batch_size x "
                                      "n_samples_per_prompt"),
    "rollout.n_samples_per_prompt": Doc("samples per prompt: the group size", "samples",
                                        "producer budget rounds to whole groups; refused on "
                                        "resume if changed"),
    "rollout.max_response_len": Doc("longest response, per assistant turn", "tokens",
                                    "memory plan sequence length"),
    "rollout.temperature": Doc("sampling temperature (also of the behaviour log-probs)",
                               rule="1 with mixed_policy"),
    "rollout.top_p": Doc("nucleus sampling", "fraction", "1 with mixed_policy"),
    "rollout.top_k": Doc("top-k sampling; -1 = off", "tokens", "-1 with mixed_policy"),
    "rollout.stop_token_ids": Doc("tokens that end a response; unset = the model's "
                                  "eos_token_id (the built-in task's EOS)", "token ids"),
    "rollout.max_prompt_len": Doc("longest prompt; the embedded engine refuses longer ones; "
                                  "unset = 512 in the memory plan", "tokens",
                                  "memory plan sequence length"),
    "rollout.max_trajectory_tokens": Doc("multi-turn: prompt + every turn of a trajectory; "
                                         "reaching it truncates", "tokens",
                                         "must exceed max_prompt_len; UNUSED_KEY without an "
                                         "environment"),
    # [train]
    "train.backend": Doc("'torch' (DDP), 'megatron' (megatron-core, GPU, TP/PP) or "
                         "'synthetic'", rule="megatron needs trainer_gpus > 0; refused on "
                         "resume if changed"),
    "train.global_batch_size": Doc("samples per optimizer update; unset = one update per "
                                   "collection", "samples",
                                   "must divide the collection; divisible by trainer_workers"),
    "train.micro_batch_size": Doc("rows per forward/backward", "samples",
                                  "memory plan tokens per micro-batch"),
    "train.lr": Doc("AdamW learning rate (the default suits the tiny demo only)"),
    "train.lr_schedule": Doc("'constant', or 'cosine' decay to lr x min_lr_ratio"),
    "train.lr_schedule_steps": Doc("the schedule's horizon; unset = run.max_steps (kept from "
                                   "the first run on resume)", "updates"),
    "train.min_lr_ratio": Doc("cosine floor as a share of lr", "fraction"),
    "train.weight_decay": Doc("AdamW weight decay"),
    "train.grad_clip": Doc("gradient norm clip", "norm"),
    "train.eps_clip": Doc("PPO clip below 1: ratio floor 1 - eps_clip"),
    "train.eps_clip_high": Doc("PPO clip above 1: ratio ceiling 1 + eps_clip_high"),
    "train.use_tis": Doc("truncated importance sampling against the engine's log-probs",
                         rule="must be on in async runs"),
    "train.tis_clip": Doc("TIS weight ceiling"),
    "train.tis_clip_low": Doc("TIS weight floor"),
    "train.policy_loss": Doc("the objective: 'ppo_tis' (PPO-clip x TIS), 'decoupled_ppo' "
                             "(untruncated weight), 'gspo' (sequence ratio), 'cispo' (clipped "
                             "weight as coefficient), 'm2po' (second-moment mask)"),
    "train.is_mask": Doc("behaviour-gap mask: 'none', 'token_mis', 'seq_mis', 'icepop', "
                         "'geo_rs' (docs/algorithm.md)"),
    "train.is_mask_low": Doc("the mask's lower bound on the ratio; unset = the mask's default",
                             "ratio", "<= is_mask_high"),
    "train.is_mask_high": Doc("the mask's upper bound on the ratio; unset = the mask's default",
                              "ratio"),
    "train.gspo_eps_low": Doc("GSPO sequence clip below 1", rule="< 1"),
    "train.gspo_eps_high": Doc("GSPO sequence clip above 1"),
    "train.cispo_ratio_low": Doc("CISPO weight floor", "ratio", "<= cispo_ratio_high"),
    "train.cispo_ratio_high": Doc("CISPO weight ceiling", "ratio"),
    "train.m2po_tau": Doc("M2PO: mean (log ratio)^2 the kept tokens may reach"),
    "train.use_rollout_logprobs": Doc("use the engine's log-probs as the PPO anchor instead of "
                                      "the trainer's", rule="refused with mixed_policy"),
    "train.advantage": Doc("'group_norm' ((r - mean) / std in the group) or 'mean_only' "
                           "(r - mean)"),
    "train.tensor_parallel": Doc("megatron tensor parallelism", "GPUs",
                                 "needs megatron; TP x PP divides trainer_workers"),
    "train.pipeline_parallel": Doc("megatron pipeline parallelism", "stages",
                                   "needs megatron; TP x PP divides trainer_workers"),
    "train.max_tokens_per_microbatch": Doc("micro-batches by a padded-token budget instead of "
                                           "micro_batch_size rows", "tokens",
                                           "memory plan tokens per micro-batch"),
    "train.share_prompts": Doc("torch: each distinct prompt of a micro-batch runs once, its "
                               "samples continue from its keys/values",
                               rule="UNUSED_KEY unless train.backend = 'torch'"),
    "train.routing_replay": Doc("MoE models: the trainer reuses the top-k experts the "
                                "engine chose for every token ('r3'); 'auto' = r3 for MoE "
                                "models, off for dense; docs/models.md",
                                rule="'r3' refused for a dense model; memory plan "
                                     "moe.replay_bytes_per_sample"),
    "train.expert_parallel": Doc("megatron, MoE models: GPUs each layer's experts are split "
                                 "over (expert_model_parallel); the memory plan shards the "
                                 "expert weights by it", "GPUs",
                                 "needs megatron and an MoE model; divides the experts and "
                                 "trainer_workers / (TP x PP)"),
    "train.moe_load_balancing": Doc("megatron, MoE models: 'none' (no auxiliary loss: not the "
                                    "policy objective; the torch trainer adds none) or "
                                    "'aux_loss' (megatron's, scaled by the model's "
                                    "router_aux_loss_coef)"),
    "train.transformer_impl": Doc("megatron attention: 'transformer_engine', 'local' "
                                  "(unfused, s x s scores) or 'auto'",
                                  rule="memory plan attention"),
    "train.recompute": Doc("megatron activation recompute: 'none', 'selective', 'full'",
                           rule="memory plan activations"),
    "train.max_nonfinite_updates": Doc("non-finite updates skipped in a row before the run "
                                       "stops", "updates"),
    # [async]
    "async.fully_async": Doc("generate ahead of training (true) or one collection per "
                             "version (false)", rule="profile default"),
    "async.async_max_concurrent_samples": Doc("producer budget: samples in flight or being "
                                              "scored; unset = derived", "samples",
                                              "producer_samples = max(collection, 2 x "
                                              "requested_slots), whole groups; "
                                              "PRODUCER_BELOW_FLEET, GROUP_ROUNDING"),
    "async.async_data_buffer_capacity_factor": Doc("completed buffer size in collections",
                                                   "collections", "completed_buffer_groups = "
                                                   "floor(factor x rollout_batch_size)"),
    "async.rollout_submission_granularity": Doc("'sample' frees a sample's permit when it "
                                                "finishes; 'group' when the whole group is "
                                                "buffered", rule="submission_granularity"),
    "async.max_weight_staleness": Doc(_LAG + "; unset = 6 (fully async) or 0",
                                      "versions", "max_weight_staleness; "
                                      "BUFFER_EXCEEDS_AGE_BUDGET, RETAINED_EXCEEDS_LAG"),
    "async.staleness_bound": Doc("'admission' opens no group that would exceed the lag when "
                                 "trained (the dequeue filter stays as a fallback); "
                                 "'dequeue' discards and regenerates old groups",
                                 rule="admission_horizon_groups; async runs with a lag >= 1"),
    "async.hold_back_collections": Doc("collections kept buffered behind the one training "
                                       "takes, so data is that many collections older "
                                       "(forced-lag experiments; 0 in normal runs)",
                                       "collections", "buffer >= (hold + 1) collections; "
                                       "lag > hold x updates per collection"),
    "async.health_control": Doc("watch the trainer's off-policy diagnostics: past a threshold "
                                "publish sooner, then lower the producer budget; loosen when "
                                "healthy (every decision a health/* event)"),
    "async.health_kl_max": Doc("unhealthy above this k3 KL(trainer || rollout) per token"),
    "async.health_ln2_fraction_max": Doc("unhealthy above this share of tokens with |log "
                                         "ratio| > ln 2", "fraction"),
    "async.health_ess_min": Doc("unhealthy below this effective sample size of the weights",
                                "fraction"),
    "async.health_patience": Doc("healthy collections in a row before loosening one step",
                                 "collections"),
    "async.buffer_order": Doc("'fifo' trains the oldest completed group first, 'lifo' the "
                              "newest"),
    "async.buffer_overflow": Doc("full buffer: 'block' new submissions, or 'evict' the "
                                 "stalest group (regenerated)"),
    "async.unused_samples_handler": Doc("a group too old at dequeue: 'retry' (regenerate from "
                                        "its prompt) or 'drop'"),
    "async.max_retries": Doc("attempts per prompt before it is marked failed", "attempts"),
    # [core], [miles]: low-level aliases
    "core.fully_async": Doc("low-level alias of async.fully_async (default false)",
                            rule="an error in a file with an [async] table"),
    "core.max_policy_lag": Doc("low-level alias of async.max_weight_staleness", "versions",
                               "must agree with the other lag aliases"),
    "core.async_max_concurrent_samples": Doc("low-level alias of "
                                             "async.async_max_concurrent_samples (default: one "
                                             "collection)", "samples",
                                             "an error in a file with an [async] table"),
    "core.async_data_buffer_capacity_factor": Doc("low-level alias of "
                                                  "async.async_data_buffer_capacity_factor",
                                                  "collections",
                                                  "an error in a file with an [async] table"),
    "core.rollout_submission_granularity": Doc("low-level alias of "
                                               "async.rollout_submission_granularity (default "
                                               "'group')",
                                               rule="an error in a file with an [async] table"),
    "miles.max_weight_staleness": Doc("low-level alias of async.max_weight_staleness",
                                      "versions", "must agree with the other lag aliases"),
    # [refresh]
    "refresh.mode": Doc("'off' drains in-flight requests at a publication; 'mixed_policy' "
                        "retracts them and rebuilds their prefix under the new weights",
                        rule="mixed_policy: TP1, one update per collection, TIS, sampling at "
                        "1, no fault tolerance"),
    # [publication]
    "publication.drain_timeout_s": Doc("how long in-flight requests may finish under the old "
                                       "weights before they are aborted", "s",
                                       "timeout_s > 2 x drain + 2 x channel"),
    "publication.bucket_bytes": Doc("bytes per transfer bucket", "bytes",
                                    "memory plan: two buckets on trainer rank 0"),
    "publication.relay": Doc("`chain`: trainer rank 0 sends each publication once and every "
                             "embedded engine forwards it to the next while receiving (a "
                             "failed engine's followers get a direct send); `off`: rank 0 "
                             "sends to every engine (faster where the engines share one "
                             "machine's cores)", rule="SGLang engines: always direct"),
    "publication.verify_checksum": Doc("check every engine holds exactly the sent weights "
                                       "(slow)", rule="embedded engines only"),
    "publication.timeout_s": Doc("deadline of one whole publication (snapshot to resume)",
                                 "s", "> 2 x drain_timeout_s + 2 x channel_timeout_s + the "
                                 "transfer estimate"),
    "publication.channel_timeout_s": Doc("deadline of one engine channel's join and of each "
                                         "bucket; past it that engine is lost", "s",
                                         "timeout_s > 2 x drain + 2 x channel"),
    "publication.bytes_per_s": Doc("trainer rank 0's sending bandwidth, for validate's "
                                   "deadline arithmetic only", "bytes/s",
                                   "timeout_s > 2 x drain + 2 x channel + engines x model "
                                   "bytes / bytes_per_s"),
    "publication.every_updates": Doc("publish once the trainer is this many updates past the "
                                     "engines", "updates", "the engines' trail within "
                                     "max_weight_staleness; 1 in sync and lag-0 runs"),
    # [task]
    "task.name": Doc("'successor' (built-in), 'jsonl', 'math', 'env', 'reasoning_gym' or "
                     "'verifiers'", rule="math needs the math extra; refused on resume if "
                     "changed"),
    "task.path": Doc("JSONL prompts or environment rows, on every node", "path",
                     "needed by jsonl, math, env"),
    "task.eval_path": Doc("held-out JSONL; unset = num_eval_prompts rows of path held out",
                          "path", "EVAL_SPLIT_FROM_TRAIN when unset"),
    "task.num_eval_prompts": Doc("held-out prompts per evaluation", "prompts"),
    "task.env": Doc("'package.module:factory' or 'path/file.py:factory' (env); a module "
                    "(verifiers)", rule="imported by validate"),
    "task.env_args": Doc("keyword arguments of the environment factory", "table",
                         "UNUSED_KEY without an environment"),
    "task.env_timeout_s": Doc("deadline of each environment call (reset, step, score; an "
                              "agent's time between its model calls); past it the call is "
                              "cancelled and the group fails", "s",
                              "UNUSED_KEY without an environment"),
    "task.trajectory_timeout_s": Doc("wall-clock budget of a whole trajectory; once spent no "
                                     "turn starts and it ends truncated; unset = none", "s",
                                     "UNUSED_KEY without an environment"),
    "task.gateway_max_body_mb": Doc("largest request body the agent gateway accepts", "MiB",
                                    "UNUSED_KEY without an environment"),
    "task.chat_template": Doc("a Jinja chat template file replacing the model's", "path",
                              "validate probes it for stable multi-turn deltas"),
    "task.chat_template_kwargs": Doc("keyword arguments of every chat rendering, e.g. "
                                     "{ enable_thinking = false }", "table",
                                     "validate probes it for stable multi-turn deltas"),
    "task.dataset": Doc("reasoning-gym dataset name", rule="checked against the library"),
    "task.dataset_config": Doc("reasoning-gym dataset config (size: entries generated)",
                               "table", "size must exceed num_eval_prompts"),
    "task.modulus": Doc("built-in task: digits 0..modulus-1"),
    "task.prompt_digits": Doc("built-in task: digits per prompt", "digits"),
    "task.count_tokens": Doc("built-in task: responses count on for 2..count_tokens tokens; "
                             "0 = off", "tokens", "0 or >= 2; max_response_len >= it"),
    # [reward]
    "reward.function": Doc("'module:function', sync or async (sample) -> float; unset = the "
                           "task's verifier", rule="not with an environment task"),
    "reward.timeout_s": Doc("deadline of one reward call", "s"),
    "reward.max_retries": Doc("retries of a failing reward call before its group fails",
                              "retries"),
    "reward.concurrency": Doc("reward calls in flight at once", "calls"),
    "reward.placement": Doc("'auto', 'actor' (the reward actor) or 'producer' (no round "
                            "trip)", rule="producer refused with a judge"),
    "reward.isolation": Doc("where a sync reward function runs: 'process' (a worker process "
                            "that reward.timeout_s kills) or 'thread' (shares the process; a "
                            "timeout abandons the call)"),
    # [eval]
    "eval.every_steps": Doc("updates between evaluations; 0 = at start and end only",
                            "updates", "a multiple of the updates per collection"),
    "eval.greedy": Doc("eval/reward from one greedy response per prompt (false: sampled)"),
    "eval.n_samples": Doc("k > 0 adds eval/pass@k and eval/mean@k", "samples"),
    "eval.drain": Doc("drain the pipeline before an async evaluation (false: evaluate beside "
                      "generation)"),
    # [filter]
    "filter.zero_variance": Doc("drop groups whose rewards are all equal and open new "
                                "prompts instead"),
    # [judge]
    "judge.enabled": Doc("grade with a Ray Serve judge instead of reward.function",
                         rule="not with an environment task"),
    "judge.judge_class": Doc("'module:Class' with grade(sample) -> float"),
    "judge.min_replicas": Doc("fewest judge replicas", "replicas", "<= max_replicas"),
    "judge.max_replicas": Doc("most judge replicas", "replicas"),
    "judge.target_ongoing_requests": Doc("Serve's autoscaling target per replica", "requests"),
    "judge.max_ongoing_requests": Doc("requests one replica takes at once", "requests"),
    "judge.timeout_s": Doc("deadline of one judge call", "s"),
    "judge.max_retries": Doc("retries of a failing judge call before its group fails",
                             "retries"),
    "judge.upscale_delay_s": Doc("load that long before Serve adds a replica", "s"),
    "judge.downscale_delay_s": Doc("idle that long before Serve removes one", "s"),
    "judge.look_back_period_s": Doc("window of Serve's ongoing-request average", "s"),
    "judge.num_cpus": Doc("CPU cores per replica", "cores"),
    "judge.num_gpus": Doc("GPUs per replica", "GPUs"),
    "judge.kwargs": Doc("judge constructor arguments", "table"),
    # [wandb]
    "wandb.mode": Doc("'online', 'offline' (files under the output dir) or 'disabled'",
                      rule="profile default"),
    "wandb.project": Doc("W&B project"),
    "wandb.entity": Doc("W&B entity (team); unset = your default"),
    # [synthetic]
    "synthetic.time_scale": Doc("multiplies every simulated latency (0 = instant)",
                                "factor"),
    "synthetic.prefill_tokens_per_s": Doc("prefill speed", "tokens/s"),
    "synthetic.prefill_overhead_s": Doc("fixed cost of a prefill batch", "s"),
    "synthetic.decode_step_base_s": Doc("decode step time at no load", "s"),
    "synthetic.decode_step_per_request_s": Doc("added per running request", "s"),
    "synthetic.decode_step_per_kv_token_s": Doc("added per KV token in use", "s"),
    "synthetic.response_len_median": Doc("lognormal response lengths: median", "tokens"),
    "synthetic.response_len_sigma": Doc("lognormal response lengths: sigma of the log"),
    "synthetic.vocab_size": Doc("range of random token ids", "tokens"),
    "synthetic.prompt_tokens": Doc("prompt length in `rl-async simulate`", "tokens"),
    "synthetic.publish_bytes": Doc("bytes a synthetic publication moves (Qwen2.5-7B bf16)",
                                   "bytes"),
    "synthetic.weight_sync_bytes_per_s": Doc("transfer speed of a synthetic publication",
                                             "bytes/s"),
    "synthetic.bucket_latency_s": Doc("fixed cost per bucket", "s"),
    "synthetic.group_init_s": Doc("joining a publication channel", "s"),
    "synthetic.train_seconds_per_sample": Doc("trainer-group compute per sample", "s"),
}
