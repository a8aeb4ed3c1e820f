"""Cross-section rules that a single section cannot check, and the one `validate` entry point.

`validate(cfg)` is what `rl-async plan|validate|run` and the running controller call: it
returns the capacity plan, its warnings and every error, each naming key paths and values.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rl_async.algo import math_reward
from rl_async.base.allocator import applies_to
from rl_async.algo.tasks import ENV_TASKS
from rl_async.plan.capacity import CapacityPlan, Warning_, plan_capacity
from rl_async.plan.config import RunConfig
from rl_async.plan.environment_checks import template_report, trajectory_errors
from rl_async.plan.memory import MemoryPlan, plan_memory
from rl_async.plan.moe_checks import moe_errors
from rl_async.plan.publication_budget import publication_errors
from rl_async.plan.schedule import publication_lag_errors


@dataclass
class Report:
    plan: CapacityPlan
    warnings: list[Warning_] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    memory: MemoryPlan | None = None
    memory_note: str = ""  # where the model's architecture came from, or why no plan

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        memory = (self.memory.to_dict() if self.memory is not None
                  else {"unavailable": self.memory_note})
        return {"runtime": {"async_capacity": self.plan.to_dict(), "memory": memory},
                "warnings": [w.to_dict() for w in self.warnings],
                "errors": list(self.errors)}


def refresh_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    """SPEC §9: mixed-policy refresh is only sound under these conditions."""
    if cfg.refresh.mode != "mixed_policy":
        return []
    pre = "refresh.mode = 'mixed_policy' requires "
    rules = [
        (cfg.cluster.gpus_per_engine == 1,
         f"TP1 engines: cluster.gpus_per_engine = {cfg.cluster.gpus_per_engine}"),
        (plan.optimizer_steps_per_collection == 1,
         f"one optimizer update per collection: train.global_batch_size = {plan.global_batch_size}"
         f" gives {plan.optimizer_steps_per_collection} updates per collection of "
         f"{plan.collection_samples} samples"),
        (cfg.train.use_tis, "TIS: train.use_tis = false"),
        (not cfg.train.use_rollout_logprobs, "train.use_rollout_logprobs = false (it is true)"),
        (cfg.rollout.temperature == 1.0, f"rollout.temperature = 1 (it is {cfg.rollout.temperature})"),
        (cfg.rollout.top_p == 1.0, f"rollout.top_p = 1 (it is {cfg.rollout.top_p})"),
        (cfg.rollout.top_k == -1, f"rollout.top_k = -1 (it is {cfg.rollout.top_k})"),
        (cfg.sglang.speculative_algorithm is None,
         f"no speculative decoding: sglang.speculative_algorithm = {cfg.sglang.speculative_algorithm!r}"),
        (cfg.sglang.disaggregation_mode == "null",
         f"no prefill/decode disaggregation: sglang.disaggregation_mode = "
         f"{cfg.sglang.disaggregation_mode!r}"),
        (not cfg.fault_tolerance,
         "no automatic engine fault tolerance (a restarted engine cannot rebuild retracted "
         "prefixes): engine.fault_tolerance = true"),
    ]
    return [pre + msg for ok, msg in rules if not ok]


def placement_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    errors: list[str] = []
    c = cfg.cluster
    if cfg.engine.backend == "sglang":
        if cfg.model.path is None:
            errors.append("engine.backend = 'sglang' needs model.path (a checkpoint directory "
                          "the SGLang server loads); model.hf_config is for the embedded engine")
    s = cfg.sglang
    if cfg.engine.backend != "sglang" and s.speculative_algorithm is not None:
        errors.append(f"sglang.speculative_algorithm = {s.speculative_algorithm!r} needs "
                      f"engine.backend = 'sglang' (the embedded engine has no speculative "
                      f"decoding); remove it")
    if s.disaggregation_mode != "null":
        errors.append(f"sglang.disaggregation_mode = {s.disaggregation_mode!r}: prefill/decode "
                      f"disaggregation needs prefill and decode servers paired through a PD "
                      f"router, which rl-async does not launch; use 'null'")
    if cfg.engine.backend == "embedded" and c.inference_gpus and c.gpus_per_engine != 1:
        errors.append(f"cluster.gpus_per_engine = {c.gpus_per_engine}: the embedded engine runs "
                      f"on one GPU (no tensor parallelism); use engine.backend = 'sglang'")
    if bool(c.trainer_gpus) != bool(c.inference_gpus):
        errors.append(f"cluster.trainer_gpus = {c.trainer_gpus} and cluster.inference_gpus = "
                      f"{c.inference_gpus}: weights are published over NCCL (both on GPU) or gloo "
                      f"(both on CPU); put trainers and engines on the same kind of device")
    if (cfg.engine.backend == "synthetic") != (cfg.train.backend == "synthetic"):
        errors.append(f"engine.backend = {cfg.engine.backend!r} and train.backend = "
                      f"{cfg.train.backend!r}: synthetic engines only receive a synthetic "
                      f"trainer's publication; set both to 'synthetic' (or use --dry-run)")
    if cfg.train.backend == "megatron" and c.trainer_gpus == 0:
        errors.append("train.backend = 'megatron' needs cluster.trainer_gpus > 0")
    if c.trainer_gpus and c.trainer_gpus != c.trainer_workers:
        errors.append(f"cluster.trainer_gpus = {c.trainer_gpus} must equal cluster.trainer_workers "
                      f"= {c.trainer_workers} (one trainer process per GPU)")
    if cfg.train.backend == "torch" and plan.global_batch_size % c.trainer_workers:
        errors.append(f"train.global_batch_size = {plan.global_batch_size} must be divisible by "
                      f"cluster.trainer_workers = {c.trainer_workers}")
    if cfg.fully_async and not cfg.train.use_tis:
        errors.append("train.use_tis = false: TIS is always on in async runs (async.fully_async = "
                      "true); it corrects policy lag and engine/trainer mismatch")
    if cfg.task.name in ("jsonl", "math", "env") and not cfg.task.path:
        errors.append(f"task.name = {cfg.task.name!r} needs task.path (a JSONL file of "
                      f"{'rows for the environment' if cfg.task.name == 'env' else 'prompts'})")
    count = cfg.task.count_tokens if cfg.task.name == "successor" else 0
    if count == 1:
        errors.append("task.count_tokens = 1: 0 (the plain one-token answer) or >= 2 (lengths "
                      "2..count_tokens by prompt)")
    if count > cfg.rollout.max_response_len:
        errors.append(f"task.count_tokens = {count} needs rollout.max_response_len >= {count} "
                      f"(the longest count); it is {cfg.rollout.max_response_len}")
    errors += environment_errors(cfg)
    errors += reasoning_gym_errors(cfg)
    if cfg.task.name == "math" and (cfg.reward.function is None or "math_reward" in
                                    cfg.reward.function) and not math_reward.available():
        errors.append(f"task.name = 'math' grades answers with {math_reward.EXTRA}, which "
                      f"is not installed")
    if cfg.publication.verify_checksum and cfg.engine.backend == "sglang":
        errors.append("publication.verify_checksum = true needs engine.backend = 'embedded': "
                      "SGLang 0.5.23's HTTP API returns no checksum of the served weights; "
                      "set publication.verify_checksum = false")
    if cfg.run.audit_fraction and (cfg.engine.backend == "synthetic"
                                   or cfg.train.backend == "synthetic"):
        errors.append(f"run.audit_fraction = {cfg.run.audit_fraction}: the provenance audit "
                      f"recomputes log-probs with a real model, and engine.backend = "
                      f"{cfg.engine.backend!r} / train.backend = {cfg.train.backend!r} has "
                      f"none; set run.audit_fraction = 0")
    if cfg.judge.enabled and cfg.reward.placement == "producer":
        errors.append("reward.placement = 'producer' with judge.enabled: the reward actor calls "
                      "the judge deployment; set reward.placement = 'auto' or 'actor'")
    if cfg.judge.enabled and cfg.judge.min_replicas > cfg.judge.max_replicas:
        errors.append(f"judge.min_replicas = {cfg.judge.min_replicas} > judge.max_replicas = "
                      f"{cfg.judge.max_replicas}")
    return errors


def _verifiers_errors(cfg: RunConfig) -> list[str]:
    from rl_async.algo import verifiers_env

    if not verifiers_env.available():
        return [f"task.name = 'verifiers' needs {verifiers_env.EXTRA}, which is not installed"]
    if cfg.task.env is None:
        return ["task.name = 'verifiers' needs task.env = '<module>' (a module with "
                "load_environment(**task.env_args))"]
    errors = []
    try:  # verifiers environments are built at load (datasets included): as the run will
        verifiers_env.rows(verifiers_env.load(cfg.task.env, cfg.task.env_args), "train")
    except verifiers_env.VerifiersError as exc:
        errors.append(str(exc))
    return errors


def reasoning_gym_errors(cfg: RunConfig) -> list[str]:
    """task.name = 'reasoning_gym': the library, a dataset it knows, arguments it accepts."""
    from rl_async.algo import reasoning_gym_task as rg

    t = cfg.task
    if t.name != "reasoning_gym":
        return []
    if not rg.available():
        return [f"task.name = 'reasoning_gym' needs {rg.EXTRA}, which is not installed"]
    errors = []
    if not cfg.model.path:
        errors.append("task.name = 'reasoning_gym' needs model.path (a model with a "
                      "tokenizer: its questions are text)")
    if t.dataset is None:
        return errors + ["task.name = 'reasoning_gym' needs task.dataset = '<name>' (a "
                         "reasoning-gym dataset, e.g. 'basic_arithmetic')"]
    try:
        rg.create(t.dataset, t.dataset_config, cfg.run.seed, size=1)
    except rg.ReasoningGymError as exc:
        errors.append(str(exc))
    size = t.dataset_config.get("size", 1000)
    if isinstance(size, int) and size <= t.num_eval_prompts:
        errors.append(f"task.dataset_config.size = {size} <= task.num_eval_prompts = "
                      f"{t.num_eval_prompts}: nothing would be left to train on")
    return errors


def environment_errors(cfg: RunConfig) -> list[str]:
    """A multi-turn environment scores its own trajectories and drives its own turns."""
    t = cfg.task
    if t.name not in ENV_TASKS:
        return [f"task.env = {t.env!r} is set but task.name = {t.name!r}: set task.name = "
                f"'env' to train on the environment"] if t.env is not None else []
    errors = []
    if t.name == "verifiers":
        errors += _verifiers_errors(cfg)
    elif t.env is None:
        errors.append("task.name = 'env' needs task.env = 'package.module:factory' or "
                      "'path/to/file.py:factory' (the environment, SPEC §12)")
    else:  # import it now (not the factory: that may start sandboxes) rather than at run start
        from rl_async.algo.environments import EnvironmentLoadError, import_target
        try:
            import_target(t.env)
        except EnvironmentLoadError as exc:
            errors.append(str(exc))
    if cfg.refresh.mode == "mixed_policy":
        errors.append(f"refresh.mode = 'mixed_policy' with task.name = {t.name!r}: a refresh "
                      "rebuilds a single request's prefix under new weights, which needs the "
                      "managed single-turn producer; use refresh.mode = 'off'")
    if cfg.reward.function is not None or cfg.judge.enabled:
        errors.append(f"task.name = {t.name!r}: the environment's score() (a verifiers "
                      f"environment's rubric) is the reward; unset reward.function and "
                      f"judge.enabled")
    budget, prompt = cfg.rollout.max_trajectory_tokens, cfg.rollout.max_prompt_len
    if budget is not None and prompt is not None and budget <= prompt:
        errors.append(f"rollout.max_trajectory_tokens = {budget} must exceed "
                      f"rollout.max_prompt_len = {prompt}: a trajectory needs room to answer")
    return errors


GPUS_PER_NODE = 8  # the usual GPU node; more GPUs than this means several nodes


def engine_warnings(cfg: RunConfig) -> list[Warning_]:
    """SGLang settings that are legal but rarely what a run wants."""
    if cfg.engine.backend != "sglang":
        return []
    out = []
    if cfg.cluster.inference_gpus == 0:
        out.append(Warning_("SGLANG_ON_CPU", (
            "engine.backend = 'sglang' with cluster.inference_gpus = 0 launches SGLang's CPU "
            "backend (--device cpu, weights over gloo); rl-async has run this path only "
            "against a test double of the server, never against SGLang on a CPU")))
    if cfg.sglang.ignore_eos:
        out.append(Warning_("IGNORE_EOS", (
            "sglang.ignore_eos = true: SGLang then skips the stop ids as well as EOS, so every "
            "response runs to rollout.max_response_len; for fixed-length benchmarks only")))
    return out


# Keys that only one setup reads: set explicitly elsewhere, they do nothing (UNUSED_KEY).
_ONLY_FOR = (
    ("engine.max_total_tokens", lambda c: c.engine.backend == "embedded",
     "the embedded engine's token budget (SGLang sizes its KV cache itself)"),
    ("cluster.cpu_threads", lambda c: c.engine.backend == "embedded" and not
     c.cluster.inference_gpus and not c.cluster.trainer_gpus,
     "embedded engines and trainers on CPU"),
    ("cluster.cpu_allocator", lambda c: applies_to(c, "engine") or applies_to(c, "trainer"),
     "the memory of engine and trainer processes on CPU"),
    ("engine.torch_threads", lambda c: c.engine.backend == "embedded"
     and not c.cluster.inference_gpus, "the CPU threads of an embedded engine on CPU"),
    ("train.share_prompts", lambda c: c.train.backend == "torch",
     "the torch trainer's (megatron runs every row whole)"),
    ("sglang.mem_fraction_static", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.port_base", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.startup_timeout_s", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.extra_args", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.ignore_eos", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.launch_module", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("sglang.python", lambda c: c.engine.backend == "sglang", "an SGLang setting"),
    ("rollout.max_trajectory_tokens", lambda c: c.task.name in ENV_TASKS,
     "a multi-turn environment's budget"),
    ("task.env_args", lambda c: c.task.name in ENV_TASKS, "a multi-turn environment's"),
    ("task.env_timeout_s", lambda c: c.task.name in ENV_TASKS, "a multi-turn environment's"),
    ("task.dataset", lambda c: c.task.name == "reasoning_gym", "a reasoning-gym task's"),
    ("task.dataset_config", lambda c: c.task.name == "reasoning_gym", "a reasoning-gym task's"),
    ("task.modulus", lambda c: c.task.name == "successor", "the built-in task's"),
    ("task.prompt_digits", lambda c: c.task.name == "successor", "the built-in task's"),
    ("task.count_tokens", lambda c: c.task.name == "successor", "the built-in task's"),
)


def unused_key_warnings(cfg: RunConfig) -> list[Warning_]:
    """Keys a file sets that this setup never reads (they are read by another one)."""
    out = []
    for key, applies, what in _ONLY_FOR:
        section, name = key.split(".")
        if name in getattr(cfg, section).model_fields_set and not applies(cfg):
            out.append(Warning_("UNUSED_KEY", f"{key} is set but does nothing here: it is "
                                              f"{what} (engine.backend = {cfg.engine.backend!r}, "
                                              f"task.name = {cfg.task.name!r})"))
    return out


def task_warnings(cfg: RunConfig) -> list[Warning_]:
    """What a task key means for this run that a user might not expect."""
    t = cfg.task
    if t.name in ("jsonl", "math", "env") and t.eval_path is None:
        return [Warning_("EVAL_SPLIT_FROM_TRAIN", (
            f"task.eval_path is unset: task.num_eval_prompts = {t.num_eval_prompts} rows of "
            f"task.path are held out for evaluation and removed from training (chosen by a "
            f"hash of each row: the same rows in every run)"))]
    return []


def path_warnings(cfg: RunConfig) -> list[Warning_]:
    """Files the run reads, checked where the command runs (the driver: under `ray job submit`
    the job's working dir, as the actors resolve them). A warning for `plan`/`validate` (a GPU
    run file is often planned on a laptop); `rl-async run` refuses to start with one, before
    any actor: a missing dataset used to surface only after engines and trainers loaded."""
    wanted = {}
    if cfg.model.path:
        wanted["model.path"] = cfg.model.path
    if cfg.task.name in ("jsonl", "math", "env"):
        wanted.update({k: v for k, v in (("task.path", cfg.task.path),
                                         ("task.eval_path", cfg.task.eval_path)) if v})
    return [Warning_(MISSING_PATH, f"{key} = {value!r}: no such file or directory here "
                                   f"({os.getcwd()}); fix the path or run from where it exists")
            for key, value in wanted.items() if not os.path.exists(os.path.expanduser(value))]


MISSING_PATH = "MISSING_PATH"


def storage_warnings(cfg: RunConfig) -> list[Warning_]:
    """Checkpoints and exports are written by the ranks that hold the data, on their own
    nodes: a multi-node run needs run.output_dir on storage every node shares."""
    c, out = cfg.cluster, cfg.run.output_dir
    multi_node = c.inference_gpus + c.trainer_gpus > GPUS_PER_NODE
    if multi_node and (not out.startswith("/") or out.startswith("/tmp")):
        return [Warning_("OUTPUT_DIR_NOT_SHARED", (
            f"run.output_dir = {out!r} with {c.inference_gpus + c.trainer_gpus} GPUs (more "
            f"than one node): checkpoints need an absolute path on shared storage every node "
            f"mounts; a relative path under `ray job submit` lands in the job's temporary "
            f"working dir and is lost"))]
    return []


def trainer_layout_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    """Model parallelism must tile the trainer workers, and every data-parallel rank must get
    whole groups of each collection (the fleet shards a collection by group: `groups[dp::DP]`;
    advantages are normalised within a group, so a group cannot be split across ranks)."""
    t, workers = cfg.train, cfg.cluster.trainer_workers
    model_parallel = t.tensor_parallel * t.pipeline_parallel
    errors: list[str] = []
    # synthetic trainers (dry runs) keep a megatron file's layout
    if t.backend not in ("megatron", "synthetic") and model_parallel > 1:
        return [f"train.tensor_parallel = {t.tensor_parallel}, train.pipeline_parallel = "
                f"{t.pipeline_parallel}: model parallelism needs train.backend = 'megatron' "
                f"(train.backend = {t.backend!r} is data parallel only)"]
    if workers % model_parallel:
        return [f"cluster.trainer_workers = {workers} must be a multiple of train.tensor_parallel"
                f" x train.pipeline_parallel = {t.tensor_parallel} x {t.pipeline_parallel} = "
                f"{model_parallel}"]
    dp = workers // model_parallel
    if plan.rollout_batch_size % dp:
        errors.append(
            f"rollout.rollout_batch_size = {plan.rollout_batch_size} groups must be a multiple of "
            f"the {dp} data-parallel trainer ranks (cluster.trainer_workers = {workers} / "
            f"(train.tensor_parallel x train.pipeline_parallel = {model_parallel})), so every "
            f"rank trains on whole groups")
    if t.backend == "megatron" and plan.global_batch_size % (dp * t.micro_batch_size):
        errors.append(
            f"train.global_batch_size = {plan.global_batch_size} must be a multiple of "
            f"{dp} data-parallel ranks x train.micro_batch_size = {t.micro_batch_size}")
    return errors


def step_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    """The controller advances by whole collections (optimizer_steps_per_collection updates
    at a time): a checkpoint or evaluation interval, or a run length, that is not a multiple
    of it would be silently coarsened or overshot."""
    k = plan.optimizer_steps_per_collection
    if k <= 1:
        return []
    return [f"{key} = {value} is not a multiple of the {k} optimizer updates per collection "
            f"(train.global_batch_size = {plan.global_batch_size} of "
            f"{plan.collection_samples} samples): steps advance {k} at a time; use a "
            f"multiple of {k}"
            for key, value in (("run.checkpoint_every", cfg.run.checkpoint_every),
                               ("eval.every_steps", cfg.eval.every_steps),
                               ("run.max_steps", cfg.run.max_steps))
            if value and value % k]


def architecture_errors(cfg: RunConfig) -> list[str]:
    """model.architecture must describe the checkpoint it stands in for, where it is readable."""
    m = cfg.model
    config = Path(m.path) / "config.json" if m.path else None
    if m.architecture is None or config is None or not config.is_file():
        return []
    real = json.loads(config.read_text())
    wrong = {k: (v, real.get(k)) for k, v in m.architecture.items() if real.get(k) != v}
    return [f"model.architecture.{k} = {v!r} but {config} has {r!r}"
            for k, (v, r) in wrong.items()]


def validate(cfg: RunConfig) -> Report:
    plan, warnings, errors = plan_capacity(cfg)
    errors = (errors + refresh_errors(cfg, plan) + placement_errors(cfg, plan)
              + trainer_layout_errors(cfg, plan) + publication_errors(cfg, plan)
              + step_errors(cfg, plan)
              + publication_lag_errors(cfg, plan) + architecture_errors(cfg) + moe_errors(cfg))
    errors += trajectory_errors(cfg)
    template_errors, template_warnings = template_report(cfg) if not errors else ([], [])
    memory, note, mem_warnings, mem_errors = (None, "", [], [])
    if not errors:  # a plan of an invalid layout would only add noise
        memory, note, mem_warnings, mem_errors = plan_memory(cfg, plan)
    return Report(plan=plan, warnings=warnings + engine_warnings(cfg) + task_warnings(cfg)
                  + unused_key_warnings(cfg) + storage_warnings(cfg) + path_warnings(cfg)
                  + template_warnings
                  + mem_warnings, errors=errors + template_errors + mem_errors, memory=memory,
                  memory_note=note)
