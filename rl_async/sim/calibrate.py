"""The simulator's timing models: the `[synthetic]` section, or a real run's measurements.

Without `--calibrate`, every number comes from the run file's `[synthetic]` section, whose
defaults describe a 7-8B bf16 model on one H100/H200 with SGLang (sources in
rl_async/engine/timing.py). With `--calibrate SUMMARY_JSON` (a summary written by
`rl-async run --summary-json`), the run's `calibration` section (rl_async.observe.calibration)
replaces what it measured:

- response lengths: lognormal(median = exp(mean log length), sigma = std of log length);
- prompt tokens: the measured mean;
- trainer seconds per sample: measured;
- the controller loop's own serial seconds per step (actor calls, logging; not the metrics
  gather, which runs beside the publication) and the transport of a collection from the
  buffer (controller wait minus buffer wait): measured;
- evaluations: the measured mean seconds is a floor under each simulated evaluation (its
  generation is simulated; scoring and actor calls are not), which matters because
  training waits for an evaluation while generation runs on;
- publication: the measured bytes per publication and effective bytes/s (bucket latency 0:
  it is inside the measured transfer time), the trainer's snapshot, one control call's
  round trip (the first one: stop submissions, or the retracting pause), which each of the
  simulated control calls (stop, drain, pause, the buffer's new version) then costs, and the
  paused time beyond drain and transfer (continue, resume) as a fixed overhead; the drain's
  wait itself is simulated; the fleet's metrics gather, which runs beside the publication;
- the producer's round trips: prompt fetch and reward call (a sample's permit is held
  through both) and, for engines that time their own requests (embedded, synthetic), a
  generate call's transit outside the engine (producer latency minus engine latency). They
  share the actors' event loops with every request in flight, so a config with a smaller
  producer budget than the calibration run scales them down by the budget ratio (measured on
  the local demo: a generate call's transit 2.5 ms with a 16-sample budget, 9.8 ms with 64,
  9.7-10 ms with 128), and a larger one keeps them;
- decode, for engines that time their own steps and requests (the embedded engine): the
  engines' step curve as measured (wall seconds per step from one step's start to the
  next's, base + per request; prefill rides in the step, so the simulated prefill is free),
  no operating point needed: the transit above and the real producer decide how busy the
  engine is;
- decode otherwise (SGLang: the producer's view only): one operating point on a curve. The
  measured per-request rate rho at a mean of R requests in flight per engine gives a decode
  step of min(R, mrr) / (R x rho) at min(R, mrr) running requests. The curve's shape is the
  engines' own measured one (base + per request, `engines.decode_curve`) where the run had
  it, else the `[synthetic]` curve (base + per request + per KV token); it is scaled by one
  factor to pass through that point. Prefill and queueing time inside the engine are in the
  measurement, so they are folded into the step. The shape matters when a prediction
  changes the slots: a small model's CPU step grows markedly with the batch, a GPU step
  barely does (rl_async.engine.timing.StepCurve).

Every number carries its source in `SimTimings.sources`, printed with the prediction.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from rl_async.plan.capacity import plan_capacity
from rl_async.plan.config import RunConfig
from rl_async.engine.timing import EngineTiming, ResponseLengths, TrainerTiming, TransferTiming
from rl_async.sim.timings import SimTimings, TurnTiming

SYNTHETIC = "[synthetic] defaults (7-8B bf16, H100/H200, SGLang; rl_async/engine/timing.py)"


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message says why and what to pass."""


