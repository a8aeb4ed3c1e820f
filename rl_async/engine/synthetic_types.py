"""The synthetic engine's data: its config, a request's and a segment's state, and the
publication payload's size and digest (shared with the synthetic trainer, which computes the
same digest). rl_async.engine.synthetic is the engine itself."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from dataclasses import dataclass, field

from rl_async.engine.base import InvalidRequestError, SamplingParams
from rl_async.engine.timing import EngineTiming, ResponseLengths, TransferTiming

DTYPE_BYTES = {"uint8": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "bfloat16": 2, "float16": 2, "int16": 2, "float32": 4, "int32": 4,
               "float64": 8, "int64": 8}


def payload_nbytes(dtypes: list[str], shapes: list[list[int]]) -> int:
    total = 0
    for dtype, shape in zip(dtypes, shapes):
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise InvalidRequestError(f"update_weights_from_distributed: dtype {dtype!r} unknown; "
                                      f"use one of {sorted(DTYPE_BYTES)}")
        total += DTYPE_BYTES[name] * math.prod(shape)
    return total


def payload_checksum(names: list[str], nbytes: int) -> str:
    """Digest of one whole publication (every bucket's names, total bytes)."""
    return hashlib.sha256(("\n".join(names) + f"\n{nbytes}").encode()).hexdigest()


@dataclass
class SyntheticEngineConfig:
    max_running_requests: int = 32
    timing: EngineTiming = field(default_factory=EngineTiming)
    lengths: ResponseLengths = field(default_factory=ResponseLengths)
    transfer: TransferTiming = field(default_factory=TransferTiming)
    time_scale: float = 1.0  # 1 = real time, 0 = instant
    vocab_size: int = 32_000
    sampling_seed: int = 0

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"sglang.max_running_requests = {self.max_running_requests!r}: "
                             f"must be >= 1")
        if self.time_scale < 0:
            raise ValueError(f"synthetic.time_scale = {self.time_scale!r}: must be >= 0")


@dataclass(eq=False)
class _Request:
    rid: str
    prompt_len: int
    params: SamplingParams
    rng: random.Random
    target: int                  # response length, drawn at arrival
    future: asyncio.Future
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    running: bool = False
    start_step: float = 0.0      # engine step at (re-)admission
    finish_step: float = 0.0
    kv_term: float = 0.0         # this request's share of _kv_base while running
    prefilled: bool = False      # its prefill (which samples its first token) is done
    refreshes: int = 0


@dataclass
class _Segment:
    """The interval since the last event: its prefill left and decode steps to the next finish."""

    t0: float
    prefill_left: float
    step_s: float
    steps_left: float
