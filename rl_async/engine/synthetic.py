"""The synthetic engine: the full engine interface (SPEC §10) without a model.

A real load generator for dry runs and orchestration benchmarks, not a test double: every
request waits in a queue for one of `max_running_requests` slots, takes prefill time (which
samples its first token, as in SGLang and the embedded engine) and one decode step per further
token, where a step's latency grows with the running requests and the KV
tokens in use (rl_async.engine.timing). Response lengths are drawn from a long-tailed
distribution when the request arrives. Tokens are random ids; each records the weight version
that "sampled" it and a log-prob, exactly as a real engine's do.

The clock is event driven, so the cost per request is O(log n), not O(tokens x steps):

    arrivals/finishes/API calls --> advance the step counter to now --> finish due requests
        --> admit waiting requests (prefill cost) --> sleep until the next finish or a wake

`_step` counts decode steps since the start; a running request that was admitted at step s
with r tokens to go finishes at step s + r - 1 (a heap keyed by that), once its prefill is
done. Requests join only between two steps. Between two events the set of running requests
is fixed, so a step's latency is constant and "now" maps to a step count.
Token ids, log-probs and versions are materialised when a request leaves the running set.

Pause modes as the embedded engine: `abort` finishes everything with "abort" and the tokens
so far; `retract` puts running requests back at the front of the queue (their prefix is
prefilled again on re-admission, a refresh); `in_place` freezes them. A weight update retracts
the running requests, so no token after it is attributed to the old weights.

Weight publication (the documented equivalent of the collective): `init_weights_update_group`
records the group and takes `group_init_s`; each `update_weights_from_distributed` bucket takes
`bucket_seconds(bytes of its shapes and dtypes)`, the time the broadcast would take, while the
synthetic trainer's broadcast of that bucket takes the same. No bytes move; the checksum is a
digest of the names and sizes received, which the synthetic trainer computes the same way.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections import deque

from rl_async.base import clock
from rl_async.engine.base import (PAUSE_MODES, Engine, EngineError, EngineLoad, check_request,
                                  GenerateOutput, InvalidRequestError, SamplingParams)
from rl_async.engine.synthetic_types import (  # noqa: F401 -- re-exported
    SyntheticEngineConfig, _Request, _Segment, payload_checksum, payload_nbytes)
from rl_async.engine.timing import (EngineTiming, RequestLatency, ResponseLengths, StepCurve,
                                    TransferTiming)

class SyntheticEngine(Engine):
    def __init__(self, config: SyntheticEngineConfig):
        self.config = config
        self.timing, self.lengths, self.transfer = config.timing, config.lengths, config.transfer
        self.scale = config.time_scale
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._heap: list[tuple[float, int, _Request]] = []
        self._order = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._step = 0.0
        self._kv_base = 0.0          # sum(prompt + tokens at admission - start_step) of running
        self._seg: _Segment | None = None
        self._version = 0
        self._paused = False
        self._closed = False
        self._groups: set[str] = set()  # publication channels joined
        self._pub_names: list[str] = []
        self._pub_bytes = 0
        self._checksum = payload_checksum([], 0)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._seeds = itertools.count(config.sampling_seed * 1_000_003)
        self.stats = {"steps": 0.0, "refreshes": 0, "aborted": 0, "finished": 0,
                      "received_bytes": 0}
        self.step_curve = StepCurve()  # the model's steps as run (calibration)
        self.latency = RequestLatency()  # arrival to answer (calibration)
        self._prefilling: list[_Request] = []  # admitted; their prefill not done yet

    # ---------------------------------------------------------------- requests
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput:
        request = self.submit(input_ids, sampling_params, request_id)
        arrived = clock.now()
        try:
            out = await request.future
            out.engine_seconds = clock.now() - arrived
            self.latency.observe(out.engine_seconds)
            return out
        except asyncio.CancelledError:
            # The caller gave up (its await cancelled the future too): free the slot.
            if request.rid in self._requests:
                await self.abort(request.rid)
            raise

    def submit(self, input_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> _Request:
        """Queue one request; its `future` resolves to the GenerateOutput (for batch callers)."""
        check_request(input_ids, params)
        if request_id is not None and request_id in self._requests:
            raise InvalidRequestError(f"request_id = {request_id!r}: already in flight")
        if self._closed:
            raise EngineError("engine is closed; create a new SyntheticEngine")
        self._ensure_loop()
        rid = request_id or f"syn-{next(self._ids)}"
        seed = params.seed if params.seed is not None else next(self._seeds)
        rng = random.Random(seed)
        request = _Request(rid, len(input_ids), params, rng,
                           self.lengths.sample(rng, params.max_new_tokens),
                           asyncio.get_running_loop().create_future())
        self._requests[rid] = request
        self._waiting.append(request)
        self._wake.set()
        return request

    async def abort(self, request_id: str | None = None) -> int:
        self._advance()
        if request_id is None:
            return self._abort_all()
        request = self._requests.get(request_id)
        if request is None:
            return 0
        if request.running:
            self._leave(request)
        else:
            self._waiting.remove(request)  # O(waiting): aborting one request is rare
        self._finish(request, "abort")
        self._wake.set()
        return 1

    def _abort_all(self) -> int:
        doomed = list(self._waiting) + list(self._running.values())
        for request in list(self._running.values()):
            self._leave(request)
        self._waiting.clear()
        for request in doomed:
            self._finish(request, "abort")
        return len(doomed)

    # ---------------------------------------------------------------- pause / resume
    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"pause_generation mode = {mode!r}: use one of "
                                      f"{PAUSE_MODES}")
        self._advance()
        self._paused = True
        self._seg = None  # the clock stops; in_place requests keep their place
        if mode == "abort":
            self._abort_all()
        elif mode == "retract":
            self._retract_running()
        if self._wake is not None:
            self._wake.set()

    async def continue_generation(self) -> None:
        self._paused = False
        if self._wake is not None:
            self._wake.set()

    async def flush_cache(self) -> None:
        if self._paused:  # frozen KV is dropped; those requests are rebuilt on continue
            self._retract_running()

    def _retract_running(self) -> None:
        running = sorted(self._running.values(), key=lambda r: r.start_step)
        for request in running:
            self._leave(request)
        self._waiting.extendleft(reversed(running))

    # ---------------------------------------------------------------- weights
    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None) -> None:
        self._groups.add(group_name)
        await self._sleep(self.transfer.group_init_s)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        self._groups.discard(group_name)

    def weight_update_groups(self) -> list[str]:
        return sorted(self._groups)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int | None = None, *,
                                              flush_cache: bool | None = None) -> None:
        if group_name not in self._groups:
            raise EngineError(f"update_weights_from_distributed: group {group_name!r} was never "
                              f"initialised (joined: {self.weight_update_groups()})")
        nbytes = payload_nbytes(dtypes, shapes)
        await self._sleep(self.transfer.bucket_seconds(nbytes))
        self._receive(list(names), nbytes, weight_version)

    async def update_weights_from_tensor(self, named_tensors: list,
                                         weight_version: int | None = None) -> None:
        nbytes = sum(int(getattr(t, "nbytes", 0)) for _, t in named_tensors)
        await self._sleep(self.transfer.bucket_seconds(nbytes))
        self._receive([n for n, _ in named_tensors], nbytes, weight_version)

    def _receive(self, names: list[str], nbytes: int, version: int | None) -> None:
        # KV computed under old weights is never reused (LESSONS miles#2782).
        self._advance()
        self._retract_running()
        if self._wake is not None:
            self._wake.set()
        self._pub_names += names
        self._pub_bytes += nbytes
        self.stats["received_bytes"] += nbytes
        if version is not None:
            self._version = version
            self._checksum = payload_checksum(self._pub_names, self._pub_bytes)
            self._pub_names, self._pub_bytes = [], 0

    async def get_weight_version(self) -> int:
        return self._version

    async def weights_checksum(self) -> str:
        return self._checksum

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.scale)

    # ---------------------------------------------------------------- load / lifecycle
    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running), waiting=len(self._waiting),
                          tokens_in_use=int(self._kv_tokens()), token_capacity=0,
                          max_running_requests=self.config.max_running_requests,
                          weight_version=self._version,
                          extra={"paused": self._paused, **self.stats})

    async def close(self) -> None:
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        doomed = list(self._waiting) + list(self._running.values())
        self._waiting.clear()
        for request in list(self._running.values()):
            self._leave(request)
        for request in doomed:
            if not request.future.done():
                request.future.set_exception(EngineError("engine closed while the request "
                                                         "was in flight"))
            self._requests.pop(request.rid, None)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    # ---------------------------------------------------------------- the clock
    def _kv_tokens(self) -> float:
        return self._kv_base + len(self._running) * self._step

    async def _loop(self) -> None:
        while not self._closed:
            self._advance()
            if self._paused or not (self._waiting or self._running):
                self._seg = None
                self._wake.clear()
                await self._wake.wait()
                continue
            boundary = self._at_boundary()
            prefill = ((self._admit() if boundary else 0.0)
                       + (self._seg.prefill_left if self._seg else 0.0))
            steps = max(0.0, self._heap[0][0] - self._step) if self._heap else 0.0
            if not boundary and self._waiting and self._free_slot():
                steps = min(steps, math.ceil(self._step) - self._step)  # join at the next step
            step_s = self.timing.step_seconds(len(self._running), int(self._kv_tokens()))
            self._seg = _Segment(clock.now(), prefill, step_s, steps)
            dt = (prefill + steps * step_s) * self.scale
            self._wake.clear()
            if dt <= 0:
                await asyncio.sleep(0)
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), dt)
            except asyncio.TimeoutError:
                pass

    def _advance(self) -> None:
        """Move the step counter to now (the time spent in the current segment), then finish
        every request whose last token is due."""
        seg = self._seg
        if seg is None:
            return
        now = clock.now()
        elapsed = math.inf if self.scale == 0 else (now - seg.t0) / self.scale
        seg.t0 = now
        used = min(seg.prefill_left, elapsed)
        seg.prefill_left -= used
        elapsed -= used
        if seg.prefill_left > 1e-9:
            return  # no step runs (nor anyone finishes) before the prefill is done
        # A residue below the clock's resolution (1e-14 s at t = 300 s) would never elapse.
        seg.prefill_left = 0.0
        for request in self._prefilling:  # the prefill sampled each one's first token
            request.prefilled = True
        self._prefilling.clear()
        if seg.steps_left > 0 and elapsed > 0:
            k = seg.steps_left if seg.step_s <= 0 else min(seg.steps_left, elapsed / seg.step_s)
            self._step += k
            seg.steps_left -= k
            self.stats["steps"] += k
            self.step_curve.observe(len(self._running), seg.step_s, k)
        heap = self._heap
        while heap and heap[0][0] <= self._step + 1e-6:
            due, _, request = heapq.heappop(heap)
            if request.running and request.finish_step == due:  # else a stale entry
                self._leave(request)
                self._finish(request)

    def _at_boundary(self) -> bool:
        """Between two steps, or idle: the only time a request joins the batch, as in a real
        engine's scheduler loop (one that arrives mid-step waits for the step's end, so
        arrivals during a step join together)."""
        if not self._running:
            self._step = float(math.ceil(self._step - 1e-6))  # a new batch starts a step
            return True
        nearest = round(self._step)
        if abs(self._step - nearest) > 1e-6:
            return False
        self._step = float(nearest)  # drift of fractional steps summed
        return True

    def _free_slot(self) -> bool:
        return len(self._running) < self.config.max_running_requests

    def _admit(self) -> float:
        """Admit waiting requests into free slots (FIFO); returns their prefill seconds."""
        tokens = 0
        while self._waiting and self._free_slot():
            request = self._waiting.popleft()
            done = len(request.ids)
            if done:  # a retracted request: its prefix is rebuilt under the current weights
                request.refreshes += 1
                self.stats["refreshes"] += 1
            request.running, request.prefilled = True, False
            self._prefilling.append(request)
            request.start_step = self._step
            # The prefill samples the first token (SGLang and the embedded engine alike),
            # so the rest takes one decode step per token.
            request.finish_step = self._step + (request.target - done - 1)
            request.kv_term = request.prompt_len + done - self._step
            self._kv_base += request.kv_term
            self._running[request.rid] = request
            heapq.heappush(self._heap, (request.finish_step, next(self._order), request))
            tokens += request.prompt_len + done
        return self.timing.prefill_seconds(tokens)

    def _leave(self, request: _Request) -> None:
        """Running -> not running: materialise the tokens decoded since admission."""
        n = min(request.target - len(request.ids),
                int(self._step - request.start_step + 1e-6) + int(request.prefilled))
        if n > 0:
            self._emit(request, n)
        request.running = False
        if not request.prefilled and request in self._prefilling:  # left during its prefill
            self._prefilling.remove(request)
        self._kv_base -= request.kv_term
        del self._running[request.rid]  # its heap entry is skipped when popped (lazy delete)

    def _emit(self, request: _Request, n: int) -> None:
        rng, vocab = request.rng, self.config.vocab_size
        stop = request.params.stop_token_ids
        ids = [rng.randrange(vocab) for _ in range(n)]
        if stop:
            stops = set(stop)
            ids = [t if t not in stops else (t + 1) % vocab for t in ids]
            if len(request.ids) + n == request.target < request.params.max_new_tokens:
                ids[-1] = stop[0]  # the response ended on a stop token
        expo = rng.expovariate
        request.ids += ids
        request.logprobs += [-expo(2.0) for _ in range(n)]
        request.versions += [self._version] * n

    def _finish(self, request: _Request, reason: str | None = None) -> None:
        if reason is None:
            hit_cap = request.target >= request.params.max_new_tokens
            reason = "length" if hit_cap or not request.params.stop_token_ids else "stop"
        self.stats["aborted" if reason == "abort" else "finished"] += 1
        self._requests.pop(request.rid, None)
        if not request.future.done():
            request.future.set_result(GenerateOutput(
                request.rid, request.ids, request.logprobs, request.versions, reason,
                request.prompt_len, request.refreshes))


def synthetic_engine(cfg, index: int) -> SyntheticEngine:
    """The synthetic engine of a run config (`[synthetic]`, `sglang.max_running_requests`)."""
    s = cfg.synthetic
    return SyntheticEngine(SyntheticEngineConfig(
        max_running_requests=cfg.sglang.max_running_requests,
        timing=EngineTiming(s.prefill_tokens_per_s, s.prefill_overhead_s, s.decode_step_base_s,
                            s.decode_step_per_request_s, s.decode_step_per_kv_token_s),
        lengths=ResponseLengths(s.response_len_median, s.response_len_sigma),
        transfer=TransferTiming(s.weight_sync_bytes_per_s, s.bucket_latency_s, s.group_init_s),
        time_scale=s.time_scale, vocab_size=s.vocab_size,
        sampling_seed=cfg.run.seed * 1000 + index))
