"""The embedded engine: a continuous-batching torch engine for one HF causal LM (CPU or GPU).

Loop (one background asyncio task, started by the first `generate`):

    generate() -> waiting queue --admit (slots + token budget)--> prefill(prefix) -> sample
        ^                                                                     |
        |  retract / weight update / flush while frozen (KV dropped)          v
        +---------------------------- running batch <--- decode step (all rows, one forward)
                                             |
                                             +--> finished rows leave at once; futures resolved

Every step holds `_lock`; the forward runs in a worker thread so the event loop (which also
serves Ray actor calls) stays responsive; every API call that changes state takes the lock.
Speed on CPU: prefix_cache.py, cpu_linear.py, fast_decode.py (docs/benchmarks.md, "Engine").

Pause modes (SPEC §10):
- `abort`: every running and waiting request finishes with finish_reason "abort" and the
  tokens it has so far.
- `retract`: running requests go back to the front of the waiting queue, KV dropped. On
  re-admission their prefix (prompt + tokens so far) is prefilled under the weights current
  at that moment and generation continues; old tokens keep their versions and log-probs and
  `refreshes` is incremented.
- `in_place`: running requests freeze with their KV and go on after `continue_generation`.
While paused, new `generate` calls wait in the queue.

Weights and KV (LESSONS miles#2782): nothing computed under old weights is reused after a
weight load: every load (a publication's commit, or an `update_weights_*` call) retracts the
running requests (frozen ones are rebuilt on continue), empties the prompt cache and swaps
in re-packed linears. A publication is staged while generation goes on and switched in
between two steps (embedded_weights.py); a direct load of several buckets must run while
paused: a request admitted between two would run on half-updated weights.
`flush_cache` empties the prompt cache and, while paused (in_place), drops the running
requests' KV (rebuilt on continue, counted as refreshes).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import torch

from rl_async.engine.base import (PAUSE_MODES, Engine, EngineError, EngineLoad,
                                  TransientEngineError, check_request,
                                  GenerateOutput, InvalidRequestError, SamplingParams)
from rl_async.engine.kv_batch import (KVBatch, decode, decode_isolated, prefill,
                                      prefill_isolated)
from rl_async.state.models import build_causal_lm
from rl_async.state.moe_routing import Routing
from rl_async.engine.sampling import draw
from rl_async.engine.cpu_linear import pack_linears
from rl_async.engine.fast_decode import fast_decode_for
from rl_async.engine.prefix_cache import PrefixCache
from rl_async.engine.scheduler import Request, Scheduler
from rl_async.engine.timing import RequestLatency, StepCurve
from rl_async.engine.embedded_config import EmbeddedEngineConfig, check_fits  # noqa: F401 -- re-exported
from rl_async.engine.embedded_weights import EngineWeightsMixin
from rl_async.state.weights import weights_checksum


class EmbeddedEngine(EngineWeightsMixin, Engine):
    stages_weights = True

    def __init__(self, config: EmbeddedEngineConfig):
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self._threads = config.torch_threads  # applied where the forward runs (set_threads)
        self.device = torch.device(config.device)
        self.model = build_causal_lm(config.hf_config, config.path, config.init_seed,
                                     config.dtype, config.device, config.attn_implementation)
        self.model.requires_grad_(False)
        # Reproducible runs never leave the kernel to a timing: unset means stock there.
        wanted = (False if config.batch_invariant and config.onednn_linear is None
                  else config.onednn_linear)
        self._linears, self._linear_speedup = pack_linears(
            self.model, self.device, wanted, rows=max(1, config.max_running_requests // 2))
        self._fast, fast_decode = fast_decode_for(self.model)  # or why the stock forward stays
        if config.record_routing:  # MoE routing replay: kv_batch.py records at every forward
            Routing(self.model, perturb=config.routing_perturb, seed=config.init_seed)
        model_cfg = self.model.config
        self.vocab_size = int(model_cfg.vocab_size)
        self.context_len = config.context_len or int(model_cfg.max_position_embeddings)
        self.max_prompt_len = config.max_prompt_len or self.context_len - 1
        total = config.max_total_tokens or config.max_running_requests * self.context_len
        self.scheduler = Scheduler(config.max_running_requests, total)
        self.prefix_cache = PrefixCache(total // 4 if config.prefix_cache_tokens is None
                                        else config.prefix_cache_tokens)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._batch: KVBatch | None = None
        self._version = 0
        self._paused = False
        self._computing = False  # inside a step's forward (seconds_without_progress)
        self._last_progress = time.monotonic()  # the last step's end, or the last wake-up
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._requests: dict[str, Request] = {}
        self._init_weights()  # publication buffers, channels, links (embedded_weights.py)
        self._seeds = itertools.count(config.sampling_seed * 1_000_003)
        self.stats = {"steps": 0, "refreshes": 0, "aborted": 0, "failed": 0, "finished": 0,
                      "prefix_hits": 0,  # prompts copied from the prompt cache
                      "onednn_linear": self._linears is not None,
                      "onednn_linear_speedup": round(self._linear_speedup, 2),
                      "fast_decode": fast_decode}
        self.step_curve = StepCurve()  # step seconds vs requests in the step (calibration)
        self.latency = RequestLatency()  # arrival to answer, engine side (calibration)

    def _weights_changed(self) -> None:
        """After every weight load (under the step lock): nothing derived from the old
        weights may serve a step: the prompt cache is emptied, the packed linears re-packed
        (running requests are retracted by the caller)."""
        self.prefix_cache.clear()
        self._repack_all()

    # ---------------------------------------------------------------- requests
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        self._validate(input_ids, sampling_params, request_id)
        self._ensure_loop()
        rid = request_id or uuid.uuid4().hex
        generator = torch.Generator()
        seed = sampling_params.seed if sampling_params.seed is not None else next(self._seeds)
        generator.manual_seed(seed)
        request = Request(rid, list(input_ids), sampling_params, generator,
                          asyncio.get_running_loop().create_future())
        self._requests[rid] = request
        if not self._busy():  # waiting starts now, not at the last step before a quiet spell
            self._last_progress = time.monotonic()
        self.scheduler.enqueue(request)
        self._wake.set()
        arrived = time.perf_counter()
        try:
            try:
                out = await asyncio.wait_for(asyncio.shield(request.future),
                                             self.config.request_timeout_s)
            except TimeoutError:
                await self.abort(rid)
                raise TransientEngineError(
                    f"request {rid!r}: no answer within sglang.request_timeout_s = "
                    f"{self.config.request_timeout_s:g} s (aborted)") from None
            out.engine_seconds = time.perf_counter() - arrived
            self.latency.observe(out.engine_seconds)
            return out
        except asyncio.CancelledError:
            # The caller gave up (timeout, cancelled task): free the slot, then propagate.
            if not request.future.done():
                await self.abort(rid)
            raise
        finally:
            self._requests.pop(rid, None)

    def _validate(self, input_ids: list[int], params: SamplingParams,
                  request_id: str | None) -> None:
        check_request(input_ids, params)
        check_fits(input_ids, params, max_prompt_len=self.max_prompt_len,
                   vocab_size=self.vocab_size, context_len=self.context_len,
                   max_total_tokens=self.scheduler.max_total_tokens)
        if request_id is not None and request_id in self._requests:
            raise InvalidRequestError(f"request_id = {request_id!r}: already in flight")

    async def abort(self, request_id: str | None = None) -> int:
        async with self._guard():
            if request_id is None:
                return self._abort_all()
            request = self.scheduler.remove_waiting(request_id)
            if request is None and self._batch is not None:
                rows = self._batch.requests
                hit = [i for i, r in enumerate(rows) if r.rid == request_id]
                if hit:
                    request = rows[hit[0]]
                    self._batch = self._batch.select([i for i in range(len(rows))
                                                      if i != hit[0]])
            if request is None:
                return 0
            self._finish(request, "abort")
            return 1

    def _abort_all(self) -> int:
        doomed = list(self.scheduler.waiting) + (self._batch.requests if self._batch else [])
        self.scheduler.waiting.clear()
        self._batch = None
        for request in doomed:
            self._finish(request, "abort")
        return len(doomed)

    def _finish(self, request: Request, reason: str | None = None) -> None:
        if reason is not None:
            request.finish_reason = reason
        self.stats["aborted" if request.finish_reason == "abort" else "finished"] += 1
        if not request.future.done():
            request.future.set_result(request.to_output())

    # ---------------------------------------------------------------- pause / resume
    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause_generation mode = {mode!r}: use one of "
                                      f"{PAUSE_MODES}")
        async with self._guard():
            self._paused = True
            if mode == "abort":
                self._abort_all()
            elif mode == "retract":
                self._retract_running()

    async def continue_generation(self) -> None:
        async with self._guard():
            self._paused = False
            self._wake.set()

    async def flush_cache(self) -> None:
        async with self._guard():
            self.prefix_cache.clear()
            if self._paused:
                self._retract_running()

    def _retract_running(self) -> None:
        """Running requests -> front of the queue with their KV dropped (rebuilt on admit).
        Also empties the prompt cache: every weight load retracts, and no KV computed under
        the old weights may seed a request afterwards."""
        self.prefix_cache.clear()
        if self._batch is not None:
            self.scheduler.requeue_front(self._batch.requests)
            self._batch = None
            self._wake.set()

    # ---------------------------------------------------------------- weights
    async def get_weight_version(self) -> int:
        return self._version

    async def weights_checksum(self) -> str:
        async with self._guard():
            return weights_checksum(self.model.named_parameters())

    # ---------------------------------------------------------------- load / lifecycle
    def seconds_without_progress(self) -> float:
        """How long requests have waited for a decode step (0 when idle or paused): the
        health probe's sign of a forward that hangs while the actor still answers."""
        if self._paused or not self._busy():
            return 0.0
        return time.monotonic() - self._last_progress

    def _busy(self) -> bool:
        return bool(self.scheduler.waiting) or self._batch is not None or self._computing

    def load(self) -> EngineLoad:
        running = self._batch.requests if self._batch is not None else []
        return EngineLoad(
            running=len(running),
            waiting=len(self.scheduler.waiting),
            tokens_in_use=sum(r.num_tokens for r in running),
            token_capacity=self.scheduler.max_total_tokens,
            max_running_requests=self.scheduler.max_running,
            weight_version=self._version,
            extra={"reserved_tokens": sum(r.reserved_tokens for r in running),
                   "paused": self._paused, **self.stats},
        )

    async def close(self) -> None:
        """Stop the loop; requests still in flight fail with EngineError."""
        self._closed = True
        if self._task is not None and not self._task.done():
            # Let the current step finish (a cancelled worker thread would keep running and
            # race with the cleanup below); the loop exits at its next check.
            self._wake.set()
            await self._task
        async with self._guard():
            doomed = list(self.scheduler.waiting) + (self._batch.requests if self._batch else [])
            self.scheduler.waiting.clear()
            self._batch = None
            self._fail(doomed, EngineError("engine closed while the request was in flight"))
        self._close_weights()

    def _ensure_loop(self) -> None:
        if self._closed:
            raise EngineError("engine is closed; create a new EmbeddedEngine")
        loop = self._bind_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop_ref:
            # A new event loop (e.g. successive asyncio.run calls): asyncio primitives are
            # bound to one loop, so rebind them; requests of the old loop cannot survive it.
            if self._requests or self.scheduler.waiting or self._batch is not None:
                raise EngineError("engine used from a new event loop while requests of the "
                                  "old one are in flight; use one event loop per engine")
            self._loop_ref, self._lock, self._wake = loop, asyncio.Lock(), asyncio.Event()
            self._task = None
        return loop

    def _guard(self) -> asyncio.Lock:
        """The step lock of the current event loop (API calls hold it between two steps)."""
        self._bind_loop()
        return self._lock

    def _fail(self, requests: list[Request], error: Exception) -> None:
        for request in requests:
            self.stats["failed"] += 1
            if not request.future.done():
                request.future.set_exception(error)

    # ---------------------------------------------------------------- the step loop
    async def _loop(self) -> None:
        last: tuple[int, float, float] | None = None  # (requests, compute s, end) of a step
        while not self._closed:
            if last is not None:  # a step's wall time: its compute and the loop's turn after
                self.step_curve.observe(last[0], last[1] + time.perf_counter() - last[2])
                last = None
            if self._paused or (not self.scheduler.waiting and self._batch is None):
                self._wake.clear()
                await self._wake.wait()
                self._last_progress = time.monotonic()  # idle time is not a stall
                continue
            async with self._lock:
                if not self._paused:
                    last = await self._step()
            await asyncio.sleep(0)  # let API calls (abort, pause, updates) take the lock

    async def _step(self) -> tuple[int, float, float] | None:
        running = self._batch.requests if self._batch is not None else []
        admitted = self.scheduler.pop_admissible(running)
        involved = running + admitted
        if not involved:
            return None
        start = time.perf_counter()
        self._computing = True  # admitted requests are in neither the queue nor the batch yet
        try:
            if self.config.forward_in_thread:
                finished = await asyncio.to_thread(self._compute, admitted)
            else:
                finished = self._compute(admitted)
        except Exception as exc:  # noqa: BLE001 -- not swallowed: every affected request fails with it
            self._batch = None
            self._fail(involved, EngineError(
                f"engine step failed for {len(involved)} request(s) "
                f"({[r.rid for r in involved][:4]}...): {type(exc).__name__}: {exc}"))
            return None
        finally:
            self._computing = False
        self.stats["steps"] += 1
        end = time.perf_counter()
        self._last_progress = time.monotonic()
        for request in finished:
            self._finish(request)
        # Prefill of the admitted rides in the step, as the simulator folds it in.
        return len(involved), end - start, end

    def set_threads(self, threads: int) -> None:
        """torch intra-op threads for the next steps (rl_async/loop/threads.py)."""
        if threads < 1:
            raise ValueError(f"set_threads: {threads} threads; need at least 1")
        self._threads = threads

    def _compute(self, admitted: list[Request]) -> list[Request]:
        """One step in the worker thread: prefill the admitted, decode everyone, sample."""
        finished: list[Request] = []
        isolated = self.config.batch_invariant
        # torch's intra-op thread count is per calling thread (OpenMP): set it here, in the
        # thread that runs the forward, not in the event loop's.
        if self._threads is not None and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        self.stats["threads"] = torch.get_num_threads()  # what the forward really runs with
        with torch.inference_mode():
            if admitted:
                new_batch, logits_BV = (prefill_isolated if isolated else prefill)(
                    self.model, admitted, self.device, self.prefix_cache)
                self.stats["prefix_hits"] = self.prefix_cache.hits
                for request in admitted:
                    if request.output_ids:  # a rebuilt prefix: the mixed-policy refresh
                        request.refreshes += 1
                        self.stats["refreshes"] += 1
                new_batch = self._sample(new_batch, logits_BV, finished)
                self._batch = KVBatch.merge(self._batch, new_batch)
            if self._batch is not None:
                logits_BV = (decode_isolated(self.model, self._batch) if isolated
                             else decode(self.model, self._batch, self._fast))
                self._batch = self._sample(self._batch, logits_BV, finished)
        return finished

    def _sample(self, batch: KVBatch, logits_BV: torch.Tensor,
                finished: list[Request]) -> KVBatch | None:
        rows = batch.requests
        if self.config.batch_invariant:  # one row per call: no kernel sees a batch-mate
            drawn = [draw(rows[i:i + 1], logits_BV[i:i + 1]) for i in range(len(rows))]
            tokens, logprobs = [t for d in drawn for t in d[0]], [lp for d in drawn for lp in d[1]]
        else:
            tokens, logprobs = draw(rows, logits_BV)
        keep = []
        for i, (request, token, logprob) in enumerate(zip(rows, tokens, logprobs)):
            if request.record(token, logprob, self._version):
                finished.append(request)
            else:
                keep.append(i)
        return batch.select(keep)
