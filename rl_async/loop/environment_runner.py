"""The runner of a `task.name = "env"` or `"verifiers"` run: the environment of `task.env`
behind the protocol it implements (reset/step/score: rl_async.loop.trajectory; rollout
through the OpenAI-compatible gateway: rl_async.loop.agent, which a verifiers environment
always uses), with the model's chat template and the rollout limits."""

from __future__ import annotations

from rl_async.algo.chat import ChatRenderer, digit_tokenizer
from rl_async.algo.environments import is_agent, load_environment
from rl_async.algo.tasks import load_tokenizer, stop_token_ids
from rl_async.loop.agent import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryRunner


def build_environment_runner(cfg) -> TrajectoryRunner | AgentRunner:
    tokenizer = load_tokenizer(cfg.model) if cfg.model.path is not None else digit_tokenizer()
    if tokenizer is None:
        raise ValueError(f"task.name = {cfg.task.name!r} needs a tokenizer with a chat template; "
                         f"model.path = {cfg.model.path!r} has no tokenizer files")
    renderer = ChatRenderer(tokenizer, stop_token_ids(cfg))
    if cfg.task.name == "verifiers":
        from rl_async.algo.verifiers_env import make_agent

        env = make_agent(cfg.task.env, cfg.task.env_args)
    else:
        env = load_environment(cfg.task.env, cfg.task.env_args)
    limits = TrajectoryLimits(cfg.rollout.max_response_len, cfg.rollout.max_trajectory_tokens,
                              cfg.task.env_timeout_s)
    if is_agent(env):
        return AgentRunner(env, renderer, limits, Gateway(cfg.run.name, tokenizer))
    return TrajectoryRunner(env, renderer, limits)
