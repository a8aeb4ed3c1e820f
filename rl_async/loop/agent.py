"""Agent environments: the environment runs its own loop and calls the model through the
OpenAI-compatible gateway (rl_async.loop.gateway); the trajectory is assembled from the calls.

    rollout(row, endpoint) -> float        the environment's whole episode, and its reward

`endpoint` (Endpoint) carries the gateway's base_url, the run's token and this trajectory's id;
`endpoint.openai_client()` is an `openai.AsyncOpenAI` that sends the id on every call.

Token-in/token-out holds as in rl_async.loop.trajectory: the gateway keeps each trajectory's
token ids. The first call's messages are rendered by the chat template (the prompt); every
later call must repeat the conversation so far unchanged (the messages sent before and the
assistant replies exactly as returned) and append only new user/tool/system messages; those
are rendered as the template's delta (loss_mask 0) and the engine continues the exact tokens
so far. A call that rewrites history is refused (HTTP 400 naming the message), which fails
the group with that cause rather than training tokens that were never sampled.

Limits: each call gets min(max_tokens asked, rollout.max_response_len, the room left in
rollout.max_trajectory_tokens); once the budget or the environment's `max_turns` (optional
here) is spent, calls answer empty with finish_reason "length" and the trajectory is counted
truncated. `task.env_timeout_s` bounds the whole rollout (generation included).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from rl_async.algo.chat import ChatRenderer
from rl_async.algo.environments import EnvironmentFailure, call_env, check_score, row_of
from rl_async.base import clock
from rl_async.base.types import Sample
from rl_async.engine.base import EngineError, GenerateOutput
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryResult, TurnGenerate

_ids = itertools.count()


class GatewayRefusal(ValueError):
    """A call the gateway cannot serve token-in/token-out (HTTP 400, message quoted)."""


class TrajectoryAborted(RuntimeError):
    """An engine aborted a turn (publication drain, engine lost): the group is regenerated."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str          # ".../v1"
    api_key: str           # the run's gateway token
    model: str
    trajectory_id: str
    # The gateway's pooled HTTP client: an OpenAI client costs ~20 ms to build with its own
    # (an SSL context each), 20x a loopback call, so every trajectory's client shares one.
    http_client: Any = field(default=None, compare=False, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Trajectory-Id": self.trajectory_id}

    def openai_client(self, **kwargs):
        """An `openai.AsyncOpenAI` bound to this trajectory (needs the `openai` package)."""
        import openai

        # No client retries by default: a refused or aborted call is final for the trajectory.
        kwargs.setdefault("max_retries", 0)
        if self.http_client is not None:
            kwargs.setdefault("http_client", self.http_client)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                  default_headers=self.headers, **kwargs)


@dataclass
class Reply:
    text: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str     # "stop" | "length"
    prompt_ids: list[int]
    content: str | None = None                       # text less parsed tool calls
    tool_calls: list[dict] = field(default_factory=list)


# Hermes-style tool calls (Qwen2.5/3, Hermes, SmolLM3 and most open chat templates):
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the sampled text.
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, turn: int) -> tuple[str, list[dict]]:
    """(content without the parsed calls, OpenAI tool_calls). A block that is not a JSON
    object with a string `name` stays in the content, as the model wrote it."""
    calls: list[dict] = []

    def take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return match.group(0)
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{turn}_{len(calls)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(
                          args, str) else json.dumps(args)}})
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls


def _same(a: dict, b: dict) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


