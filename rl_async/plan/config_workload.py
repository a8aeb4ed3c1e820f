"""Run-file sections for the workload: what is trained on ([task]), how it is scored
([reward], [judge]), which groups are kept ([filter]) and how progress is measured ([eval]).
Split from rl_async.plan.config (which assembles them into RunConfig) to keep files small."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from rl_async.plan.config_base import Section


class TaskSection(Section):
    # Built-in verifiable task, "jsonl" for prompt files (reward: the last number or \boxed{}
    # equals `answer`), or "math" (JSONL whose answers math-verify compares: the math extra).
    # "env": a multi-turn environment (SPEC §12) fed the rows of task.path.
    # "reasoning_gym": reasoning-gym's generator `dataset` (the envs extra).
    # "verifiers": a verifiers environment (module `env`), through the gateway.
    name: Literal["successor", "jsonl", "math", "env", "reasoning_gym",
                  "verifiers"] = "successor"
    path: str | None = None
    eval_path: str | None = None
    num_eval_prompts: PositiveInt = 64
    # task.name = "env": "package.module:factory" or "path/to/file.py:factory", called with
    # env_args; every environment call (reset, step, score; a gateway environment's time
    # between its model calls) must finish within env_timeout_s, or the group fails.
    # task.name = "verifiers": the module verifiers loads.
    env: str | None = None
    env_args: dict[str, Any] = Field(default_factory=dict)
    env_timeout_s: PositiveFloat = 60.0
    # A whole trajectory's wall-clock budget (model time included): once spent, no new
    # turn starts (a gateway call answers empty) and the trajectory ends truncated,
    # scored as it stands. Unset: no time budget (the token budget still holds).
    trajectory_timeout_s: PositiveFloat | None = None
    # The OpenAI-compatible gateway's largest request body: agents resend the whole
    # conversation on every call.
    gateway_max_body_mb: PositiveInt = 64
    # Chat rendering (environments, chat prompts): a Jinja file replacing the model's chat
    # template, and keyword arguments every rendering gets (e.g. enable_thinking = false).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # task.name = "reasoning_gym": a dataset name and its config table (size: entries
    # generated, 1000 by default; the seed is run.seed).
    dataset: str | None = None
    dataset_config: dict[str, Any] = Field(default_factory=dict)
    # Built-in task: digits 0..modulus-1 in the prompt.
    modulus: int = Field(10, ge=2, le=100)
    prompt_digits: int = Field(3, ge=1, le=6)
    # Built-in task, long-tailed: the response keeps counting from the answer for n tokens,
    # n in [2, count_tokens] by prompt (its exact budget), rewarded by the share counted right
    # (rl_async.algo.successor). 0: the plain task, one answer token.
    count_tokens: int = Field(0, ge=0, le=255)


class RewardSection(Section):
    # `module:function`, sync or async, (sample) -> float. Default: the task's own verifier.
    function: str | None = None
    timeout_s: PositiveFloat = 30.0
    max_retries: int = Field(2, ge=0)
    concurrency: PositiveInt = 16
    # Where rewards run (rl_async.algo.scoring): "actor" (the reward actor: user code that may
    # block, judges), "producer" (inside the producer, no actor round trip), "auto": producer
    # for functions marked inline_safe (the built-in verifiers) unless a judge grades.
    placement: Literal["auto", "actor", "producer"] = "auto"
    # Where a sync reward function runs (rl_async.algo.reward_pool): "process", a worker
    # process that reward.timeout_s kills (retries cannot pile up stuck calls); "thread", in
    # the process (for functions that keep state between calls; a timeout then abandons the
    # thread, which runs on). Async functions run on the event loop either way.
    isolation: Literal["process", "thread"] = "process"


class EvalSection(Section):
    # Evaluate every N optimizer updates (0 = only at start and end).
    every_steps: int = Field(0, ge=0)
    # eval/reward: one greedy response per prompt (true), or one sampled at
    # rollout.temperature / top_p / top_k (false).
    greedy: bool = True
    # k > 0 adds eval/pass@k (best of k sampled rewards per prompt, the share solved for 0/1
    # rewards) and eval/mean@k (mean of the k), sampled at the rollout settings.
    n_samples: int = Field(0, ge=0)
    # Mid-run evaluations of an async run: false evaluates while generation goes on (no
    # publication runs during an evaluation, so every eval response comes from the evaluated
    # weights, and the trainer finds its next collection ready); true first stops opening
    # groups and waits for the owned ones to land (an idle pipeline that must refill).
    drain: bool = False


class FilterSection(Section):
    # Dynamic sampling: drop groups whose rewards are all equal (no learning signal under
    # group-normalised advantages); counted as filtered, replaced by new prompts.
    zero_variance: bool = False


class JudgeSection(Section):
    enabled: bool = False
    # `module:Class` of the judge served by Ray Serve.
    judge_class: str = "actors.judges:RuleJudge"
    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 2
    target_ongoing_requests: PositiveFloat = 2.0
    max_ongoing_requests: PositiveInt = 8
    timeout_s: PositiveFloat = 30.0
    max_retries: int = Field(2, ge=0)
    # Serve's defaults (upscale 30 s, downscale 600 s) suit web traffic; rollout bursts come
    # and go within a training step, so judges react faster.
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    # Window of the ongoing-request average; keep it above Serve's 10 s metrics interval.
    look_back_period_s: PositiveFloat = 15.0
    num_cpus: float = Field(1.0, ge=0)   # Ray resources per replica
    num_gpus: float = Field(0.0, ge=0)
    kwargs: dict[str, Any] = Field(default_factory=dict)  # judge constructor arguments
