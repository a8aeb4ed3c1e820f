"""The simulator's timing models: the `[synthetic]` section, or a real run's measurements.

Without `--calibrate`, every number comes from the run file's `[synthetic]` section, whose
defaults describe a 7-8B bf16 model on one H100/H200 with SGLang (sources in
rl_async/engine/timing.py). With `--calibrate SUMMARY_JSON` (a summary written by
`rl-async run --summary-json`), the run's `calibration` section (rl_async.calibration)
replaces what it measured:

- response lengths: lognormal(median = exp(mean log length), sigma = std of log length);
- prompt tokens: the measured mean;
- trainer seconds per sample: measured;
- the controller loop's own seconds per step (actor calls, logging) and the transport of a
  collection from the buffer (controller wait minus buffer wait): measured;
- evaluations: the measured mean seconds is a floor under each simulated evaluation (its
  generation is simulated; scoring and actor calls are not), which matters because
  training waits for an evaluation while generation runs on;
- publication: the measured bytes per publication and effective bytes/s (bucket latency 0:
  it is inside the measured transfer time), and the paused time beyond drain and transfer
  (control round trips) as a fixed overhead; the drain itself is simulated;
- decode: one operating point on a curve. The measured per-request rate rho at a mean of R
  requests in flight per engine gives a decode step of min(R, mrr) / (R x rho) at min(R, mrr)
  running requests. The curve's shape is the engines' own measured one (base + per request,
  `engines.decode_curve`) where the run had it, else the `[synthetic]` curve (base + per
  request + per KV token); it is scaled by one factor to pass through that point. Prefill and
  queueing time inside the engine are in the measurement, so they are folded into the step.
  The shape matters when a prediction changes the slots: a small model's CPU step grows
  markedly with the batch, a GPU step barely does (rl_async.engine.timing.StepCurve).

Every number carries its source in `SimTimings.sources`, printed with the prediction.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from rl_async.config import RunConfig
from rl_async.engine.timing import EngineTiming, ResponseLengths, TrainerTiming, TransferTiming
from rl_async.sim.fleet import SimTimings

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
    trainer = calibration.get("trainer") or {}
    if trainer.get("samples"):
        t = replace(t, trainer=TrainerTiming(float(trainer["seconds_per_sample"])))
        sources["trainer"] = src
    if calibration.get("controller_seconds_per_step") is not None:
        t = replace(t, controller_seconds_per_step=float(calibration["controller_seconds_per_step"]))
        sources["controller"] = src
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
            publication_overhead_s=max(0.0, overhead))
        sources["publication"] = src
    engines = calibration.get("engines") or {}
    engine = _decode_from(engines, t)
    if engine is not None:
        t = replace(t, engine=engine)
        shape = ("the engines' measured decode curve" if _curve(engines) else
                 "the [synthetic] curve's shape")
        sources["decode"] = sources["prefill"] = f"{src}, one operating point on {shape}"
    return replace(t, sources=sources)


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
