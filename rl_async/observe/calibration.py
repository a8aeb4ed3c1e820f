"""What a real run measures for the simulator: the summary's `calibration` section.

The controller already sees everything the simulator's timing models need, so it records it
while it runs (no extra actor calls):

- response lengths of delivered samples: count, mean, quantiles, and the mean / sigma of
  log length (the lognormal the simulator draws from);
- prompt tokens per sample (prefill work);
- trainer seconds per trained sample (the whole trainer group's time for a collection);
- the controller loop's own serial seconds per optimizer step (actor round trips, logging:
  what the simulated fleet otherwise takes as free), the fleet's metrics gather (beside
  the publication), and the collection's transport: the controller's wait for a collection
  minus the buffer's own wait for its groups;
- publications: mean seconds, snapshot, drain and transfer seconds, the first control
  call's round trip, bytes, effective bytes/s, and the controller's wait for them per step;
- evaluations: count and mean seconds (training waits for each: generation runs on, and
  the buffer fills, for that long);
- engines: the producer's cumulative generated tokens and generation seconds (time inside
  generate calls, summed over requests) and the time any request was outstanding. The first
  two give the per-request token rate; generation seconds over busy seconds and engines, the
  mean requests in flight per engine while generating. With
  `max_running_requests` that gives one operating point of the decode curve (see
  rl_async.sim.calibrate);
- the engines' own decode curve where they measure it (embedded and synthetic engines:
  step seconds = base + per request x requests in the step, least squares over the run,
  mean over engines; rl_async.engine.timing.StepCurve), which gives the curve's shape;
- multi-turn runs (SPEC §12): turns per trajectory, the environment's tokens between turns
  and its seconds per turn; response lengths are then per assistant turn (sampled tokens over
  turns), as each turn is one generate call;
- the producer's mean seconds per generate call, prompt fetch and reward call (a sample's
  permit is held through all three), and a request's mean seconds inside the engine
  (arrival to answer, rl_async.engine.timing.RequestLatency): the difference between the two
  generate latencies is the round trip outside the engine.

Reading it back is rl_async.sim.calibrate's job; this module only observes.
"""

from __future__ import annotations

import math
from typing import Any

from rl_async.base.types import Group

BUFFER_WAIT = "rollout/fully_async/completed_queue/consumer_wait_seconds"
CURVE_KEYS = ("engines/step_base_s_mean", "engines/step_per_request_s_mean",
              "engines/step_requests_mean_mean")
ENGINE_LATENCY = "engines/request_latency_s_mean"
MAX_LENGTHS = 20_000  # lengths kept for quantiles (the first ones; the log moments use all)


def _per(total: float | None, count: float | None) -> float | None:
    return total / count if total is not None and count else None


def _quantile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[i])


