"""The OpenAI-compatible gateway (SPEC §12): /v1/chat/completions, /v1/completions and
/v1/models in front of the producer's gated, routed generation, for agent environments that
drive the model through an OpenAI client (rl_async.loop.agent, rl_async.loop.agent_runner).

It runs inside the producer's event loop (the environments' rollouts run there too), bound to
127.0.0.1 on a free port. A call is bound to its trajectory by any of:
- the trajectory's own base URL, `/s/<trajectory>/v1/...`, with its own API key (what
  `endpoint.base_url` and `endpoint.api_key` are: a harness configured only through
  OPENAI_BASE_URL / OPENAI_API_KEY works unmodified);
- the trajectory's API key alone, on `/v1/...`;
- the run's token (`Authorization: Bearer <token>`, a fresh secret per run) with the
  trajectory's id in the URL, the `X-Trajectory-Id` header or the body's `trajectory_id`.

What a request may ask is in rl_async.loop.openai_wire (honoured, or refused with a 400 naming
the field). `stream: true` answers in OpenAI's server-sent events. Bodies up to
`task.gateway_max_body_mb`. A refused call is recorded on its trajectory, which is then
regenerated rather than scored (infrastructure, not the policy). When a rollout returns its
trajectory is closed: calls still in flight are cancelled (their engine requests aborted by
the producer) and later ones get 409; a call whose client disconnects is cancelled too
(aiohttp's handler cancellation) and costs the trajectory (it is regenerated).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import OrderedDict

from rl_async.loop import openai_wire as wire
from rl_async.loop.agent import (AgentTrajectory, Endpoint, GatewayRefusal, TrajectoryAborted,
                                 TrajectoryClosed)

HEADER = "X-Trajectory-Id"
_CLOSED_REMEMBERED = 4096  # ended trajectories whose late calls get 409, not 404
_ids = itertools.count()


def _error(status: int, message: str, kind: str, param: str | None = None):
    from aiohttp import web

    return web.json_response(wire.error_body(status, message, kind, param), status=status)


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
    def __init__(self, model: str, tokenizer, host: str = "127.0.0.1",
                 max_body_mb: int = 64):
        self.model, self.tokenizer, self.host = model, tokenizer, host
        self.max_body_mb = max_body_mb
        self.token = secrets.token_urlsafe(24)
        self.trajectories: dict[str, AgentTrajectory] = {}
        self.keys: dict[str, str] = {}            # per-trajectory API key -> trajectory id
        self._calls: dict[str, set[asyncio.Task]] = {}  # trajectory id -> handlers serving it
        self._closed: OrderedDict[str, None] = OrderedDict()
        self.root: str | None = None              # http://host:port
        self._runner = None
        self._http = None  # the pooled client every trajectory's OpenAI client shares
        self._lock = asyncio.Lock()

    @property
    def base_url(self) -> str | None:
        return None if self.root is None else f"{self.root}/v1"

    async def start(self) -> str:
        """Bind (once) and return the run-wide base URL, ".../v1"."""
        async with self._lock:
            if self.root is None:
                from aiohttp import web

                app = web.Application(client_max_size=self.max_body_mb * 1024 * 1024)
                for prefix in ("/v1", "/s/{session}/v1"):
                    app.router.add_post(f"{prefix}/chat/completions", self._chat)
                    app.router.add_post(f"{prefix}/completions", self._completions)
                    app.router.add_get(f"{prefix}/models", self._models)
                # Handler cancellation: a handler whose client went away stops (and with it
                # its engine request) instead of generating for no one.
                self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
                await self._runner.setup()
                site = web.TCPSite(self._runner, self.host, 0)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]
                self.root = f"http://{self.host}:{port}"
                self._http = _shared_http_client()
        return self.base_url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close_shared()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.root = None, None

    async def open(self, trajectory: AgentTrajectory) -> Endpoint:
        """Register a trajectory under a fresh opaque id and key; its endpoint."""
        await self.start()
        tid = f"t{next(_ids)}-{secrets.token_hex(4)}"  # ASCII, whatever the row's id
        key = f"rlt-{secrets.token_urlsafe(24)}"
        self.trajectories[tid], self.keys[key] = trajectory, tid
        trajectory.api_key = key
        return Endpoint(f"{self.root}/s/{tid}/v1", key, self.model, tid, self._http,
                         self.base_url)

    def close(self, trajectory_id: str) -> None:
        """The rollout returned: refuse later calls, cancel the ones in flight."""
        traj = self.trajectories.pop(trajectory_id, None)
        if traj is None:
            return
        traj.closed = True
        self.keys.pop(getattr(traj, "api_key", None), None)
        for task in self._calls.pop(trajectory_id, set()):
            task.cancel()
        self._closed[trajectory_id] = None
        while len(self._closed) > _CLOSED_REMEMBERED:
            self._closed.popitem(last=False)

    # -- HTTP ---------------------------------------------------------------------------

    def _caller(self, request) -> tuple[str | None, str | None]:
        """(the trajectory the credentials name, or None for the run's token; refusal)."""
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if secrets.compare_digest(given.encode(), self.token.encode()):
            return None, None
        if given in self.keys:
            return self.keys[given], None
        return None, "missing or wrong API key (a trajectory's key, or the run's gateway token)"

    async def _models(self, request):
        from aiohttp import web

        if self._caller(request)[1] is not None:
            return _error(401, self._caller(request)[1], "authentication_error")
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "rl-async"}]})

    async def _trajectory(self, request) -> tuple[str | None, AgentTrajectory | None, object]:
        """(id, trajectory, body) or (id, None, an error response)."""
        from aiohttp import web

        keyed, refused = self._caller(request)
        if refused is not None:
            return None, None, _error(401, refused, "authentication_error")
        session = request.match_info.get("session")
        if keyed is not None and session not in (None, keyed):
            return None, None, _error(401, f"this API key belongs to another session than "
                                           f"{session!r}", "authentication_error")
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            tid = keyed or session or request.headers.get(HEADER)
            if tid in self.trajectories:
                self.trajectories[tid].refused = "a request body over the gateway's limit"
            return tid, None, _error(413, f"the request body is over task.gateway_max_body_mb "
                                          f"= {self.max_body_mb}; raise it", "invalid_request_error")
        except ValueError:
            return None, None, _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return None, None, _error(400, "the body must be a JSON object",
                                      "invalid_request_error")
        tid = keyed or session or request.headers.get(HEADER) or body.get("trajectory_id")
        traj = self.trajectories.get(tid) if tid else None
        if traj is None:
            if tid in self._closed:
                return tid, None, _error(409, f"trajectory {tid} has ended: its rollout "
                                              f"returned", "invalid_request_error")
            return tid, None, _error(404, f"no open trajectory {tid!r} (use the endpoint's "
                                          f"base_url and api_key)", "invalid_request_error")
        return tid, traj, body

    async def _serve(self, request, kind: str):
        tid, traj, body = await self._trajectory(request)
        if traj is None:
            return body
        task = asyncio.current_task()
        self._calls.setdefault(tid, set()).add(task)
        traj.begin_call()
        try:
            return await self._answer(request, kind, tid, traj, body)
        except asyncio.CancelledError:
            if not traj.closed:  # the client went away mid-call: the call is lost
                traj.lost = traj.lost or "a model call's client disconnected mid-call"
            raise
        finally:
            self._calls.get(tid, set()).discard(task)
            traj.end_call()

    async def _answer(self, request, kind: str, tid: str, traj: AgentTrajectory, body: dict):
        try:
            options = wire.options(body)
            if traj.error is not None:
                raise traj.error
            if traj.busy_calls > 1:  # one conversation, one call at a time
                raise GatewayRefusal("a call on this trajectory is already in flight")
            if kind == "chat":
                reply = await traj.chat(wire.messages(body), wire.max_tokens(body),
                                        wire.tools(body), options)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise GatewayRefusal("'prompt' must be a string (token-id prompts are not "
                                         "served)")
                reply = await traj.complete(prompt, wire.max_tokens(body), options)
        except GatewayRefusal as exc:
            traj.refused = traj.refused or str(exc)
            return _error(400, f"trajectory {tid}: {exc}", "invalid_request_error")
        except TrajectoryClosed as exc:
            return _error(409, f"trajectory {tid}: {exc}", "invalid_request_error")
        except TrajectoryAborted as exc:
            return _error(503, f"trajectory {tid}: {exc}", "server_error")
        except Exception as exc:  # an engine or actor error: the runner re-raises it as is
            traj.error = exc
            return _error(500, f"trajectory {tid}: {type(exc).__name__}: {exc}", "server_error")
        whole = wire.response(kind, body, reply, self.model, self.tokenizer)
        if not options.stream:
            from aiohttp import web

            return web.json_response(whole)
        return await self._stream(request, wire.sse_events(kind, whole, options.include_usage))

    async def _stream(self, request, events: list[bytes]):
        from aiohttp import web

        out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                          "Cache-Control": "no-cache"})
        await out.prepare(request)
        for event in events:
            await out.write(event)
        await out.write_eof()
        return out

    async def _chat(self, request):
        return await self._serve(request, "chat")

    async def _completions(self, request):
        return await self._serve(request, "completions")
