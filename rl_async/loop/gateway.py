"""The OpenAI-compatible gateway (SPEC §12): /v1/chat/completions, /v1/completions and
/v1/models in front of the producer's gated, routed generation, for agent environments that
drive the model through an OpenAI client (rl_async.loop.agent).

It runs inside the producer's event loop (the environments' rollouts run there too), bound to
127.0.0.1 on a free port, and answers only requests carrying the run's token
(`Authorization: Bearer <token>`, a fresh secret per run) and an open trajectory's id
(`X-Trajectory-Id` header, or `trajectory_id` in the body: the OpenAI client's `extra_body`).

Requests: `n` = 1 and no streaming; `max_tokens` / `max_completion_tokens` cap the reply
below the run's own limits; the run's sampling settings (rollout.temperature, top_p, top_k)
are the behaviour policy, so a request's own are ignored. `logprobs: true` adds the sampled
tokens' log-probs; `return_token_ids: true` adds `prompt_token_ids` and per-choice
`token_ids` (the exact ids trained). With `tools`, the chat template renders them (where it
supports tools) and Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` blocks in a
reply come back as OpenAI `tool_calls` (finish_reason "tool_calls"); the trained tokens are
still the sampled ones, blocks included.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from rl_async.loop.agent import (AgentTrajectory, Endpoint, GatewayRefusal, Reply,
                                 TrajectoryAborted)

HEADER = "X-Trajectory-Id"


def _error(status: int, message: str, kind: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts of type text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise GatewayRefusal(f"{where}: content must be a string or text parts")


def _messages(body: dict) -> list[dict]:
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise GatewayRefusal("'messages' must be a list")
    out = []
    for i, m in enumerate(raw):
        if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")):
            raise GatewayRefusal(f"messages[{i}]: needs a role of system, user, assistant, tool")
        message = {"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")}
        # Tool-call bookkeeping the template may render (assistant calls, tool results).
        message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k)})
        out.append(message)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise GatewayRefusal("'tools' must be a list of OpenAI tool objects")
    return tools


def _max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GatewayRefusal(f"max_tokens = {value!r}: a positive integer")
    return value


def _shared_http_client():
    """openai's default httpx client whose `aclose` (called by every OpenAI client's
    `close()`) leaves the shared pool open; the gateway closes it at stop. None without the
    openai package (environments then bring their own client)."""
    try:
        from openai import DefaultAsyncHttpxClient
    except ImportError:
        return None

    class Shared(DefaultAsyncHttpxClient):
        async def aclose(self) -> None:
            pass

        async def close_shared(self) -> None:
            await super().aclose()

    return Shared()


class Gateway:
    def __init__(self, model: str, tokenizer, host: str = "127.0.0.1"):
        self.model, self.tokenizer, self.host = model, tokenizer, host
        self.token = secrets.token_urlsafe(24)
        self.trajectories: dict[str, AgentTrajectory] = {}
        self.base_url: str | None = None
        self._runner = None
        self._http = None  # the pooled client every trajectory's OpenAI client shares
        self._lock = asyncio.Lock()

    async def start(self) -> str:
        """Bind (once) and return the base URL, ".../v1"."""
        async with self._lock:
            if self.base_url is None:
                from aiohttp import web

                app = web.Application()
                app.router.add_post("/v1/chat/completions", self._chat)
                app.router.add_post("/v1/completions", self._completions)
                app.router.add_get("/v1/models", self._models)
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                site = web.TCPSite(self._runner, self.host, 0)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]
                self.base_url = f"http://{self.host}:{port}/v1"
                self._http = _shared_http_client()
        return self.base_url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close_shared()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.base_url = None, None

    async def open(self, trajectory_id: str, trajectory: AgentTrajectory) -> Endpoint:
        base = await self.start()
        self.trajectories[trajectory_id] = trajectory
        return Endpoint(base, self.token, self.model, trajectory_id, self._http)

    def close(self, trajectory_id: str) -> None:
        self.trajectories.pop(trajectory_id, None)

    # -- HTTP ---------------------------------------------------------------------------

    async def _models(self, request):
        from aiohttp import web

        if (refused := self._auth(request)) is not None:
            return refused
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "rl-async"}]})

    def _auth(self, request):
        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return _error(401, "missing or wrong token (the run's gateway token)",
                          "authentication_error")
        return None

    async def _serve(self, request, kind: str):
        from aiohttp import web

        if (refused := self._auth(request)) is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        tid = request.headers.get(HEADER) or body.get("trajectory_id")
        traj = self.trajectories.get(tid) if tid else None
        if traj is None:
            return _error(404, f"no open trajectory {tid!r} (send the endpoint's "
                               f"{HEADER} header or extra_body trajectory_id)",
                          "invalid_request_error")
        try:
            if body.get("stream"):
                raise GatewayRefusal("stream = true is not supported")
            if body.get("n", 1) != 1:
                raise GatewayRefusal(f"n = {body.get('n')!r}: one choice per call "
                                     f"(a group's samples are separate trajectories)")
            if traj.error is not None:
                raise traj.error
            if traj.busy:  # one conversation, one call at a time: its tokens are a sequence
                raise GatewayRefusal("a call on this trajectory is already in flight")
            traj.busy = True
            try:
                if kind == "chat":
                    reply = await traj.chat(_messages(body), _max_tokens(body), _tools(body))
                else:
                    prompt = body.get("prompt")
                    if not isinstance(prompt, str):
                        raise GatewayRefusal("'prompt' must be a string")
                    reply = await traj.complete(prompt, _max_tokens(body))
            finally:
                traj.busy = False
        except GatewayRefusal as exc:
            return _error(400, f"trajectory {tid}: {exc}", "invalid_request_error")
        except TrajectoryAborted as exc:
            return _error(503, f"trajectory {tid}: {exc}", "server_error")
        except Exception as exc:  # an engine or actor error: the runner re-raises it as is
            traj.error = exc
            return _error(500, f"trajectory {tid}: {type(exc).__name__}: {exc}", "server_error")
        return web.json_response(self._response(kind, body, reply))

    async def _chat(self, request):
        return await self._serve(request, "chat")

    async def _completions(self, request):
        return await self._serve(request, "completions")

    def _response(self, kind: str, body: dict, reply: Reply) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason}
        tokens = self.tokenizer.convert_ids_to_tokens(reply.output_ids)
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                choice["message"]["tool_calls"] = reply.tool_calls
                choice["finish_reason"] = "tool_calls"
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(tokens, reply.logprobs)]}
        else:
            choice["text"] = reply.text
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": reply.logprobs,
                                      "top_logprobs": None, "text_offset": None}
        out = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(8)}",
               "object": "chat.completion" if kind == "chat" else "text_completion",
               "created": int(time.time()), "model": self.model, "choices": [choice],
               "usage": {"prompt_tokens": len(reply.prompt_ids),
                         "completion_tokens": len(reply.output_ids),
                         "total_tokens": len(reply.prompt_ids) + len(reply.output_ids)}}
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = reply.prompt_ids
            choice["token_ids"] = reply.output_ids
        return out
