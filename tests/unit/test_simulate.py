"""The simulator: the virtual clock, the simulated fleet of the real core, calibration, CLI."""

import asyncio
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rl_async.observe.calibration import CalibrationStats
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config
from rl_async.sim.calibrate import SYNTHETIC, sim_timings
from rl_async.sim.run import simulate
from rl_async.sim.virtual_loop import SimulationDeadlock, VirtualClockLoop, run_virtual
from rl_async.base.types import Group, Sample

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "cluster_configs" / "local.toml"
DEV = ROOT / "cluster_configs" / "dev.toml"
# Small but realistic: 2 engines of 16 slots, responses of up to 512 tokens, default timings.
SMALL = ("cluster.cpu_engines=2", "sglang.max_running_requests=16", "rollout.rollout_batch_size=4",
         "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
         "rollout.max_response_len=512", "task.num_eval_prompts=8")


def predict(path, *overrides, steps=6, calibration=None):
    cfg = load_config(path, overrides)
    return simulate(cfg, plan_capacity(cfg)[0], sim_timings(cfg, calibration), steps)


# ---- the virtual clock ------------------------------------------------------------------------
def test_virtual_clock_jumps_to_timers_and_keeps_asyncio_semantics():
    async def main():
        loop = asyncio.get_running_loop()
        assert loop.time() == 0.0

        async def sleeper(d):
            await asyncio.sleep(d)
            return loop.time()

        times = await asyncio.gather(sleeper(3600), sleeper(5), sleeper(0.25))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 10)
        return times, loop.time()

    times, end = run_virtual(main())
    assert times == [3600, 5, 0.25]
    assert end == 3610


def test_virtual_clock_reports_a_deadlock_instead_of_hanging():
    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(SimulationDeadlock, match="no timer is scheduled"):
        run_virtual(stuck())


# ---- the simulated fleet -----------------------------------------------------------------------
def test_sync_mode_has_zero_staleness_and_no_discards():
    p = predict(DEV, *SMALL)
    assert p["simulated_steps"] == 6
    assert p["mean_staleness"] == 0 and p["max_staleness"] == 0
    assert p["dropped_samples_fraction"] == 0 and p["discarded_groups_fraction"] == 0
    assert p["ledger"]["delivered_groups"] == 6 * 4


def test_generation_bound_config_predicts_high_trainer_wait():
    # One engine slot per engine and an instant trainer: generation is all there is.
    gen_bound = predict(LOCAL, *SMALL, "sglang.max_running_requests=1",
                        "synthetic.train_seconds_per_sample=0")
    train_bound = predict(LOCAL, *SMALL, "synthetic.train_seconds_per_sample=5")
    assert gen_bound["trainer_wait_fraction"] > 0.5
    assert gen_bound["trainer_wait_fraction"] > train_bound["trainer_wait_fraction"]
    assert train_bound["generation_idle_fraction"] > gen_bound["generation_idle_fraction"]


@pytest.mark.parametrize("overrides", [
    (), ("async.buffer_overflow=evict", "async.max_weight_staleness=1"),
    ("async.unused_samples_handler=drop", "async.max_weight_staleness=0"),
    ("async.rollout_submission_granularity=group", "publication.drain_timeout_s=0.5"),
], ids=["default", "evict", "drop", "group-drain-aborts"])
def test_simulated_ledger_accounts_for_every_prompt(overrides):
    p = predict(LOCAL, *SMALL, *overrides)
    led = p["ledger"]
    assert led["unaccounted"] == 0 and led["in_flight_groups"] == 0
    ended = sum(led[k] for k in ("delivered_groups", "discarded_groups", "evicted_groups",
                                 "aborted_groups", "filtered_groups", "failed_groups"))
    assert led["submitted_groups"] == ended + led["buffered_groups"]
    # the per-length tallies count the same samples the ledger counts as groups
    rows = p["by_response_length"].values()
    assert sum(r["delivered"] for r in rows) == 4 * led["delivered_groups"]
    # an attempt past async.max_retries ends as failed, not discarded / evicted / aborted
    lost = sum(r[k] for r in rows for k in ("dropped", "evicted", "aborted"))
    assert lost == 4 * sum(led[k] for k in ("discarded_groups", "evicted_groups",
                                            "aborted_groups", "failed_groups"))
    assert sum(p["staleness_histogram"].values()) == led["delivered_groups"]


def test_same_seed_same_prediction():
    a, b = predict(LOCAL, *SMALL), predict(LOCAL, *SMALL)
    for key in ("trainer_wait_fraction", "mean_staleness", "simulated_seconds", "ledger"):
        assert a[key] == b[key]


# ---- calibration ---------------------------------------------------------------------------------
def _group(lengths):
    return Group("g", [Sample("g", response_ids=[1] * n, prompt_ids=[1] * 10) for n in lengths])


