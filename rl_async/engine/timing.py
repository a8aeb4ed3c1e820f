"""Timing models of an inference engine and a trainer: pure functions of the load, no clock.

The synthetic engine and trainer (`engine.backend` / `train.backend = "synthetic"`) sleep for
what these models return; the simulator (`rl-async simulate`) advances a virtual clock by the
same numbers. Nothing here reads the wall clock or keeps state between calls, so one model
serves both clocks, and a test can check a number by hand.

Defaults (the `[synthetic]` config section repeats them) describe a 7-8B dense model in bf16 on
one H100/H200 with SGLang, from public serving benchmarks (SGLang / vLLM release notes and
the usual `bench_serving` results):

- decode: ~8 ms per step for a single request (~125 tokens/s per stream) and ~4-6k tokens/s
  at 128 running requests, i.e. step = 8 ms + 0.15 ms x running + a small attention term per
  KV token in use (2e-8 s/token: +5 ms at 128 x 2k tokens).
- prefill: ~20k prompt tokens/s plus ~5 ms per prefill batch.
- response lengths of reasoning RL: long-tailed; lognormal with median 512 tokens and sigma
  1.0 (mean ~845, p99 ~5.2k), capped at `max_response_len`.
- weight sync: ~1.5 s for 15 GB (Qwen2.5-7B bf16) over NCCL between nodes, i.e. ~10 GB/s
  effective, plus ~5 ms per bucket; 235B-class models take 20-60 s (LESSONS).
- training: ~0.05 s per sample of ~1.5k tokens for a 7B model on 8 GPUs (fwd + bwd +
  anchor scoring at ~3k tokens/s/GPU); set it from your own trainer's numbers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTiming:
    """Latency of one engine's prefill and decode steps as a function of its load."""

    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead_s: float = 0.005
    decode_step_base_s: float = 0.008
    decode_step_per_request_s: float = 0.00015
    decode_step_per_kv_token_s: float = 2e-8

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """One prefill batch of `prompt_tokens` tokens (0 tokens: no prefill, no cost)."""
        if prompt_tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + prompt_tokens / self.prefill_tokens_per_s

    def step_seconds(self, running: int, kv_tokens: int) -> float:
        """One decode step: every running request gains one token."""
        if running <= 0:
            return 0.0
        return (self.decode_step_base_s + self.decode_step_per_request_s * running
                + self.decode_step_per_kv_token_s * kv_tokens)

    def tokens_per_second(self, running: int, kv_tokens: int) -> float:
        """Decode throughput of the engine at this load (all running requests together)."""
        step = self.step_seconds(running, kv_tokens)
        return running / step if step > 0 else math.inf


@dataclass(frozen=True)
class ResponseLengths:
    """Long-tailed response lengths: lognormal(median, sigma), at least 1, capped."""

    median: float = 512.0
    sigma: float = 1.0

    def sample(self, rng: random.Random, max_len: int) -> int:
        if self.sigma == 0:
            return max(1, min(max_len, round(self.median)))
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return max(1, min(max_len, round(value)))

    def mean(self, max_len: int | None = None) -> float:
        """Uncapped mean when `max_len` is None, else a Monte-Carlo-free capped estimate."""
        if max_len is None:
            return self.median * math.exp(self.sigma ** 2 / 2)
        # E[min(X, c)] for a lognormal X, in closed form.
        if self.sigma == 0:
            return float(max(1, min(max_len, round(self.median))))
        mu, s, c = math.log(self.median), self.sigma, float(max_len)
        phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
        z = (math.log(c) - mu) / s
        return math.exp(mu + s * s / 2) * phi(z - s) + c * (1 - phi(z))


@dataclass(frozen=True)
class TransferTiming:
    """Weight publication: bytes over an effective bandwidth, plus a latency per bucket."""

    bytes_per_s: float = 10e9
    bucket_latency_s: float = 0.005
    group_init_s: float = 1.0  # joining the collective group (rendezvous + communicator)

    def bucket_seconds(self, nbytes: int) -> float:
        return self.bucket_latency_s + max(0, nbytes) / self.bytes_per_s


@dataclass(frozen=True)
class TrainerTiming:
    """Compute time of the whole trainer group for one collection."""

    seconds_per_sample: float = 0.05

    def collection_seconds(self, samples: int) -> float:
        return self.seconds_per_sample * max(0, samples)


def bucket_sizes(total_bytes: int, bucket_bytes: int) -> list[int]:
    """How a payload of `total_bytes` splits into publication buckets of at most
    `bucket_bytes` (at least one bucket, so a publication always carries the version)."""
    if total_bytes <= 0:
        return [0]
    full, rest = divmod(total_bytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


class RequestLatency:
    """Mean seconds from a request's arrival at the engine to its answer, engine side.

    The producer's own mean latency per request minus this one is the round trip outside
    the engine (actor calls, serialisation, the producer's loop): the simulator's
    `request_transit_s`. On a small model it is as long as a step (~7 ms per request with
    one CPU engine here), and it decides whether the engine idles: a request that has just
    finished is replaced only a round trip later, unless the producer keeps more requests
    queued than the engine has slots. Sums only.
    """

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.seconds += max(0.0, seconds)

    def metrics(self, prefix: str) -> dict[str, float]:
        if not self.count:
            return {}
        return {f"{prefix}/request_latency_s": self.seconds / self.count,
                f"{prefix}/requests": float(self.count)}


class StepCurve:
    """An engine's measured decode curve: least squares of step seconds against the requests
    in the step (step = base + per_request x requests), accumulated over the whole run.
    The embedded engine times a step from its start to the next one's (the compute plus its
    loop's turn between steps: answering finished requests, taking new ones), so the curve is
    the engine's wall time per step when it is kept busy.

    The simulator's calibration takes its shape from here (rl_async.sim.calibrate): a GPU
    step barely grows with the batch, a small model's CPU step markedly does (here 4.7 ms at 8
    requests, ~10 ms at 31), and one operating point cannot tell the two apart when a config
    changes the slots. The fit needs steps at several batch sizes (drains give them when
    responses vary in length). Sums only, O(1) per step.
    """

    MIN_STEPS = 20

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.lo, self.hi = math.inf, 0

    def observe(self, requests: int, seconds: float, weight: float = 1.0) -> None:
        """`weight` steps of `seconds` each with `requests` requests in them."""
        if requests <= 0 or weight <= 0 or seconds < 0:
            return
        self.n += weight
        self.sx += weight * requests
        self.sy += weight * seconds
        self.sxx += weight * requests * requests
        self.sxy += weight * requests * seconds
        self.lo, self.hi = min(self.lo, requests), max(self.hi, requests)

    def fit(self) -> tuple[float, float] | None:
        """(base_s, per_request_s), or None with too few steps or one batch size only. A
        negative coefficient (noise) is clamped to 0 with the line refitted through the mean."""
        if self.n < self.MIN_STEPS or self.hi <= self.lo:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 0:
            return None
        slope = (self.sxy / self.n - mx * my) / var
        if slope < 0:
            return my, 0.0
        base = my - slope * mx
        if base < 0:
            return 0.0, my / mx
        return base, slope

    def metrics(self, prefix: str) -> dict[str, float]:
        fit = self.fit()
        if fit is None:
            return {}
        return {f"{prefix}/step_base_s": fit[0], f"{prefix}/step_per_request_s": fit[1],
                f"{prefix}/step_requests_mean": self.sx / self.n}