@dataclass
class AgentTrajectory:
    """One trajectory's tokens as the gateway serves it; fills a Sample at the end."""

    renderer: ChatRenderer
    limits: TrajectoryLimits
    generate: TurnGenerate
    max_turns: int | None = None
    messages: list[dict] = field(default_factory=list)  # chat: the conversation so far
    text: str = ""                                       # completions: the text so far
    sample: Sample = field(default_factory=lambda: Sample(prompt_id="", prompt_ids=[]))
    last_output: list[int] = field(default_factory=list)
    sampled: int = 0
    generate_seconds: float = 0.0                       # waiting on the engine
    finish: str = "done"
    aborted: bool = False
    error: BaseException | None = None                  # what a call raised (re-raised)
    kind: str | None = None                             # "chat" | "completions"
    tools: list[dict] | None = None                     # the first chat call's tools
    busy: bool = False                                  # a call is being served

    def _kind(self, kind: str) -> None:
        if self.kind not in (None, kind):
            raise GatewayRefusal(f"this trajectory started with /v1/{self.kind}; one trajectory "
                                 f"uses one endpoint")
        self.kind = kind

    def _extend(self, ids: list[int], logprobs, versions, mask: int) -> None:
        s = self.sample
        s.response_ids.extend(int(t) for t in ids)
        s.behavior_logprobs.extend(float(x) for x in logprobs)
        s.token_versions.extend(int(v) for v in versions)
        s.loss_mask.extend([mask] * len(ids))

    def _context(self, ids: list[int]) -> None:
        self._extend(ids, [0.0] * len(ids), [-1] * len(ids), 0)

    def _check_open(self) -> None:
        if self.aborted:  # a client that retries after the 503 gets it again
            raise TrajectoryAborted("an engine aborted this trajectory; its group is regenerated")

    async def chat(self, messages: list[dict], max_tokens: int | None,
                   tools: list[dict] | None = None) -> Reply:
        self._check_open()
        self._kind("chat")
        if not messages:
            raise GatewayRefusal("messages is empty")
        if self.sample.turns == 0 and not self.sample.prompt_ids:
            self.sample.prompt_ids = self.renderer.prompt_ids(messages, tools)
            self.messages, self.tools = list(messages), tools
        else:
            if (tools or None) != self.tools:
                raise GatewayRefusal("tools differ from the trajectory's first call (the "
                                     "prompt rendered them; they cannot change mid-way)")
            prior = self.messages
            for i, m in enumerate(prior):
                if i >= len(messages) or not _same(messages[i], m):
                    raise GatewayRefusal(
                        f"message {i} differs from the conversation so far (expected role "
                        f"{m.get('role')!r}, content {(m.get('content') or '')[:60]!r}): "
                        f"token-in/token-out needs an append-only conversation with the "
                        f"assistant replies exactly as returned")
            new = messages[len(prior):]
            if not new or any(m.get("role") == "assistant" for m in new):
                raise GatewayRefusal("a follow-up call must append user, tool or system "
                                     "messages after the last assistant reply")
            if self._room(max_tokens) >= 1:
                ids = self.renderer.continuation_ids(prior, self.last_output, new, self.tools)
                if self._fits(ids):
                    self._context(ids)
            self.messages = prior + list(new)
        reply = await self._turn(max_tokens)
        reply.content, reply.tool_calls = (parse_tool_calls(reply.text, self.sample.turns)
                                           if self.tools else (reply.text, []))
        message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        self.messages.append(message)
        return reply

    async def complete(self, prompt: str, max_tokens: int | None) -> Reply:
        self._check_open()
        self._kind("completions")
        if self.sample.turns == 0 and not self.sample.prompt_ids:
            self.sample.prompt_ids = self.renderer.encode(prompt)
        else:
            if not prompt.startswith(self.text):
                raise GatewayRefusal("the prompt does not extend the trajectory's text so far "
                                     "(earlier prompt + completion, unchanged)")
            if self._room(max_tokens) >= 1:
                ids = self.renderer.encode(prompt[len(self.text):])
                if self._fits(ids):
                    self._context(ids)
        self.text = prompt
        reply = await self._turn(max_tokens)
        self.text += reply.text
        return reply

    def _used(self) -> int:
        return len(self.sample.prompt_ids) + len(self.sample.response_ids)

    def _room(self, max_tokens: int | None) -> int:
        room = self.limits.max_response_len
        if max_tokens is not None:
            room = min(room, max_tokens)
        if self.limits.max_trajectory_tokens is not None:
            room = min(room, self.limits.max_trajectory_tokens - self._used())
        if self.max_turns is not None and self.sample.turns >= self.max_turns:
            self.finish = "max_turns"
            return 0
        if room < 1 and self.limits.max_trajectory_tokens is not None:
            self.finish = "max_tokens"
        return room

    def _fits(self, ids: list[int]) -> bool:
        """Whether the environment's tokens leave room for an answer; if not, the trajectory
        ends here (truncated) and nothing more is appended."""
        budget = self.limits.max_trajectory_tokens
        if budget is not None and self._used() + len(ids) >= budget:
            self.finish = "max_tokens"
            return False
        return True

    async def _turn(self, max_tokens: int | None) -> Reply:
        room = self._room(max_tokens)
        if room < 1 or self.finish != "done":  # a budget is spent: answer nothing, truncated
            return Reply("", [], [], "length", self._ids())
        input_ids = self._ids()
        start = clock.now()
        try:
            out: GenerateOutput = await self.generate(input_ids, room, self.sample.turns)
        finally:
            self.generate_seconds += clock.now() - start
        if not (len(out.output_ids) == len(out.output_logprobs) == len(out.token_versions)):
            raise EngineError(f"engine reply for turn {self.sample.turns} is malformed: "
                              f"{len(out.output_ids)} tokens, {len(out.output_logprobs)} "
                              f"log-probs, {len(out.token_versions)} versions")
        self.sample.turns += 1
        if out.finish_reason == "abort":
            self.aborted = True
            self.sampled += len(out.output_ids)
            raise TrajectoryAborted("an engine aborted this turn; the group is regenerated")
        self._extend(out.output_ids, out.output_logprobs, out.token_versions, 1)
        self.sampled += len(out.output_ids)
        self.last_output = list(out.output_ids)
        return Reply(self.renderer.assistant_text(out.output_ids), list(out.output_ids),
                     list(out.output_logprobs), "stop" if out.finish_reason == "stop"
                     else "length", input_ids)

    def _ids(self) -> list[int]:
        return self.sample.prompt_ids + self.sample.response_ids