def test_run_calibration_records_what_the_simulator_reads():
    stats = CalibrationStats()
    stats.observe_collection([_group([100, 100, 400, 400])], train_seconds=2.0)
    stats.observe_metrics({"publish/publication_seconds": 3.0, "publish/transfer_seconds": 2.0,
                           "publish/drain_seconds": 1.0, "publish/paused_seconds": 3.0,
                           "publish/bytes": 4e9, "producer/generation_seconds": 80.0,
                           "producer/generated_tokens": 4000.0,
                           "producer/generation_busy_seconds": 10.0,
                           "perf/orchestration_seconds_per_step": 0.25,
                           "train/trainer_wait_seconds": 1.5,
                           "rollout/fully_async/completed_queue/consumer_wait_seconds": 1.0})
    stats.observe_eval(0.5)
    stats.observe_eval(1.5)
    cal = stats.to_dict(wall_seconds=10.0, engines=2, max_running_requests=8,
                        max_response_len=512)
    assert cal["eval"] == {"count": 2, "mean_seconds": 1.0}
    r = cal["response_length"]
    assert r["samples"] == 4 and r["mean"] == 250 and r["p50"] == 100 and r["max"] == 400
    assert math.isclose(r["log_mean"], math.log(200))
    assert cal["trainer"]["seconds_per_sample"] == 0.5
    assert cal["controller_seconds_per_step"] == 0.25
    assert cal["collection_transport_seconds"] == 0.5  # wait 1.5 s, of which 1 s in the buffer
    assert cal["publication"]["bytes_per_s"] == 2e9
    e = cal["engines"]
    assert e["per_request_tokens_per_s"] == 50 and e["mean_in_flight_per_engine"] == 4

    cfg = load_config(LOCAL, SMALL)
    t = sim_timings(cfg, cal, "run.json")
    assert t.lengths.median == pytest.approx(200) and t.trainer.seconds_per_sample == 0.5
    assert t.publish_bytes == 4e9 and t.transfer.bytes_per_s == 2e9
    assert t.prompt_tokens == 10 and t.controller_seconds_per_step == 0.25
    assert t.collection_transport_s == 0.5 and t.eval_seconds == 1.0
    # 4 requests in flight per engine, all running (8 slots), each at 50 tokens/s
    kv = int(4 * (10 + t.lengths.mean() / 2))
    assert t.engine.step_seconds(4, kv) == pytest.approx(1 / 50)
    # no engine-side latency, no producer latencies in this summary: those stay unmodelled
    assert t.request_transit_s == 0 and t.sources.pop("transit").startswith("not modelled")
    assert t.sources.pop("producer_calls").startswith("not modelled")
    assert t.turns is None and t.sources.pop("turns") == "one generate call per sample"
    assert all(src.startswith("measured (run.json)") for src in t.sources.values())
    defaults = sim_timings(cfg).sources
    for key in ("controller", "collection_transport", "producer_calls", "transit"):
        assert defaults.pop(key).startswith("not modelled")
    assert defaults.pop("eval").startswith("simulated generation only")
    assert defaults.pop("turns") == "one generate call per sample"
    assert set(defaults.values()) == {SYNTHETIC}


