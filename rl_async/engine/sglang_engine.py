"""SGLangEngine: the `Engine` interface over one SGLang server's HTTP API (pinned: 0.5.23).

Lifecycle:

    start()  --launch: python -m sglang.launch_server (own process group, own GPUs; it dies
             with this process: sglang_args.die_with_parent_command)
             --attach: config.url
          -> poll GET /health_generate until 200 (start-up timeout; a dead process or timeout
             raises EngineError with the tail of the server log)
          -> GET /model_info: the server's weight version
          -> a background task polls GET /v1/loads every load_poll_interval_s (one request
             at a time, bounded by control_timeout_s; a failed poll is recorded in
             `load().extra` and retried at the next tick)
    serve    generate / abort / pause / continue / flush / load
    publish  [pause] -> begin_weight_update -> update_weights_* (buckets) ... the call carrying
             `weight_version` sets the version, flushes the prefix cache and ends the session
             -> continue_generation (closes a session left open first)
    shutdown() stops the load poller, then SIGTERM to the process group it started, SIGKILL
             after the grace period

SGLang 0.5.23 refuses weight loads outside a begin_weight_update/end_weight_update session;
this class opens one on the first bucket of a publication, so the controller drives SGLang
and the embedded engine with the same calls.

HTTP errors become EngineError naming the endpoint, status and body (400 from /generate:
InvalidRequestError). Only idempotent reads are retried, a bounded `read_retries` times, on
connection errors and 5xx; a 4xx is final (LESSONS: miles#1497 retried a 400 into a timeout).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import uuid
from typing import Any

import aiohttp

from rl_async.engine.base import Engine, EngineError, EngineLoad, GenerateOutput, \
    InvalidRequestError, SamplingParams, TransientEngineError
from rl_async.engine import sglang_protocol as proto
from rl_async.engine.sglang_args import SGLANG_VERSION, SGLangEngineConfig, \
    build_launch_command, build_launch_env, die_with_parent_command, free_port, signal_group

__all__ = ["SGLANG_VERSION", "SGLangEngine", "SGLangEngineConfig"]

_LOG_TAIL_BYTES = 4000
_BODY_LIMIT = 2000


class SGLangEngine(Engine):
    """One SGLang server = one engine. Create, `await start()`, use, `await shutdown()`."""

    def __init__(self, config: SGLangEngineConfig):
        self.config = config
        self.base_url = config.url.rstrip("/") if config.url else ""
        self._process: subprocess.Popen | None = None
        self._log_path = config.log_path or ""
        self._session: aiohttp.ClientSession | None = None
        self._weight_version = config.initial_weight_version
        self._update_session_open = False
        self._groups: set[str] = set()  # publication channels joined (by this client)
        self._in_flight: set[str] = set()
        self._load = EngineLoad(max_running_requests=config.max_running_requests or 0)
        self._poller: asyncio.Task | None = None
        self._load_polls = 0
        self._load_poll_errors = 0
        self._load_error = ""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._session is not None:
            raise EngineError(f"sglang engine {self.base_url}: start() called twice")
        # limit=0: the producer's generation semaphore bounds concurrency, not the connector.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.config.url is None:
            self._launch()
        await self._wait_healthy()
        self._weight_version = await self.get_weight_version()
        if self.config.load_poll_interval_s > 0:
            self._poller = asyncio.create_task(self._poll_loads())

    async def _poll_loads(self) -> None:
        """Keep `load()` current while the engine runs. A failed poll is not fatal (the
        generate path reports a dead server); it is counted and its error kept for `load()`."""
        while True:
            try:
                await self.refresh_load(retries=0)  # the next tick is the retry
                self._load_polls += 1
                self._load_error = ""
            except EngineError as exc:  # _call maps HTTP, connection and timeout errors
                self._load_poll_errors += 1
                self._load_error = f"{type(exc).__name__}: {exc}"[:_BODY_LIMIT]
            await asyncio.sleep(self.config.load_poll_interval_s)

    def _launch(self) -> None:
        port = self.config.port or free_port(self.config.host)
        self.base_url = f"http://{self.config.host}:{port}"
        if not self._log_path:
            fd, self._log_path = tempfile.mkstemp(prefix=f"sglang-{port}-", suffix=".log")
            os.close(fd)
        cmd = die_with_parent_command(build_launch_command(self.config, port), os.getpid())
        with open(self._log_path, "ab") as log:
            # start_new_session: the server and its scheduler children form one process group
            # that shutdown() can end by its id, and nothing else.
            self._process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=build_launch_env(self.config, dict(os.environ)), start_new_session=True)

    async def _wait_healthy(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout_s
        last = "no reply yet"
        while True:
            if self._process is not None and self._process.poll() is not None:
                code = self._process.returncode
                await self.shutdown()
                raise EngineError(
                    f"sglang server {self.base_url} exited with code {code} "
                    f"during start-up (log {self._log_path}):\n{self._log_tail()}"
                )
            try:
                status, body = await self._send("GET", "/health_generate", None, None,
                                                self.config.control_timeout_s)
                if status == 200:
                    return
                last = f"HTTP {status}: {body!r:.200}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if loop.time() >= deadline:
                await self.shutdown()
                raise EngineError(
                    f"sglang server {self.base_url} not healthy after startup_timeout_s = "
                    f"{self.config.startup_timeout_s} s (last: {last}); raise "
                    f"sglang startup_timeout_s or check the log {self._log_path or '(attached)'}:"
                    f"\n{self._log_tail()}"
                )
            await asyncio.sleep(self.config.health_poll_interval_s)

    def _log_tail(self) -> str:
        if not self._log_path or not os.path.exists(self._log_path):
            return "(no server log)"
        with open(self._log_path, "rb") as log:
            log.seek(max(0, os.path.getsize(self._log_path) - _LOG_TAIL_BYTES))
            return log.read().decode("utf-8", errors="replace")

    async def shutdown(self) -> None:
        """Stop the server this engine launched (never an attached one) and close HTTP."""
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        proc, self._process = self._process, None
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, self.config.shutdown_grace_s)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.wait)

    async def __aenter__(self) -> SGLangEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ------------------------------------------------------------------ HTTP
    async def _send(self, method: str, path: str, payload: Any, params: dict | None,
                    timeout_s: float) -> tuple[int, Any]:
        if self._session is None:
            raise EngineError(f"sglang engine {self.base_url}: call start() before {path}")
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.request(method, self.base_url + path, json=payload,
                                         params=params, timeout=timeout) as resp:
            text = await resp.text()
            if resp.content_type == "application/json" and text:
                try:
                    return resp.status, await resp.json()
                except ValueError as exc:
                    raise EngineError(
                        f"{method} {path} on {self.base_url}: malformed JSON reply: {exc}: "
                        f"{text[:_BODY_LIMIT]}"
                    ) from exc
            return resp.status, text

    async def _call(self, method: str, path: str, payload: Any = None, *, timeout_s: float,
                    timeout_key: str, params: dict | None = None, retries: int = 0,
                    bad_request: type[EngineError] = EngineError) -> Any:
        """One endpoint call; errors name the endpoint, status and body. `retries` > 0 only
        for idempotent reads, and only on connection errors and 5xx."""
        where = f"{method} {path} on {self.base_url}"
        attempts = retries + 1
        for attempt in range(1, attempts + 1):
            try:
                status, body = await self._send(method, path, payload, params, timeout_s)
            except TimeoutError as exc:
                failure = f"timed out after {timeout_key} = {timeout_s} s"
                cause: BaseException = exc
            except aiohttp.ClientError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                cause = exc
            else:
                if status < 400:
                    return body
                failure = f"HTTP {status}: {str(body)[:_BODY_LIMIT]}"
                if status < 500:
                    error_type = bad_request if status == 400 else EngineError
                    raise error_type(f"{where}: {failure}")
                cause = None
            if attempt < attempts:
                await asyncio.sleep(self.config.retry_backoff_s)
                continue
            # Connection errors, timeouts and 5xx say nothing about the request: the
            # producer aborts the sample and its group is regenerated (rl_async.loop.faults).
            raise TransientEngineError(f"{where}: {failure} (attempt {attempt} of "
                                       f"{attempts})") from cause
        raise AssertionError("unreachable")

    @property
    def server_pid(self) -> int | None:
        """The server process this engine launched (None when attached)."""
        return self._process.pid if self._process is not None else None

    async def health(self) -> None:
        """The supervisor's probe: the server process lives and its HTTP side answers.

        GET /model_info, never /health: SGLang 0.5.23's /health generates a token unless
        the server was launched with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (this class
        sets it; an attached server may not), and that token waits while the engine is
        paused or a weight update holds its lock, then 503 after 20 s: a publication over
        20 s would make the supervisor restart healthy engines. /model_info is answered by
        the tokenizer manager alone (http_server.py model_info)."""
        if self._process is not None and self._process.poll() is not None:
            raise EngineError(f"sglang server {self.base_url} exited with code "
                              f"{self._process.returncode} (log {self._log_path})")
        await self._call("GET", "/model_info", timeout_s=self.config.control_timeout_s,
                         timeout_key="control_timeout_s")

    def _control(self, path: str, payload: Any = None, **kw: Any) -> Any:
        kw.setdefault("timeout_s", self.config.control_timeout_s)
        kw.setdefault("timeout_key", "control_timeout_s")
        return self._call("POST", path, payload, **kw)

    def _weights(self, path: str, payload: Any) -> Any:
        return self._call("POST", path, payload, timeout_s=self.config.weight_update_timeout_s,
                          timeout_key="weight_update_timeout_s")

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        rid = request_id or uuid.uuid4().hex
        routing = self.config.routed_experts
        payload = proto.generate_payload(input_ids, sampling_params, rid, self.config.ignore_eos,
                                         return_routed_experts=routing is not None)
        start_version = self._weight_version
        self._in_flight.add(rid)
        try:
            body = await self._call("POST", "/generate", payload,
                                    timeout_s=self.config.generate_timeout_s,
                                    timeout_key="generate_timeout_s",
                                    bad_request=InvalidRequestError)
        finally:
            self._in_flight.discard(rid)
        return proto.parse_generate_response(body, rid, start_version, prompt_len=len(input_ids),
                                             routing=routing)

    async def abort(self, request_id: str | None = None) -> int:
        """SGLang does not say how many it aborted; this counts this client's open requests."""
        count = len(self._in_flight) if request_id is None else int(request_id in self._in_flight)
        await self._control("/abort_request", proto.abort_payload(request_id))
        return count

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._control("/pause_generation", proto.pause_payload(mode))

    async def continue_generation(self) -> None:
        if self._update_session_open:
            # Never serve with a weight-update session open (weights may be mid-restore).
            await self.end_weight_update()
        await self._control("/continue_generation", {})

    async def flush_cache(self) -> None:
        """SGLang refuses (HTTP 400) while requests run: pause in `abort` or `retract` mode, or
        let requests finish, first. Not retried (LESSONS: miles#974, #1497)."""
        await self._control("/flush_cache", None,
                            params={"timeout": str(self.config.flush_timeout_s)},
                            timeout_s=self.config.control_timeout_s + self.config.flush_timeout_s)

    # ------------------------------------------------------------------ weights
    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None) -> None:
        """Blocks until every rank (the trainer's rank 0 included) has joined the group.
        `timeout_s` is not sent (the request of sglang_protocol.init_group_payload has no such
        field): the server's NCCL group is bounded by NCCL's watchdog, and each HTTP call
        here by weight_update_timeout_s."""
        payload = proto.init_group_payload(master_address, master_port, rank_offset,
                                           world_size, group_name, backend)
        proto.check_success(await self._weights("/init_weights_update_group", payload),
                            "POST /init_weights_update_group")
        self._groups.add(group_name)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Free the server's end of a channel (its NCCL communicator holds GPU memory)."""
        proto.check_success(await self._weights("/destroy_weights_update_group",
                                                {"group_name": group_name}),
                            "POST /destroy_weights_update_group")
        self._groups.discard(group_name)

    def weight_update_groups(self) -> list[str]:
        return sorted(self._groups)

    async def begin_weight_update(self) -> None:
        proto.check_success(await self._weights("/begin_weight_update", {}),
                            "POST /begin_weight_update")
        self._update_session_open = True

    async def end_weight_update(self) -> None:
        # Marked closed first: a failed end must not make continue_generation retry it forever.
        self._update_session_open = False
        proto.check_success(await self._weights("/end_weight_update", {}),
                            "POST /end_weight_update")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int | None = None, *,
                                              flush_cache: bool | None = None,
                                              load_format: str | None = None) -> None:
        """Receive one broadcast from rank 0. The call carrying `weight_version` is the last
        of a publication: it sets the version, flushes the prefix cache (unless
        `flush_cache=False`) and closes the session. `load_format="flattened_bucket"`: the
        trainer broadcasts one flat uint8 bucket (see sglang_protocol.update_distributed_payload)."""
        flush = weight_version is not None if flush_cache is None else flush_cache
        payload = proto.update_distributed_payload(names, dtypes, shapes, group_name,
                                                   weight_version, flush, load_format)
        await self._load_weights("/update_weights_from_distributed", payload, weight_version)

    async def update_weights_from_tensor(self, named_tensors: list,
                                         weight_version: int | None = None, *,
                                         flush_cache: bool | None = None,
                                         load_format: str | None = None) -> None:
        """Colocated engines only: tensors travel as CUDA-IPC / shared-memory handles (see
        sglang_protocol.serialize_named_tensors), so the caller's process must share the
        machine and keep the tensors alive until this returns. `named_tensors` is a list of
        (name, tensor) pairs, or already serialized per-TP-rank payloads (bytes), as SGLang's
        `flattened_bucket` format expects."""
        if named_tensors and all(isinstance(t, (bytes, bytearray)) for t in named_tensors):
            serialized = [bytes(t) for t in named_tensors]
        else:
            serialized = proto.serialize_named_tensors(named_tensors, self.config.gpus_per_engine)
        flush = weight_version is not None if flush_cache is None else flush_cache
        payload = proto.update_tensor_payload(serialized, weight_version, flush, load_format)
        await self._load_weights("/update_weights_from_tensor", payload, weight_version)

    async def _load_weights(self, path: str, payload: dict, weight_version: int | None) -> None:
        if not self._update_session_open:
            await self.begin_weight_update()
        proto.check_success(await self._weights(path, payload), f"POST {path}")
        if weight_version is not None:
            self._weight_version = weight_version
            await self.end_weight_update()

    async def get_weight_version(self) -> int:
        info = await self._call("GET", "/model_info", timeout_s=self.config.control_timeout_s,
                                timeout_key="control_timeout_s", retries=self.config.read_retries)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise EngineError(f"GET /model_info on {self.base_url}: reply has no weight_version: "
                              f"{str(info)[:_BODY_LIMIT]}")
        self._weight_version = proto.parse_version(info["weight_version"], "GET /model_info")
        return self._weight_version

    # ------------------------------------------------------------------ load
    async def refresh_load(self, retries: int | None = None) -> EngineLoad:
        """Poll GET /v1/loads (summed over DP ranks) and cache it for `load()`."""
        body = await self._call("GET", "/v1/loads", params={"include": "core"},
                                timeout_s=self.config.control_timeout_s,
                                timeout_key="control_timeout_s",
                                retries=self.config.read_retries if retries is None else retries)
        self._load = EngineLoad(**proto.parse_loads(body), weight_version=self._weight_version)
        return self.load()

    def load(self) -> EngineLoad:
        """The last polled server load plus this client's open requests (`extra.in_flight`)."""
        self._load.weight_version = self._weight_version
        self._load.extra = {"in_flight": len(self._in_flight), "url": self.base_url,
                            "load_polls": self._load_polls,
                            "load_poll_errors": self._load_poll_errors,
                            "load_error": self._load_error}
        return self._load
