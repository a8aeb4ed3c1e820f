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
gateway assembles the trained tokens from those calls (rl_async.loop.agent). A rubric with
group reward functions (verifiers' `requires_group_rollouts`) is scored by one
`env.run_group(...)` over the group's n trajectories, each with its own gateway trajectory.

A rollout that verifiers ends in an error (its state's `error`) is judged by the error's
causal chain: the policy's own doing (an empty or invalid reply, an overlong prompt, a tool
call it could not parse: every link one of those) is an outcome, trained with the rubric's
reward (0 as a rule) so the policy learns away from it; a model call that failed (ModelError
caused by a refusal or a transport error) or a tool's infrastructure (ToolCallError, the
environment's stop_errors; InfraError) aborts the trajectory, which is regenerated, never
scored; anything else (a bug) fails the group quoted. Sampling settings are the run's; the
environment's own `stop` and `max_tokens` are sent, and its max_seq_len is set to
rollout.max_trajectory_tokens so verifiers ends an overlong rollout itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import types
from typing import TYPE_CHECKING, Any

from rl_async.algo.environments import InfrastructureError

EXTRA = "verifiers (pip install -e '.[envs]')"

if TYPE_CHECKING:
    from rl_async.algo.tasks import Prompt


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
    when it has no eval dataset of its own. Lazily built datasets (a DatasetBuilder: the
    dataset stays None until built) are built here."""
    if split == "train":
        if env.dataset is None and getattr(env, "dataset_source", None) is not None:
            env.build_dataset()
        if env.dataset is None:
            raise VerifiersError("the verifiers environment has no dataset to train on")
        dataset = env.get_dataset()
    else:
        if env.eval_dataset is None and getattr(env, "eval_dataset_source", None) is not None:
            env.build_eval_dataset()
        if env.eval_dataset is None:
            return None
        dataset = env.get_eval_dataset()
    return [json.loads(json.dumps(dict(row), default=str)) for row in dataset]


_KEY = "rl_async_trajectory"
# Links of verifiers' error chain that are the policy's own doing.
_POLICY = {"InvalidModelResponseError", "EmptyModelResponseError", "OverlongPromptError",
           "ToolParseError"}


def _routed_client(endpoints):
    """A verifiers chat client for a whole group: each rollout's calls carry its own
    trajectory's key (found from the rollout's input), so one `run_group` call serves n
    gateway trajectories."""
    from verifiers.clients import OpenAIChatCompletionsClient

    keys = {e.trajectory_id: e.api_key for e in endpoints}

    class Routed(OpenAIChatCompletionsClient):
        async def get_native_response(self, *args, **kwargs):
            state = kwargs.get("state") or {}
            tid = (state.get("input") or {}).get(_KEY) or (state.get("task") or {}).get(_KEY)
            if tid not in keys:
                raise InfrastructureError(f"a verifiers rollout's state names no trajectory of "
                                          f"its group ({_KEY} = {tid!r})")
            kwargs["extra_headers"] = {"Authorization": f"Bearer {keys[tid]}"}
            return await super().get_native_response(*args, **kwargs)

    import openai

    first = endpoints[0]
    return Routed(openai.AsyncOpenAI(base_url=first.gateway_url, api_key="per-rollout",
                                     max_retries=0, http_client=first.http_client))


class VerifiersAgent:
    """Our agent protocol (rl_async.loop.agent_runner) around a verifiers environment."""

    def __init__(self, env, max_seq_len: int | None = None):
        self.env = env
        self.policy_errors = 0  # rollouts ended by the policy's own output (trained, reward 0)
        turns = getattr(env, "max_turns", None)
        self.max_turns = turns if isinstance(turns, int) and turns > 0 else None
        # Scored per group: the runner calls rollout_group once for the n trajectories.
        self.group_scored = bool(getattr(env, "requires_group_rollouts", False))
        if max_seq_len is not None and callable(getattr(env, "set_max_seq_len", None)):
            env.set_max_seq_len(max_seq_len)
        own = getattr(env, "sampling_args", None) or {}
        # The environment's protocol settings, not its behaviour ones (the run's policy).
        self.sampling_args = {k: own[k] for k in ("stop", "max_tokens", "max_completion_tokens")
                              if own.get(k) is not None}

    async def rollout(self, row: dict, endpoint) -> float:
        from verifiers.clients import OpenAIChatCompletionsClient

        client = OpenAIChatCompletionsClient(endpoint.openai_client())
        try:
            out = await self.env.run_rollout(dict(row), client, endpoint.model,
                                             sampling_args=dict(self.sampling_args))
        finally:
            await client.close()
        return self._reward(out)

    async def rollout_group(self, rows: list[dict], endpoints: list) -> list[float]:
        inputs = [{**row, _KEY: e.trajectory_id} for row, e in zip(rows, endpoints)]
        client = _routed_client(endpoints)
        try:
            outs = await self.env.run_group(inputs, client, endpoints[0].model,
                                            sampling_args=dict(self.sampling_args))
        finally:
            await client.close()
        return [self._reward(out) for out in outs]

    def _reward(self, out: dict) -> float:
        error = out.get("error")
        if error:
            verdict = judge_error(error)
            if verdict == "infrastructure":
                raise InfrastructureError(f"verifiers rollout ended in an infrastructure "
                                          f"error: {_chain(error)}: {_message(error)}")
            if verdict != "policy":
                raise RuntimeError(f"verifiers rollout ended in an error: {error}")
            self.policy_errors += 1
        return float(out.get("reward") or 0.0)


def _chain(error: Any) -> list[str]:
    if isinstance(error, dict):
        chain = error.get("error_chain_str") or error.get("error") or ""
        return [part.strip() for part in str(chain).split("->") if part.strip()]
    names, seen = [], error
    while seen is not None:
        names.append(type(seen).__name__)
        seen = seen.__cause__
    return names


def _message(error: Any) -> str:
    return str(error.get("message", "")) if isinstance(error, dict) else str(error)


def judge_error(error: Any) -> str:
    """'policy', 'infrastructure' or 'bug' for verifiers' recorded error (its causal chain,
    `error_chain_str`, outermost first)."""
    from verifiers import errors

    chain = _chain(error)
    if chain and all(name in _POLICY for name in chain):
        return "policy"
    head = getattr(errors, chain[0], None) if chain else None
    if isinstance(head, type) and issubclass(head, (errors.ModelError, errors.ToolCallError,
                                                    errors.InfraError)):
        return "infrastructure"
    return "bug"


def make_agent(module: str, args: dict[str, Any] | None = None, cfg=None) -> VerifiersAgent:
    return VerifiersAgent(load(module, args),
                          None if cfg is None else cfg.rollout.max_trajectory_tokens)


def verifiers_prompts(task_cfg, split: str) -> list[Prompt]:
    """A verifiers environment's rows: its eval_dataset for
    evaluation when it has one, else a hash split of its dataset."""
    from rl_async.algo.tasks import Prompt, held_out_split

    env = load(task_cfg.env, task_cfg.env_args)

    def prompts(rows: list[dict], part: str) -> list[Prompt]:
        return [Prompt(prompt_id=str(r.get("example_id", i)), prompt_ids=[],
                       metadata={"row": r, "where": f"verifiers:{task_cfg.env}:{part}[{i}]"})
                for i, r in enumerate(rows)]

    train = prompts(rows(env, "train"), "dataset")
    held = rows(env, "eval")
    if held is not None:
        return train if split == "train" else prompts(held, "eval_dataset")
    train, held = held_out_split(train, task_cfg.num_eval_prompts, f"verifiers:{task_cfg.env}")
    return train if split == "train" else held