def load_calibration(path: str) -> dict[str, Any]:
    """The `calibration` section of a run summary (`rl-async run --summary-json PATH`)."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"--calibrate {path}: cannot read a JSON summary ({exc}); pass "
                               f"the file written by `rl-async run FILE --summary-json PATH`")
    cal = summary.get("calibration") if isinstance(summary, dict) else None
    if not isinstance(cal, dict):
        raise CalibrationError(f"--calibrate {path}: the summary has no `calibration` section "
                               f"(written by runs since issue 14); run again with --summary-json")
    return cal


def _synthetic(cfg: RunConfig, label: str) -> tuple[SimTimings, dict[str, str]]:
    s = cfg.synthetic
    timings = SimTimings(
        engine=EngineTiming(s.prefill_tokens_per_s, s.prefill_overhead_s, s.decode_step_base_s,
                            s.decode_step_per_request_s, s.decode_step_per_kv_token_s),
        lengths=ResponseLengths(s.response_len_median, s.response_len_sigma),
        transfer=TransferTiming(s.weight_sync_bytes_per_s, s.bucket_latency_s, s.group_init_s),
        trainer=TrainerTiming(s.train_seconds_per_sample),
        publish_bytes=s.publish_bytes, prompt_tokens=s.prompt_tokens)
    keys = ("decode", "prefill", "response_lengths", "prompt_tokens", "trainer", "publication")
    sources = dict.fromkeys(keys, label)
    sources["controller"] = "not modelled (0 s per step; --calibrate measures it)"
    sources["collection_transport"] = "not modelled (0 s; --calibrate measures it)"
    sources["eval"] = "simulated generation only (--calibrate measures the whole evaluation)"
    sources["producer_calls"] = "not modelled (0 s; --calibrate measures them)"
    sources["transit"] = "not modelled (0 s; --calibrate on an embedded-engine run measures it)"
    sources["turns"] = ("one generate call per sample" + (
        ": a multi-turn environment's turns need --calibrate from one of its runs"
        if cfg.task.name in ("env", "verifiers") else ""))
    return timings, sources


def sim_timings(cfg: RunConfig, calibration: dict[str, Any] | None = None,
                calibration_path: str = "calibration") -> SimTimings:
    """Timing models for `cfg`: [synthetic] values, overridden by what `calibration` measured."""
    explicit = cfg.synthetic.model_fields_set
    label = SYNTHETIC if not explicit else f"{SYNTHETIC}, with the run file's [synthetic] values"
    t, sources = _synthetic(cfg, label)
    if calibration is None:
        return replace(t, sources=sources)
    src = f"measured ({calibration_path})"
    lengths = calibration.get("response_length") or {}
    if lengths.get("samples"):
        t = replace(t, lengths=ResponseLengths(max(1.0, math.exp(lengths["log_mean"])),
                                               float(lengths["log_sigma"])))
        sources["response_lengths"] = src
        if calibration.get("prompt_tokens_mean"):
            t = replace(t, prompt_tokens=max(1, round(calibration["prompt_tokens_mean"])))
            sources["prompt_tokens"] = src
    turns = calibration.get("turns") or {}
    if turns.get("trajectories"):
        t = replace(t, turns=TurnTiming(float(turns["turns_mean"]),
                                        float(turns["env_tokens_per_gap"]),
                                        float(turns["env_seconds_per_turn"])))
        sources["turns"] = src + " (turns, environment tokens and seconds per turn)"
    trainer = calibration.get("trainer") or {}
    if trainer.get("samples"):
        t = replace(t, trainer=TrainerTiming(float(trainer["seconds_per_sample"])))
        sources["trainer"] = src
    if calibration.get("controller_seconds_per_step") is not None:
        t = replace(t, controller_seconds_per_step=float(calibration["controller_seconds_per_step"]))
        sources["controller"] = src
    if calibration.get("metrics_gather_seconds"):
        t = replace(t, metrics_gather_s=float(calibration["metrics_gather_seconds"]))
    if calibration.get("collection_transport_seconds") is not None:
        t = replace(t, collection_transport_s=float(calibration["collection_transport_seconds"]))
        sources["collection_transport"] = src
    ev = calibration.get("eval") or {}
    if ev.get("count") and ev.get("mean_seconds") is not None:
        t = replace(t, eval_seconds=float(ev["mean_seconds"]))
        sources["eval"] = src + ", a floor under the simulated evaluation"
    pub = calibration.get("publication") or {}
    if pub.get("count") and pub.get("bytes_per_s"):
        overhead = (pub.get("mean_paused_seconds", 0.0) - pub.get("mean_drain_seconds", 0.0)
                    - pub.get("mean_transfer_seconds", 0.0))
        t = replace(t, publish_bytes=int(pub["bytes"]), transfer=TransferTiming(
            float(pub["bytes_per_s"]), 0.0, t.transfer.group_init_s),
            publication_overhead_s=max(0.0, overhead),
            snapshot_s=float(pub.get("mean_snapshot_seconds") or 0.0),
            control_call_s=float(pub.get("mean_control_seconds") or 0.0))
        sources["publication"] = src
    engines = calibration.get("engines") or {}
    producer = calibration.get("producer") or {}
    t = _round_trips(t, cfg, engines, producer, src, sources)
    direct = _measured_engine(engines, producer)
    if direct is not None:
        t = replace(t, engine=direct)
        sources["decode"] = sources["prefill"] = (
            f"{src}, the engines' step curve (wall seconds per step, prefill inside)")
        return replace(t, sources=sources)
    engine = _decode_from(engines, t)
    if engine is not None:
        t = replace(t, engine=engine)
        shape = ("the engines' measured decode curve" if _curve(engines) else
                 "the [synthetic] curve's shape")
        sources["decode"] = sources["prefill"] = f"{src}, one operating point on {shape}"
    return replace(t, sources=sources)


def _transit(e: dict[str, Any], producer: dict[str, Any]) -> float | None:
    """A generate call's round trip outside the engine, per rollout request (the producer's
    latency minus the engine's own, request by request); from summaries that predate that
    field, the difference of the two means (which mixes in the evaluations' requests at the
    engine). None where the engines do not time themselves (SGLang)."""
    if producer.get("transit_latency_s") is not None:
        return max(0.0, float(producer["transit_latency_s"]))
    inside, outside = e.get("request_latency_s"), producer.get("request_latency_s")
    return max(0.0, float(outside) - float(inside)) if inside and outside else None


def _round_trips(t: SimTimings, cfg: RunConfig, e: dict[str, Any], producer: dict[str, Any],
                 src: str, sources: dict[str, str]) -> SimTimings:
    """The producer's actor round trips (prompt fetch, reward call, a generate call's
    transit), measured at the calibration run's producer budget. They run on event loops
    that every request in flight shares: on the local demo a generate call's transit took
    2.5 ms with a 16-sample budget, 9.8 ms with 64 and 9.7-10 ms with 128 (the extra
    requests wait inside the engine, where they cost no round trips). So a config with a
    smaller budget scales them down by the budget ratio; a larger one keeps them."""
    budget = producer.get("budget_samples")
    scale = min(1.0, plan_capacity(cfg)[0].producer_samples / budget) if budget else 1.0
    note = f", x{scale:.2f} for the producer budget" if scale < 1 else ""
    for key in ("fetch_latency_s", "score_latency_s"):
        if producer.get(key) is not None:
            t = replace(t, **{key: float(producer[key]) * scale})
            sources["producer_calls"] = f"{src}, prompt fetch and reward call latency{note}"
    transit = _transit(e, producer)
    if transit is not None and _curve(e) is not None:  # only with the engine's own costs
        t = replace(t, request_transit_s=transit * scale)
        sources["transit"] = f"{src}, producer latency minus engine latency per request{note}"
    return t


def _measured_engine(e: dict[str, Any], producer: dict[str, Any]) -> EngineTiming | None:
    """The engines' own step curve, where the run measured it and the round trip outside
    them (embedded engines): no operating point needed, so a config that keeps the engine
    busier or idler than the calibration run is predicted from the engine's own cost."""
    curve = _curve(e)
    if curve is None or _transit(e, producer) is None:
        return None
    return EngineTiming(prefill_tokens_per_s=math.inf, prefill_overhead_s=0.0,
                        decode_step_base_s=curve[0], decode_step_per_request_s=curve[1],
                        decode_step_per_kv_token_s=0.0)