class CalibrationStats:
    def __init__(self) -> None:
        self.n = 0
        self.len_sum = 0
        self.log_sum = 0.0
        self.log_sq = 0.0
        self.prompt_sum = 0
        self.lengths: list[int] = []
        self.train_seconds = 0.0
        self.train_samples = 0
        self.collections = 0
        self.pubs = 0
        self.pub = dict.fromkeys(("publication_seconds", "drain_seconds", "transfer_seconds",
                                  "paused_seconds", "bytes", "snapshot_seconds",
                                  "control_seconds"), 0.0)
        self.metrics_gather = 0.0  # the fleet's metrics gather, per collection
        self.pub_wait = 0.0  # the controller's wait for publications (snapshot, previous one)
        self.generated_tokens = 0.0
        self.generation_seconds = 0.0
        self.generation_busy_seconds = 0.0
        self.producer: dict[str, float] = {}  # its cumulative counters (latest wins)
        self.engine_latency: float | None = None  # arrival to answer, engine side (mean)
        self.controller_seconds = 0.0   # the loop's own time (actor calls, logging) per step
        self.controller_samples = 0
        # The controller's wait for collections vs the buffer's own wait for groups: the
        # difference is the get's transport (actor round trip, moving the groups).
        self.trainer_wait = 0.0
        self.buffer_wait: float | None = None
        self.step_curve: dict[str, float] | None = None  # the latest engines' fit
        self.evals = 0
        self.eval_seconds = 0.0
        self.trajectories = 0        # multi-turn samples trained
        self.turn_sum = 0
        self.env_token_sum = 0       # masked (environment) tokens between turns

    def observe_eval(self, seconds: float) -> None:
        self.evals += 1
        self.eval_seconds += seconds

    def observe_collection(self, groups: list[Group], train_seconds: float) -> None:
        for g in groups:
            for s in g.samples:
                n = len(s.response_ids)
                if s.turns > 0:  # a trajectory: one length per turn (a generate call each)
                    sampled = sum(s.loss_mask) if s.loss_mask else n
                    self.trajectories += 1
                    self.turn_sum += s.turns
                    self.env_token_sum += n - sampled
                    n = round(sampled / s.turns)
                self.n += 1
                self.len_sum += n
                self.prompt_sum += len(s.prompt_ids)
                if n > 0:
                    self.log_sum += math.log(n)
                    self.log_sq += math.log(n) ** 2
                if len(self.lengths) < MAX_LENGTHS:
                    self.lengths.append(n)
            self.train_samples += g.size
        self.train_seconds += train_seconds
        self.collections += 1

    def observe_metrics(self, metrics: dict[str, float]) -> None:
        """One collection's logged metrics: publication results (when one finished) and the
        producer's cumulative counters (the latest values win)."""
        self.trainer_wait += float(metrics.get("train/trainer_wait_seconds", 0.0))
        if BUFFER_WAIT in metrics:
            self.buffer_wait = (self.buffer_wait or 0.0) + float(metrics[BUFFER_WAIT])
        if "perf/orchestration_seconds_per_step" in metrics:
            # The loop's own serial time: the metrics gather runs beside the publication,
            # so only what the loop waited for it beyond the publication is in `own`.
            self.controller_seconds += max(0.0, float(
                metrics["perf/orchestration_seconds_per_step"])
                - float(metrics.get("perf/metrics_wait_seconds_per_step", 0.0)))
            self.metrics_gather += float(metrics.get("perf/metrics_gather_seconds", 0.0))
            self.pub_wait += float(metrics.get("perf/publication_wait_seconds_per_step", 0.0))
            self.controller_samples += 1
        if "publish/publication_seconds" in metrics:
            self.pubs += 1
            for key in self.pub:
                self.pub[key] += float(metrics.get(f"publish/{key}", 0.0))
        if CURVE_KEYS[0] in metrics:  # cumulative fits: the latest wins
            self.step_curve = {name: float(metrics[key]) for name, key in
                               zip(("base_s", "per_request_s", "requests_mean"), CURVE_KEYS)}
        if ENGINE_LATENCY in metrics:
            self.engine_latency = float(metrics[ENGINE_LATENCY])
        if "producer/generation_seconds" in metrics:
            self.generation_seconds = float(metrics["producer/generation_seconds"])
            self.generated_tokens = float(metrics.get("producer/generated_tokens", 0.0))
            self.producer = {k: float(metrics.get(f"producer/{k}", 0.0)) for k in (
                "submitted_samples", "fetch_seconds", "fetches", "score_seconds",
                "scored_samples", "transit_seconds", "transit_samples", "env_seconds",
                "turns")}
            self.generation_busy_seconds = float(
                metrics.get("producer/generation_busy_seconds", 0.0))

    def to_dict(self, wall_seconds: float, engines: int, max_running_requests: int,
                max_response_len: int, producer_samples: int | None = None) -> dict[str, Any]:
        lengths = sorted(self.lengths)
        log_mean = self.log_sum / self.n if self.n else 0.0
        log_var = self.log_sq / self.n - log_mean ** 2 if self.n else 0.0
        pubs = max(1, self.pubs)
        transfer = self.pub["transfer_seconds"] / pubs
        nbytes = self.pub["bytes"] / pubs
        # While generating (not over the wall time: publication pauses and evaluations
        # would read as light load).
        busy = self.generation_busy_seconds or wall_seconds
        in_flight = self.generation_seconds / (busy * engines) if busy > 0 and engines else 0.0
        p = self.producer
        return {
            "source": "rl-async run: the controller's observations of this run",
            "response_length": {
                "samples": self.n, "mean": self.len_sum / max(1, self.n),
                "log_mean": log_mean, "log_sigma": math.sqrt(max(0.0, log_var)),
                "p50": _quantile(lengths, 0.5), "p90": _quantile(lengths, 0.9),
                "p99": _quantile(lengths, 0.99), "max": float(lengths[-1]) if lengths else 0.0,
                "capped_fraction": (sum(1 for n in lengths if n >= max_response_len)
                                    / max(1, len(lengths))),
                "max_response_len": max_response_len},
            "prompt_tokens_mean": self.prompt_sum / max(1, self.n),
            "trainer": {"seconds_per_sample": self.train_seconds / max(1, self.train_samples),
                        "collections": self.collections, "samples": self.train_samples},
            "controller_seconds_per_step": (self.controller_seconds
                                            / max(1, self.controller_samples)),
            "metrics_gather_seconds": self.metrics_gather / max(1, self.controller_samples),
            "collection_transport_seconds": (
                None if self.buffer_wait is None
                else max(0.0, self.trainer_wait - self.buffer_wait) / max(1, self.collections)),
            "publication": {"count": self.pubs,
                            "mean_seconds": self.pub["publication_seconds"] / pubs,
                            "mean_drain_seconds": self.pub["drain_seconds"] / pubs,
                            "mean_transfer_seconds": transfer,
                            "mean_paused_seconds": self.pub["paused_seconds"] / pubs,
                            "mean_snapshot_seconds": self.pub["snapshot_seconds"] / pubs,
                            "mean_control_seconds": self.pub["control_seconds"] / pubs,
                            "controller_wait_seconds_per_step": (
                                self.pub_wait / max(1, self.controller_samples)),
                            "bytes": nbytes,
                            "bytes_per_s": nbytes / transfer if transfer > 0 else None},
            "eval": {"count": self.evals,
                     "mean_seconds": self.eval_seconds / self.evals if self.evals else None},
            "engines": {"count": engines, "max_running_requests": max_running_requests,
                        "generated_tokens": self.generated_tokens,
                        "generation_seconds": self.generation_seconds,
                        "generation_busy_seconds": self.generation_busy_seconds,
                        "per_request_tokens_per_s": (self.generated_tokens / self.generation_seconds
                                                     if self.generation_seconds > 0 else None),
                        "mean_in_flight_per_engine": in_flight,
                        "decode_curve": self.step_curve,
                        "request_latency_s": self.engine_latency},
            "turns": None if not self.trajectories else {
                "trajectories": self.trajectories,
                "turns_mean": self.turn_sum / self.trajectories,
                # between consecutive turns: (turns - 1) gaps per trajectory
                "env_tokens_per_gap": self.env_token_sum / max(1, self.turn_sum
                                                               - self.trajectories),
                "env_seconds_per_turn": _per(p.get("env_seconds"), p.get("turns")) or 0.0},
            "producer": {  # mean seconds per call, as the producer saw them, at this budget
                "budget_samples": producer_samples,
                "request_latency_s": _per(self.generation_seconds, p.get("submitted_samples")),
                "fetch_latency_s": _per(p.get("fetch_seconds"), p.get("fetches")),
                "score_latency_s": _per(p.get("score_seconds"), p.get("scored_samples")),
                # per rollout request, outside the engine (engines that time themselves)
                "transit_latency_s": _per(p.get("transit_seconds"), p.get("transit_samples"))},
        }
