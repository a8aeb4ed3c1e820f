"""The runner of a `task.name = "env"` or `"verifiers"` run: the environment of `task.env`
behind the protocol it implements (reset/step/score: rl_async.loop.trajectory; rollout
through the OpenAI-compatible gateway: rl_async.loop.agent_runner, which a verifiers
environment always uses), with the model's chat template (task.chat_template and
task.chat_template_kwargs applied) and the rollout limits."""

from __future__ import annotations

from rl_async.algo.chat import run_renderer
from rl_async.algo.environments import is_agent, load_environment
from rl_async.loop.agent_runner import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryRunner


def build_environment_runner(cfg) -> TrajectoryRunner | AgentRunner:
    renderer = run_renderer(cfg)
    if cfg.task.name == "verifiers":
        from rl_async.algo.verifiers_env import make_agent

        env = make_agent(cfg.task.env, cfg.task.env_args, cfg)
    else:
        env = load_environment(cfg.task.env, cfg.task.env_args)
    t = cfg.task
    limits = TrajectoryLimits(cfg.rollout.max_response_len, cfg.rollout.max_trajectory_tokens,
                              t.env_timeout_s, t.trajectory_timeout_s)
    if is_agent(env):
        return AgentRunner(env, renderer, limits,
                           Gateway(cfg.run.name, renderer.tokenizer,
                                   max_body_mb=t.gateway_max_body_mb))
    return TrajectoryRunner(env, renderer, limits)
