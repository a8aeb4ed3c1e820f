"""`rl-async run FILE --dry-run`: the run file's whole actor system on CPUs, with synthetic
engines and trainers (rl_async.engine.synthetic, rl_async.train.synthetic) and no GPUs.

What is kept: every count and limit of the capacity plan (engines, trainer ranks and their
data-parallel layout, producer budget, HTTP gate, engine slots, buffer, staleness, optimizer
steps per collection), drains, evaluation cadence, judges, publication (bucket count and
simulated transfer time). `dry_run_config` checks that the plan is unchanged.

What changes, and why:
- engines and trainers become synthetic, with `cluster.*_gpus = 0`, `cluster.cpu_engines` =
  the plan's engine count and a token CPU reservation per actor (0.01), so 8 engines and 8
  trainer ranks fit on a laptop;
- the model and task become the built-in `successor` task over a config-only model of
  `synthetic.vocab_size` tokens: no checkpoint, tokenizer or prompt file has to exist (the
  reward then scores random tokens: what matters here is timing, not learning);
- judges keep their autoscaling settings but reserve no CPUs or GPUs;
- W&B is disabled, the run name gets a `-dry-run` suffix, checkpoints (no weights, just the
  ledger and counters) go to `runs/dry-run` unless `run.output_dir` is set with `--set`;
- bounded by default: `run.max_steps` is capped at DRY_RUN_MAX_STEPS unless `--set
  run.max_steps=N` is given, and simulated time runs DRY_RUN_TIME_SCALE times real time
  unless `synthetic.time_scale` is set in the file or with `--set` (ratios of generation,
  training and publication times, hence staleness and trainer wait, do not depend on it).
"""

from __future__ import annotations

from rl_async.plan.config import RunConfig

DRY_RUN_MAX_STEPS = 10
DRY_RUN_TIME_SCALE = 0.1
DRY_RUN_OUTPUT_DIR = "runs/dry-run"
TOKEN_CPUS = 0.01
PLAN_KEYS = ("engines", "max_running_requests", "server_concurrency", "http_slots",
             "engine_slots", "producer_samples", "completed_buffer_groups",
             "max_weight_staleness", "global_batch_size", "optimizer_steps_per_collection",
             "submission_granularity")


def dry_run_config(cfg: RunConfig, overrides: tuple[str, ...] | list[str] = ()
                   ) -> tuple[RunConfig, list[str]]:
    """The dry-run version of `cfg` and one note per change a user should know about."""
    from rl_async.plan.capacity import plan_capacity

    plan = plan_capacity(cfg)[0]
    data = cfg.to_dict()
    notes: list[str] = []
    set_keys = {o.split("=", 1)[0].strip() for o in overrides}
    c = data["cluster"]
    c.update(inference_gpus=0, trainer_gpus=0, cpu_engines=plan.engines,
             engine_cpus=TOKEN_CPUS, trainer_cpus=TOKEN_CPUS)
    data["engine"]["backend"] = "synthetic"
    data["train"]["backend"] = "synthetic"
    vocab = cfg.synthetic.vocab_size
    data["model"] = {"hf_config": {"model_type": "llama", "vocab_size": vocab, "hidden_size": 8,
                                   "intermediate_size": 16, "num_hidden_layers": 1,
                                   "num_attention_heads": 1, "num_key_value_heads": 1},
                     "path": None, "init_seed": cfg.model.init_seed, "dtype": "float32"}
    if cfg.task.name != "successor":
        notes.append(f"task {cfg.task.name!r} -> the built-in successor task (no prompt files "
                     f"or tokenizer needed; rewards score random tokens)")
    data["task"].update(name="successor", path=None, eval_path=None, env=None, dataset=None)
    data["reward"]["function"] = None
    data["rollout"]["stop_token_ids"] = None
    if cfg.judge.enabled:
        data["judge"].update(num_cpus=0.0, num_gpus=0.0, judge_class="actors.judges:RuleJudge")
        notes.append("judges: the built-in RuleJudge with no CPU/GPU reservation")
    data["wandb"]["mode"] = "disabled"
    if cfg.run.audit_fraction > 0:  # the audit recomputes log-probs: synthetic has no model
        data["run"]["audit_fraction"] = 0.0
        notes.append(f"run.audit_fraction {cfg.run.audit_fraction:g} -> 0 (the provenance "
                     f"audit needs a real model)")
    # the config-only model is dense: no experts to split or routes to replay (expert
    # parallelism never changes the data-parallel ranks, so the plan keeps its counts)
    if cfg.train.expert_parallel > 1 or cfg.train.routing_replay == "r3":
        data["train"].update(expert_parallel=1, routing_replay="auto")
        notes.append(f"train.expert_parallel {cfg.train.expert_parallel} -> 1, "
                     f"train.routing_replay -> 'auto' (the dry run's model is dense)")
    data["run"]["name"] = f"{cfg.run.name}-dry-run"
    if "run.output_dir" not in set_keys:  # the file's shared storage may not exist here
        data["run"]["output_dir"] = DRY_RUN_OUTPUT_DIR
        notes.append(f"run.output_dir -> {DRY_RUN_OUTPUT_DIR!r} (checkpoints hold no weights "
                     f"in a dry run; pass --set run.output_dir=DIR to change)")
    if "run.max_steps" not in set_keys and cfg.run.max_steps > DRY_RUN_MAX_STEPS:
        notes.append(f"run.max_steps {cfg.run.max_steps} -> {DRY_RUN_MAX_STEPS} (pass --set "
                     f"run.max_steps=N to change)")
        data["run"]["max_steps"] = DRY_RUN_MAX_STEPS
    if "time_scale" not in cfg.synthetic.model_fields_set:
        data["synthetic"]["time_scale"] = DRY_RUN_TIME_SCALE
        notes.append(f"synthetic.time_scale = {DRY_RUN_TIME_SCALE}: simulated latencies run "
                     f"{1 / DRY_RUN_TIME_SCALE:g}x faster than real time (set it to 1 for "
                     f"wall-clock figures)")
    out = RunConfig.model_validate(data)
    out._structured = cfg.structured
    new_plan = plan_capacity(out)[0]
    changed = [k for k in PLAN_KEYS if getattr(plan, k) != getattr(new_plan, k)]
    if changed:  # a bug here, not a user error: the dry run must exercise the same limits
        raise AssertionError(f"dry run changed the capacity plan: {changed}")
    return out, notes