class AgentRunner:
    """Runs an agent environment's rollouts against a gateway (same interface as
    TrajectoryRunner: the producer and the evaluation call `run`)."""

    def __init__(self, env, renderer: ChatRenderer, limits: TrajectoryLimits, gateway):
        self.env, self.renderer, self.limits, self.gateway = env, renderer, limits, gateway

    async def run(self, sample: Sample, generate: TurnGenerate) -> TrajectoryResult:
        where = f"row {sample.metadata.get('where', sample.prompt_id)}"
        traj = AgentTrajectory(self.renderer, self.limits, generate,
                               getattr(self.env, "max_turns", None))
        traj.sample = Sample(prompt_id=sample.prompt_id, prompt_ids=[])
        tid = f"t{next(_ids)}-{sample.prompt_id}"
        endpoint = await self.gateway.open(tid, traj)
        start = clock.now()
        try:
            reward = await call_env(self.env, "rollout", (row_of(sample.metadata), endpoint),
                                    self.limits.env_timeout_s, where)
        except EnvironmentFailure:
            if traj.aborted:  # the env saw the gateway's 503 for an aborted turn
                return TrajectoryResult("abort", traj.sample.turns, 0.0, traj.sampled)
            if traj.error is not None:  # an engine or actor error behind a call: as it was
                raise traj.error
            raise
        finally:
            self.gateway.close(tid)
        seconds = clock.now() - start
        if traj.aborted:
            return TrajectoryResult("abort", traj.sample.turns, 0.0, traj.sampled)
        if traj.error is not None:  # the environment swallowed a failed call
            raise traj.error
        if traj.sample.turns == 0:
            raise EnvironmentFailure(f"environment rollout for {where} never called the model "
                                     f"through the gateway")
        reward = check_score(reward, f"{where} (rollout)")
        done = traj.sample
        sample.prompt_ids, sample.response_ids = done.prompt_ids, done.response_ids
        sample.behavior_logprobs, sample.token_versions = (done.behavior_logprobs,
                                                           done.token_versions)
        sample.loss_mask, sample.turns = done.loss_mask, done.turns
        sample.reward, sample.finish_reason = reward, traj.finish
        # The environment's own time: the rollout's wall time less its waits on the model.
        env_seconds = max(0.0, seconds - traj.generate_seconds)
        return TrajectoryResult(traj.finish, done.turns, env_seconds, traj.sampled)
