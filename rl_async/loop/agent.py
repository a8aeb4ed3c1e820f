"""Agent environments: the environment runs its own loop and calls the model through the
OpenAI-compatible gateway (rl_async.loop.gateway); the trajectory is assembled from the calls.

    rollout(row, endpoint) -> float        the environment's whole episode, and its reward

`endpoint` (Endpoint) carries a base URL and an API key of this trajectory alone
(`.../s/<trajectory>/v1` and a per-trajectory key), so a harness configured only through
OPENAI_BASE_URL / OPENAI_API_KEY is bound to its trajectory; `endpoint.openai_client()` is an
`openai.AsyncOpenAI` built from them.

Token-in/token-out holds as in rl_async.loop.trajectory: the gateway keeps each trajectory's
token ids. The first call's messages are rendered by the chat template (the prompt); every
later call must repeat the conversation so far unchanged (the messages sent before and the
assistant replies exactly as returned) and append only new user/tool/system messages; those
are rendered as the template's delta (loss_mask 0) and the engine continues the exact tokens
so far. A call the gateway refuses (a rewritten history, a field it cannot honour) is
infrastructure, not the policy: the trajectory is aborted and regenerated (rl_async.loop.
agent_runner), whatever the environment does with the HTTP 400.

Limits: each call gets min(max_tokens asked, rollout.max_response_len, the room left in
rollout.max_trajectory_tokens); once the budget, the environment's `max_turns` (optional
here) or task.trajectory_timeout_s is spent, calls answer empty with finish_reason "length"
and the trajectory is counted truncated. A call arriving after the rollout returned is
refused (409) and nothing it generates is kept.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

from rl_async.algo.chat import ChatRenderer
from rl_async.base import clock
from rl_async.base.types import Sample
from rl_async.engine.base import EngineError, GenerateOutput
from rl_async.loop.openai_wire import CallOptions, GatewayRefusal
from rl_async.loop.trajectory import TrajectoryLimits, TurnGenerate

__all__ = ["AgentTrajectory", "Endpoint", "GatewayRefusal", "Reply", "TrajectoryAborted",
           "TrajectoryClosed", "parse_tool_calls"]


class TrajectoryAborted(RuntimeError):
    """An engine aborted a turn past its retries: the group is regenerated (HTTP 503)."""


class TrajectoryClosed(RuntimeError):
    """A call on a trajectory whose rollout already returned (HTTP 409)."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str          # ".../s/<trajectory>/v1": this trajectory's own base URL
    api_key: str           # this trajectory's own key
    model: str
    trajectory_id: str
    # The gateway's pooled HTTP client: an OpenAI client costs ~20 ms to build with its own
    # (an SSL context each), 20x a loopback call, so every trajectory's client shares one.
    http_client: Any = field(default=None, compare=False, repr=False)
    gateway_url: str = ""  # the run-wide ".../v1" (calls bound by their key alone)

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
    """(content without the parsed calls, OpenAI tool_calls). Only blocks after the last
    `</think>` count (a model thinking about a call has not made it); `arguments` or
    Llama-style `parameters`. A block that is not a JSON object with a string `name` stays
    in the content, as the model wrote it."""
    calls: list[dict] = []

    def take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return match.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{turn}_{len(calls)}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(
                          args, str) else json.dumps(args)}})
        return ""

    cut = text.rfind("</think>")
    head, tail = (text[:cut + len("</think>")], text[cut + len("</think>"):]) if cut >= 0 \
        else ("", text)
    content = head + _TOOL_CALL.sub(take, tail)
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
    busy_calls: int = 0                                 # calls being served
    api_key: str = ""                                   # its key on the gateway
    # Infrastructure, not the policy: a refused call, a call whose client went away.
    refused: str | None = None
    lost: str | None = None
    closed: bool = False                                # the rollout returned
    deadline: float | None = None                       # task.trajectory_timeout_s
    # The environment's own time (task.env_timeout_s bounds each stretch of it): since
    # when it has had control, and a wake-up for the watchdog at every call's start and end.
    env_since: float = 0.0
    changed: asyncio.Event | None = None

    def infrastructure(self) -> str | None:
        """Why this trajectory must be regenerated rather than scored, if it must."""
        if self.aborted:
            return "an engine aborted a turn past its retries"
        if self.refused:
            return f"the gateway refused a call: {self.refused}"
        return self.lost

    @property
    def busy(self) -> bool:
        return self.busy_calls > 0

    def begin_call(self) -> None:
        self.busy_calls += 1
        self._changed()

    def end_call(self) -> None:
        self.busy_calls -= 1
        self.env_since = clock.now()
        self._changed()

    def _changed(self) -> None:
        if self.changed is not None:
            self.changed.set()

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
        if self.closed:
            raise TrajectoryClosed("this trajectory's rollout already returned; calls after it "
                                   "are refused")
        if self.aborted:  # a client that retries after the 503 gets it again
            raise TrajectoryAborted("an engine aborted this trajectory; its group is regenerated")

    async def chat(self, messages: list[dict], max_tokens: int | None,
                   tools: list[dict] | None = None, options: CallOptions = CallOptions()
                   ) -> Reply:
        self._check_open()
        self._kind("chat")
        if not messages:
            raise GatewayRefusal("messages is empty")
        if self.sample.turns == 0 and not self.sample.prompt_ids:
            self.sample.prompt_ids = self.renderer.prompt_ids(messages, tools)
            self.messages, self.tools = list(messages), tools
        else:
            new = self._new_messages(messages, tools)
            if self._room(max_tokens) >= 1:
                ids = self.renderer.continuation_ids(self.messages, self.last_output, new,
                                                     self.tools)
                if self._fits(ids):
                    self._context(ids)
            self.messages = self.messages + list(new)
        reply = await self._turn(max_tokens, options.stop)
        reply.content, reply.tool_calls = (
            parse_tool_calls(reply.text, self.sample.turns) if self.tools and options.tools_parsed
            else (reply.text, []))
        message = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        self.messages.append(message)
        return reply

    def _new_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        if (tools or None) != self.tools:
            raise GatewayRefusal("tools differ from the trajectory's first call (the prompt "
                                 "rendered them; they cannot change mid-way)")
        for i, m in enumerate(self.messages):
            if i >= len(messages) or not _same(messages[i], m):
                raise GatewayRefusal(
                    f"message {i} differs from the conversation so far (expected role "
                    f"{m.get('role')!r}, content {(m.get('content') or '')[:60]!r}): "
                    f"token-in/token-out needs an append-only conversation with the "
                    f"assistant replies exactly as returned")
        new = messages[len(self.messages):]
        if not new or any(m.get("role") == "assistant" for m in new):
            raise GatewayRefusal("a follow-up call must append user, tool or system "
                                 "messages after the last assistant reply")
        return new

    async def complete(self, prompt: str, max_tokens: int | None,
                       options: CallOptions = CallOptions()) -> Reply:
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
        reply = await self._turn(max_tokens, options.stop)
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
        if self.deadline is not None and clock.now() >= self.deadline:
            self.finish = "timeout"
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

    async def _turn(self, max_tokens: int | None, stop: tuple[str, ...] = ()) -> Reply:
        room = self._room(max_tokens)
        if room < 1 or self.finish != "done":  # a budget is spent: answer nothing, truncated
            return Reply("", [], [], "length", self._ids())
        input_ids = self._ids()
        start = clock.now()
        try:
            out: GenerateOutput = await self.generate(input_ids, room, self.sample.turns)
        finally:
            self.generate_seconds += clock.now() - start
        if self.closed:  # the rollout returned meanwhile: nothing of this call is kept
            raise TrajectoryClosed("this trajectory's rollout returned during the call")
        if not (len(out.output_ids) == len(out.output_logprobs) == len(out.token_versions)):
            raise EngineError(f"engine reply for turn {self.sample.turns} is malformed: "
                              f"{len(out.output_ids)} tokens, {len(out.output_logprobs)} "
                              f"log-probs, {len(out.token_versions)} versions")
        self.sample.turns += 1
        self.sampled += len(out.output_ids)
        if out.finish_reason == "abort":
            self.aborted = True
            raise TrajectoryAborted("an engine aborted this turn; the group is regenerated")
        n, text, finish = self._cut_at_stop(out, stop)
        self._extend(out.output_ids[:n], out.output_logprobs[:n], out.token_versions[:n], 1)
        self.last_output = list(out.output_ids[:n])
        return Reply(text, list(out.output_ids[:n]), list(out.output_logprobs[:n]), finish,
                     input_ids)

    def _cut_at_stop(self, out: GenerateOutput, stop: tuple[str, ...]) -> tuple[int, str, str]:
        """(tokens kept, text returned, finish reason): a `stop` string ends the reply at the
        token that completes it (kept and trained: the policy sampled it); the text stops
        before it, as OpenAI's does. Tokens sampled past it are dropped, never trained."""
        ids = out.output_ids
        text = self.renderer.assistant_text(ids)
        finish = "stop" if out.finish_reason == "stop" else "length"
        hits = [at for at in (text.find(s) for s in stop) if at >= 0]
        if not hits:
            return len(ids), text, finish
        cut = min(hits)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            head = self.renderer.assistant_text(ids[:mid])
            if any(s in head for s in stop):
                hi = mid
            else:
                lo = mid + 1
        return lo, text[:cut], "stop"

    def _ids(self) -> list[int]:
        return self.sample.prompt_ids + self.sample.response_ids