def _decode_from(e: dict[str, Any], t: SimTimings) -> EngineTiming | None:
    rho, in_flight = e.get("per_request_tokens_per_s"), e.get("mean_in_flight_per_engine")
    mrr = e.get("max_running_requests")
    if not (rho and in_flight and mrr) or rho <= 0 or in_flight <= 0:
        return None
    running = min(in_flight, float(mrr))
    step = running / (in_flight * rho)
    curve = _curve(e)
    if curve is not None:  # the measured shape; KV growth is inside its per-request term
        t = replace(t, engine=EngineTiming(decode_step_base_s=curve[0],
                                           decode_step_per_request_s=curve[1],
                                           decode_step_per_kv_token_s=0.0))
    mean_len = t.lengths.mean()
    kv = int(running * (t.prompt_tokens + mean_len / 2))
    model = t.engine.step_seconds(max(1, round(running)), kv)
    factor = step / model if model > 0 else 1.0
    # Prefill folded into the measured step: the curve below already includes it.
    return EngineTiming(prefill_tokens_per_s=math.inf, prefill_overhead_s=0.0,
                        decode_step_base_s=t.engine.decode_step_base_s * factor,
                        decode_step_per_request_s=t.engine.decode_step_per_request_s * factor,
                        decode_step_per_kv_token_s=t.engine.decode_step_per_kv_token_s * factor)


def _curve(e: dict[str, Any]) -> tuple[float, float] | None:
    c = e.get("decode_curve")
    if not isinstance(c, dict):
        return None
    base, per = float(c.get("base_s") or 0.0), float(c.get("per_request_s") or 0.0)
    return (base, per) if base >= 0 and per >= 0 and base + per > 0 else None
