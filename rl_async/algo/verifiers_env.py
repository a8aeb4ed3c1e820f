"""`task.name = "verifiers"`: an environment written for the verifiers library (PyPI
`verifiers`, the `envs` extra), trained through the OpenAI-compatible gateway.

    [task]
    name = "verifiers"
    env = "my_env"                 # an importable module with load_environment(**env_args)
    env_args = { ... }

`verifiers.load_environment(task.env, **task.env_args)` builds it. Its dataset's rows are the
prompts (each row as the library formats it: prompt messages, answer, info); without an
eval_dataset, `task.num_eval_prompts` of them are held out by the usual hash split. Each
trajectory is one `env.run_rollout(row, client, model, sampling_args)`: the library's own
rollout loop (MultiTurnEnv's env_response, ToolEnv's tool calls) calling the model through the
gateway with an OpenAI client, then its rubric, whose reward is the sample's reward. The
gateway assembles the trained tokens from those calls (rl_async.loop.agent). A rollout that
verifiers ends in an error (its state's `error`) is judged by the error's class: the policy's
own doing (ModelError: an empty or invalid reply; OverlongPromptError; ToolError: a call it
could not parse or that failed) is an outcome, trained with the rubric's reward (0 as a rule)
so the policy learns away from it; anything else (InfraError, a bug) fails the group quoted.
Sampling settings are the run's: the environment's own sampling_args are not sent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import types
from typing import Any

EXTRA = "verifiers (pip install -e '.[envs]')"


class VerifiersError(ValueError):
    """task.env does not load as a verifiers environment."""


def available() -> bool:
    return importlib.util.find_spec("verifiers") is not None


@contextlib.contextmanager
def _without_signal_handlers():
    """verifiers 0.2 installs SIGINT/SIGTERM handlers when an environment is built: Python
    allows that only on the main thread (a Ray actor builds it on another), and in a Ray
    worker they would take over Ray's own shutdown. Building it with them suppressed keeps
    its atexit teardown."""
    import verifiers.envs.environment as built

    real = built.signal
    built.signal = types.SimpleNamespace(
        SIGINT=real.SIGINT, SIGTERM=real.SIGTERM, default_int_handler=real.default_int_handler,
        signal=lambda *_: None)
    try:
        yield
    finally:
        built.signal = real


def load(module: str, args: dict[str, Any] | None = None):
    import verifiers as vf

    try:
        with _without_signal_handlers():
            return vf.load_environment(module, **(args or {}))
    except Exception as exc:  # the library wraps import and factory errors alike
        raise VerifiersError(f"task.env = {module!r}: verifiers could not load it: "
                             f"{type(exc).__name__}: {exc} (task.env_args = {args!r})") from None


def rows(env, split: str) -> list[dict[str, Any]] | None:
    """The environment's formatted rows for `split` ("train" or "eval"); None for "eval"
    when it has no eval_dataset of its own."""
    dataset = env.dataset if split == "train" else env.eval_dataset
    if dataset is None:
        if split == "train":
            raise VerifiersError("the verifiers environment has no dataset to train on")
        return None
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    return [json.loads(json.dumps(dict(row), default=str)) for row in dataset]


class VerifiersAgent:
    """Our agent protocol (rl_async.loop.agent) around a verifiers environment."""

    def __init__(self, env):
        self.env = env
        self.policy_errors = 0  # rollouts ended by the policy's own output (trained, reward 0)
        turns = getattr(env, "max_turns", None)
        self.max_turns = turns if isinstance(turns, int) and turns > 0 else None

    async def rollout(self, row: dict, endpoint) -> float:
        from verifiers.clients import OpenAIChatCompletionsClient

        client = OpenAIChatCompletionsClient(endpoint.openai_client())
        try:
            out = await self.env.run_rollout(dict(row), client, endpoint.model,
                                             sampling_args={})
        finally:
            await client.close()
        error = out.get("error")
        if error:
            if not _policy_error(error):
                raise RuntimeError(f"verifiers rollout ended in an error: {error}")
            self.policy_errors += 1
        return float(out.get("reward") or 0.0)


def _policy_error(error: Any) -> bool:
    """Whether verifiers' recorded error is one the policy caused (see the module doc)."""
    from verifiers import errors

    name = error.get("error") if isinstance(error, dict) else type(error).__name__
    cls = getattr(errors, str(name), None)
    return isinstance(cls, type) and issubclass(
        cls, (errors.ModelError, errors.OverlongPromptError, errors.ToolError))


def make_agent(module: str, args: dict[str, Any] | None = None) -> VerifiersAgent:
    return VerifiersAgent(load(module, args))