def test_calibration_from_the_engines_own_costs_and_the_round_trips_outside_them():
    """An embedded-engine run measures its engine's wall time per step (curve) and a request's
    time inside the engine; with the producer's own latencies the simulator needs no
    operating point: transit = producer latency - engine latency; prefill is in the step."""
    stats = CalibrationStats()
    stats.observe_collection([_group([2, 2, 2, 2])], train_seconds=0.1)
    stats.observe_metrics({
        "producer/generation_seconds": 40.0, "producer/submitted_samples": 2000.0,
        "producer/generated_tokens": 4000.0, "producer/generation_busy_seconds": 1.0,
        "producer/fetch_seconds": 0.5, "producer/fetches": 100.0,
        "producer/score_seconds": 20.0, "producer/scored_samples": 2000.0,
        "engines/request_latency_s_mean": 0.012, "engines/step_base_s_mean": 0.006,
        "engines/step_per_request_s_mean": 0.0001, "engines/step_requests_mean_mean": 30.0,
        "publish/publication_seconds": 0.04, "publish/paused_seconds": 0.03,
        "publish/drain_seconds": 0.015, "publish/transfer_seconds": 0.005,
        "publish/snapshot_seconds": 0.01, "publish/control_seconds": 0.004,
        "publish/bytes": 1e6})
    cal = stats.to_dict(wall_seconds=2.0, engines=1, max_running_requests=32,
                        max_response_len=2, producer_samples=64)
    assert cal["producer"] == {"budget_samples": 64, "request_latency_s": 0.02,
                               "fetch_latency_s": 0.005, "score_latency_s": 0.01,
                               "transit_latency_s": None}
    assert cal["engines"]["request_latency_s"] == 0.012
    cfg = load_config(LOCAL, [])
    t = sim_timings(cfg, cal, "run.json")
    assert t.request_transit_s == pytest.approx(0.008)
    assert t.fetch_latency_s == 0.005 and t.score_latency_s == 0.01
    assert t.engine.prefill_seconds(1000) == 0.0
    assert t.engine.step_seconds(8, 10_000) == pytest.approx(0.006 + 8 * 0.0001)
    assert t.snapshot_s == 0.01 and t.control_call_s == 0.004
    assert t.publication_overhead_s == pytest.approx(0.03 - 0.015 - 0.005)
    assert "step curve" in t.sources["decode"] and t.sources["transit"].startswith("measured")
    # measured request by request (rollouts only: long evaluations at the engine once made
    # its mean exceed the producer's), the per-request transit wins over the means' difference
    stats.observe_metrics({"producer/generation_seconds": 40.0,
                           "producer/submitted_samples": 2000.0,
                           "producer/transit_seconds": 6.0, "producer/transit_samples": 2000.0,
                           "engines/request_latency_s_mean": 5.0})
    per_request = stats.to_dict(wall_seconds=2.0, engines=1, max_running_requests=32,
                                max_response_len=2, producer_samples=64)
    assert per_request["producer"]["transit_latency_s"] == 0.003
    assert sim_timings(cfg, per_request, "run.json").request_transit_s == pytest.approx(0.003)
    # measured with 4x local.toml's producer budget (64 samples): the round trips, which
    # every request in flight shares, scale down with the budget (never up)
    bigger = json.loads(json.dumps(cal))
    bigger["producer"]["budget_samples"] = 256
    quarter = sim_timings(cfg, bigger, "run.json")
    assert quarter.request_transit_s == pytest.approx(0.002)
    assert quarter.score_latency_s == pytest.approx(0.0025) and "x0.25" in quarter.sources["transit"]
    # the round trips cost simulated time: the same run without them is faster
    free = replace(t, request_transit_s=0.0, fetch_latency_s=0.0, score_latency_s=0.0)
    plan = plan_capacity(cfg)[0]
    slow, fast = simulate(cfg, plan, t, 20), simulate(cfg, plan, free, 20)
    assert slow["steps_per_hour"] < fast["steps_per_hour"]


def test_step_curve_fits_the_engines_steps_and_refuses_one_batch_size():
    from rl_async.engine.timing import StepCurve

    curve = StepCurve()
    for requests in (1, 2, 4, 8, 16, 32) * 5:
        curve.observe(requests, 0.002 + 0.001 * requests)
    base, per = curve.fit()
    assert base == pytest.approx(0.002) and per == pytest.approx(0.001)
    assert set(curve.metrics("engine/0")) == {"engine/0/step_base_s", "engine/0/step_per_request_s",
                                              "engine/0/step_requests_mean"}
    flat = StepCurve()
    flat.observe(8, 0.01, weight=100)  # one batch size: no slope to fit
    assert flat.fit() is None and flat.metrics("engine/0") == {}
    falling = StepCurve()  # noise with a negative slope: a flat line through the mean
    for requests, seconds in ((2, 0.012), (4, 0.010)) * 20:
        falling.observe(requests, seconds)
    assert falling.fit() == (pytest.approx(0.011), 0.0)


def test_calibration_takes_the_decode_curves_shape_from_the_engines():
    """One operating point (4 running at 50 tokens/s each = a 20 ms step) on the engines' own
    linear curve: 8 slots then predict a step that grows with the batch, as a CPU engine's
    does, not the [synthetic] GPU curve's nearly flat one."""
    stats = CalibrationStats()
    stats.observe_collection([_group([100, 100, 400, 400])], train_seconds=2.0)
    stats.observe_metrics({"producer/generation_seconds": 80.0,
                           "producer/generated_tokens": 4000.0,
                           "producer/generation_busy_seconds": 10.0,
                           "engines/step_base_s_mean": 0.001,
                           "engines/step_per_request_s_mean": 0.002,
                           "engines/step_requests_mean_mean": 3.0})
    cal = stats.to_dict(wall_seconds=10.0, engines=2, max_running_requests=8,
                        max_response_len=512)
    assert cal["engines"]["decode_curve"] == {"base_s": 0.001, "per_request_s": 0.002,
                                              "requests_mean": 3.0}
    cfg = load_config(LOCAL, SMALL)
    t = sim_timings(cfg, cal, "run.json")
    assert "measured decode curve" in t.sources["decode"]
    assert t.engine.step_seconds(4, 0) == pytest.approx(1 / 50)  # through the point
    # the shape: (0.001 + 8 x 0.002) / (0.001 + 4 x 0.002) of the point's step
    assert t.engine.step_seconds(8, 0) == pytest.approx(0.02 * 0.017 / 0.009)
    without = dict(cal, engines={k: v for k, v in cal["engines"].items() if k != "decode_curve"})
    flat = sim_timings(cfg, without, "run.json")
    assert "[synthetic] curve's shape" in flat.sources["decode"]
    assert flat.engine.step_seconds(8, 0) < 1.5 * flat.engine.step_seconds(4, 0)


