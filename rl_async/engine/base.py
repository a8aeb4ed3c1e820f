"""The one engine interface (SPEC §10), shaped after SGLang's server API.

Both backends (the embedded torch engine and the SGLang HTTP client) implement `Engine`, so the
controller and the producer drive either without knowing which. Every method is async: an
engine serves many concurrent `generate` calls from one event loop.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

from rl_async.base.types import RoutedExperts


class EngineError(RuntimeError):
    """An engine refused or failed a request; the message names the request and the cause."""


class TransientEngineError(EngineError):
    """The request did not complete for reasons that say nothing about it (a reset
    connection, an HTTP 5xx, a timeout, an engine that died): regenerate it
    (rl_async.loop.faults says who decides what)."""


class InvalidRequestError(EngineError):
    """Bad input (empty or over-long prompt, invalid sampling params). The engine keeps serving."""


PAUSE_MODES = ("abort", "retract", "in_place")


def check_request(input_ids, params) -> None:
    """The checks every backend makes on a request before queueing it."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling_params = {params!r}: must be a SamplingParams")
    params.validate()
    if not isinstance(input_ids, (list, tuple)) or not input_ids:
        raise InvalidRequestError(f"input_ids = {input_ids!r}: must be a non-empty list "
                                  "of token ids")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. `validate()` raises `InvalidRequestError` naming the field."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"sampling_params.max_new_tokens = {self.max_new_tokens!r}: must be an int >= 1"
            )
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidRequestError(
                f"sampling_params.temperature = {self.temperature!r}: must be a finite number >= 0 "
                f"(0 = greedy)"
            )
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"sampling_params.top_p = {self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise InvalidRequestError(
                f"sampling_params.top_k = {self.top_k!r}: must be -1 (off) or an int >= 1"
            )


@dataclass
class GenerateOutput:
    """One finished request: the sampled tokens, their log-probs and their weight versions."""

    request_id: str
    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    # "stop" (a stop token was sampled), "length" (max_new_tokens), "abort".
    finish_reason: str
    prompt_len: int = 0
    # Number of times this request's prefix was rebuilt under new weights (mixed_policy refresh).
    refreshes: int = 0
    # Seconds from the request's arrival at the engine to its answer, where the engine times
    # it (embedded, synthetic; None: SGLang). The caller's own latency minus this is the
    # round trip outside the engine (the simulator's calibration).
    engine_seconds: float | None = None
    # The experts chosen at every fed position (prompt + output[:-1]), where the engine
    # records them (MoE models with train.routing_replay on); rl_async.base.types.
    routed_experts: RoutedExperts | None = None

    def check(self, where: str) -> None:
        """A reply the trainer can use: one log-prob and one version per token, and every
        log-prob finite. A malformed reply fails its request (and so its group)
        here, naming `where`, instead of reaching an optimizer step: one NaN behaviour
        log-prob made the whole step's update non-finite, and the step was skipped."""
        n = len(self.output_ids)
        if not (n == len(self.output_logprobs) == len(self.token_versions)):
            raise EngineError(f"engine reply for {where} is malformed: {n} tokens, "
                              f"{len(self.output_logprobs)} log-probs, "
                              f"{len(self.token_versions)} versions")
        bad = next((i for i, lp in enumerate(self.output_logprobs)
                    if not math.isfinite(lp)), None)
        if bad is not None:
            raise EngineError(f"engine reply for {where} is malformed: log-prob "
                              f"{self.output_logprobs[bad]!r} at token {bad} (token id "
                              f"{self.output_ids[bad]}); log-probs must be finite")
        routed = self.routed_experts
        if routed is not None and n and routed.positions != self.prompt_len + n - 1:
            raise EngineError(f"engine reply for {where} is malformed: routed experts for "
                              f"{routed.positions} positions; a prompt of {self.prompt_len} "
                              f"and {n} output tokens feed {self.prompt_len + n - 1}")


@dataclass
class EngineLoad:
    """Load statistics an engine reports to the router and the dashboard."""

    running: int = 0
    waiting: int = 0
    tokens_in_use: int = 0
    token_capacity: int = 0
    max_running_requests: int = 0
    weight_version: int = 0
    extra: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """The engine interface. Implementations: `EmbeddedEngine`, `SGLangEngine`."""

    @abc.abstractmethod
    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerateOutput: ...

    async def generate_batch(self, requests: list[tuple]):
        """Many requests in one call (one actor call per batch): an async iterator of
        `[(index, GenerateOutput | EngineError), ...]` lists as requests finish. A request is
        (input_ids, sampling_params) or (input_ids, sampling_params, request_id): a caller
        that names it can `abort` it later. A request's own error is yielded as its value;
        closing the iterator early aborts the rest."""
        from rl_async.base.batching import as_finished  # no cycle: batching has no engine imports

        calls = [self.generate(*request) for request in requests]
        async for finished in as_finished(calls, forward=(EngineError,)):
            yield finished

    @abc.abstractmethod
    async def abort(self, request_id: str | None = None) -> int:
        """Abort one request (or all when None). Returns how many were aborted."""

    @abc.abstractmethod
    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating. `abort`: abort everything in flight. `retract`: running requests go
        back to waiting; on resume their prefix is rebuilt under the then-current weights
        without resampling. `in_place`: running requests freeze with their KV caches."""

    @abc.abstractmethod
    async def continue_generation(self) -> None: ...

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    @abc.abstractmethod
    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str, timeout_s: float | None = None
                                        ) -> None:
        """Join publication channel `group_name` (trainer rank 0 hosts it at
        master_address:master_port). `timeout_s` bounds the rendezvous and, where the
        backend allows, every receive on it."""

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    @abc.abstractmethod
    def weight_update_groups(self) -> list[str]:
        """The channels this engine has joined and not destroyed."""

    @abc.abstractmethod
    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              weight_version: int | None = None, *,
                                              flush_cache: bool | None = None) -> None:
        """One bucket over channel `group_name`; the call carrying `weight_version` is the
        last. `flush_cache` (None: on the last bucket) drops the prefix cache after it."""

    # Whether the engine can receive a publication while it generates and switch to it at
    # once (stage_weights / commit_weights). Without it, a publication loads in place with
    # the engine paused (update_weights_from_distributed, bucket by bucket).
    stages_weights = False

    async def stage_weights(self, buckets: list[tuple], group_name: str, version: int,
                            fingerprints: list[str], digest: str) -> dict:
        """Receive every bucket of a publication into a staging buffer while generating,
        check each bucket's fingerprint and the whole model's digest; returns {"verified",
        "error", "digest", "receive_seconds", "load_seconds"} (rl_async/engine/
        embedded_weights.py)."""
        raise EngineError(f"{type(self).__name__} cannot stage weights (stages_weights is "
                          f"False): publish with update_weights_from_distributed")

    async def commit_weights(self, version: int) -> dict:
        """Switch to the verified staged `version` between two steps; {"pause_seconds"}."""
        raise EngineError(f"{type(self).__name__} cannot stage weights (stages_weights is "
                          f"False): publish with update_weights_from_distributed")

    async def weights_checksum(self) -> str:
        raise EngineError(f"{type(self).__name__} cannot report a checksum of the weights it "
                          f"serves; publication.verify_checksum = true needs engine.backend = "
                          f"'embedded' (rl-async validate refuses the combination)")

    @abc.abstractmethod
    async def update_weights_from_tensor(self, named_tensors: list, weight_version: int | None = None
                                         ) -> None: ...

    @abc.abstractmethod
    async def get_weight_version(self) -> int: ...

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...