def test_a_calibrated_evaluation_lasts_at_least_as_long_as_the_real_one():
    """Training waits for an evaluation while generation runs on: the real one's measured
    time (scoring, actor calls) is a floor under the simulated one."""
    cfg = load_config(LOCAL, [*SMALL, "eval.every_steps=2"])
    plan = plan_capacity(cfg)[0]
    fast = simulate(cfg, plan, sim_timings(cfg), 6)
    floor = sim_timings(cfg, {"eval": {"count": 3, "mean_seconds": 60.0}}, "run.json")
    assert floor.eval_seconds == 60.0 and floor.sources["eval"].startswith("measured")
    slow = simulate(cfg, plan, floor, 6)
    assert fast["eval_seconds"] < 3 * 60.0 <= slow["eval_seconds"]


def test_every_run_summary_carries_a_calibration_section():
    from inprocess_fleet import Disk, InProcessFleet

    from rl_async.loop.controller import Controller

    cfg = load_config(LOCAL, ["run.max_steps=3", "rollout.rollout_batch_size=2",
                              "rollout.n_samples_per_prompt=2", "train.global_batch_size=4",
                              "sglang.max_running_requests=2", "wandb.mode=disabled"])
    plan = plan_capacity(cfg)[0]
    fleet = InProcessFleet(cfg, plan, Disk(), seed=0)
    summary = asyncio.run(Controller(cfg, plan, fleet, lambda m, s: None).run())
    cal = summary["calibration"]
    assert cal["response_length"]["samples"] == 3 * 4  # the fake engine answers 2 tokens
    assert cal["response_length"]["p50"] == 2 and cal["prompt_tokens_mean"] == 2
    assert cal["trainer"]["samples"] == 12 and cal["trainer"]["collections"] == 3
    assert cal["publication"]["count"] >= 2
    assert cal["eval"]["count"] >= 1 and cal["eval"]["mean_seconds"] > 0  # the initial one
    # a summary's calibration is what --calibrate reads
    assert sim_timings(cfg, cal).sources["trainer"].startswith("measured")


# ---- CLI ------------------------------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_simulate_json_is_one_line_with_the_contract_keys():
    out = cli("simulate", str(LOCAL), "--steps", "4", "--json", *sum((["--set", o] for o in SMALL), []))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    for key in ("trainer_wait_fraction", "mean_staleness", "dropped_samples_fraction",
                "steps_per_hour", "generation_idle_fraction", "staleness_histogram",
                "publication_pause_seconds", "useful_tokens_per_s", "buffer", "timings_source"):
        assert key in doc, key
    assert doc["simulated_steps"] == 4


def test_simulate_calibrate_without_calibration_section_names_the_fix(tmp_path):
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"steps": 3}))
    out = cli("simulate", str(LOCAL), "--calibrate", str(bad))
    assert out.returncode == 2
    assert "no `calibration` section" in out.stderr and "--summary-json" in out.stderr


def test_plan_simulate_adds_simulated_warnings():
    out = cli("plan", str(LOCAL), "--json", "--simulate", *sum((["--set", o] for o in SMALL), []),
              "--set", "sglang.max_running_requests=1", "--set", "run.max_steps=4",
              "--set", "synthetic.train_seconds_per_sample=0")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    codes = [w["code"] for w in doc["warnings"]]
    assert "SIMULATED" in codes and "SIM_GENERATION_BOUND" in codes
    assert "trainer_wait_fraction" in doc["simulation"]


def test_a_simulated_stall_fails_like_a_real_run():
    # the trainer needs 16 samples x 10 s per collection; the stall budget is 5 s (virtual)
    out = cli("simulate", str(LOCAL), *sum((["--set", o] for o in SMALL), []),
              "--set", "run.stall_timeout_s=5", "--set", "synthetic.train_seconds_per_sample=10")
    assert out.returncode == 1
    assert "the simulated run stopped: stalled" in out.stderr
    assert "run.stall_timeout_s = 5" in out.stderr


def test_core_clock_is_wall_time_in_a_real_loop_and_virtual_in_the_simulator():
    import time

    from rl_async.base import clock
    async def read():
        await asyncio.sleep(100 if isinstance(asyncio.get_running_loop(), VirtualClockLoop)
                            else 0)
        return clock.now()

    assert run_virtual(read()) == 100
    before = time.monotonic()
    assert asyncio.run(read()) >= before
