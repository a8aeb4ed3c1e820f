"""Orchestration throughput: samples per second through the real actors with instant compute.

The real producer, engine, completed-buffer, prompt-source, trainer and controller actors
(the built-in verifier scores inside the producer: reward.placement = "auto") run
cluster_configs/local.toml's loop with `engine.backend = train.backend = "synthetic"` and
`synthetic.time_scale = 0`: engines answer at once, the trainer trains in no time and
publication moves no bytes. What is left is the cost of orchestration: Ray actor calls,
(de)serialisation and the actors' Python. In the same run, on the same cluster, a caller
actor measures the raw rate of async actor calls carrying one sample-sized argument (the
ceiling any design built on per-sample actor calls can reach).

    python benchmarks/orchestration.py --json
prints one JSON line: samples_per_s (steady state: first collection row -> last), the raw
call rate, ray_calls_per_sample (calls made on the per-sample path: producer -> engines,
reward actor (if any), buffer, prompt source; buffer -> prompt source; the controller's few
calls per step are not counted), controller_overhead_fraction (perf/orchestration_fraction:
the controller loop's own share of a step), the trainer wait fraction, and each actor's busy
fraction and event-loop lag (which actor is the bottleneck).

`--fleet64` instead holds 64 synthetic engines x 256 running requests with realistic decode
timings (time_scale 1, an instant trainer) and reports the delivered samples/s beside what
the engines' timing model can produce at full slots, plus trainer wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from _common import init_ray, load_checked, TimedRun  # noqa: I001  (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray

from rl_async.engine.timing import EngineTiming, ResponseLengths
from rl_async.base.types import Sample


@ray.remote(num_cpus=0)
class Echo:
    async def call(self, sample):
        return sample


@ray.remote(num_cpus=0)
class Caller:
    async def run(self, target, n: int, concurrency: int) -> float:
        sample = Sample(prompt_id="p", prompt_ids=list(range(4)), response_ids=list(range(16)),
                        token_versions=[0] * 16, behavior_logprobs=[-0.5] * 16)
        sem = asyncio.Semaphore(concurrency)

        async def one():
            async with sem:
                await target.call.remote(sample)

        await asyncio.gather(*(one() for _ in range(200)))  # warm-up
        start = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.monotonic() - start)


def raw_calls_per_s(n: int, concurrency: int) -> float:
    echo, caller = Echo.remote(), Caller.remote()
    rate = ray.get(caller.run.remote(echo, n, concurrency))
    ray.kill(echo)
    ray.kill(caller)
    return rate


def base_overrides(args, name: str) -> list[str]:
    return [f"run.name={name}", f"run.max_steps={args.steps}", "wandb.mode=disabled",
            "engine.backend=synthetic", "train.backend=synthetic",
            "cluster.engine_cpus=0.01", "cluster.trainer_cpus=0.01",
            "cluster.trainer_workers=1", "synthetic.publish_bytes=1000000",
            "synthetic.group_init_s=0", "task.num_eval_prompts=8",
            "run.audit_fraction=0",  # no model to audit with
            f"rollout.n_samples_per_prompt={args.group_size}",
            f"rollout.rollout_batch_size={args.groups}",
            f"train.global_batch_size={args.groups * args.group_size}",
            "async.max_weight_staleness=4", "async.async_data_buffer_capacity_factor=2"]


def steady(out: dict, collection_samples: int) -> dict:
    rows = [(t, m) for t, _, m in out["rows"] if "train/collection_seconds" in m]
    if len(rows) < 3:
        raise SystemExit(f"only {len(rows)} collections logged: use more --steps")
    (t0, _), (t1, last) = rows[0], rows[-1]
    timed = rows[1:]
    samples = (len(rows) - 1) * collection_samples
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for _, m in timed)  # noqa: E731
    calls = last.get("producer/ray_calls", 0.0) + last.get("buffer/ray_calls", 0.0)
    submitted = last.get("producer/submitted_samples", 0.0)
    busy = {k.removesuffix("/busy_fraction"): round(mean(k), 3) for k in last
            if k.endswith("busy_fraction") or k.endswith("busy_fraction_max")}
    lag = {k.removesuffix("/loop_lag_max_s"): round(max(m.get(k, 0) for _, m in timed), 4)
           for k in last if k.endswith("loop_lag_max_s")}
    return {"samples_per_s": round(samples / (t1 - t0), 1),
            "ray_calls_per_sample": round(calls / max(submitted, 1), 3),
            "controller_overhead_fraction": round(mean("perf/orchestration_fraction"), 4),
            "orchestration_seconds_per_step": round(mean("perf/orchestration_seconds_per_step"), 4),
            "trainer_wait_fraction": round(sum(m["train/trainer_wait_seconds"] for _, m in timed)
                                           / (t1 - t0), 3),
            "timed_collections": len(rows) - 1, "busy_fraction": busy, "loop_lag_max_s": lag,
            # where the samples sit at the end of a collection (means over collections)
            "pipeline": {k.split("/", 1)[1]: round(mean(k), 1) for k in (
                "producer/samples_in_flight", "producer/groups_in_flight",
                "producer/pending_puts", "rollout/fully_async/queue_size")},
            "engines_running_mean": round(mean("engines/running_mean"), 1),
            "engines_waiting_mean": round(mean("engines/waiting_mean"), 1),
            "generate_batch_mean": round(last.get("producer/generate/batched_items", 0)
                                         / max(1, last.get("producer/generate/batches", 0)), 2),
            "reward_batch_mean": round(last.get("producer/reward/batched_items", 0)
                                       / max(1, last.get("producer/reward/batches", 0)), 2),
            "put_batch_mean": round(last.get("producer/put/batched_items", 0)
                                    / max(1, last.get("producer/put/batches", 0)), 2),
            "unaccounted": out["summary"]["ledger"]["unaccounted"]}


def run_orchestration(args) -> dict:
    cfg, report = load_checked("cluster_configs/local.toml", base_overrides(args, "bench-orch") + [
        f"cluster.cpu_engines={args.engines}", f"sglang.max_running_requests={args.max_running}",
        # the plan's derived budget for this fleet (local.toml pins 64 for its CPU engine)
        f"async.async_max_concurrent_samples={2 * args.engines * args.max_running}",
        "synthetic.time_scale=0", f"synthetic.response_len_median={args.response_len}",
        f"rollout.max_response_len={2 * args.response_len}",
        f"synthetic.vocab_size=16"] + list(args.set))
    out = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    return steady(out, report.plan.collection_samples)


def run_fleet64(args) -> dict:
    """Publication with refresh off drains every in-flight request (a long tail of up to
    max_len decode steps) each step, which would measure the drain, not the orchestration:
    this run uses mixed_policy refresh (requests survive updates; their prefix is prefilled
    again, a cost the timing model charges) and 4096-sample collections."""
    engines, running, max_len, median = 64, 256, 1024, 256
    args.groups = 4096 // args.group_size  # a collection every few seconds, not 2 per second
    cfg, report = load_checked("cluster_configs/local.toml", base_overrides(args, "bench-f64") + [
        f"cluster.cpu_engines={engines}", f"sglang.max_running_requests={running}",
        f"async.async_max_concurrent_samples={2 * engines * running}",
        "synthetic.time_scale=1", f"synthetic.response_len_median={median}",
        "synthetic.train_seconds_per_sample=0", f"rollout.max_response_len={max_len}",
        "synthetic.vocab_size=16", "refresh.mode=mixed_policy"] + list(args.set))
    timing = EngineTiming()
    mean_len = ResponseLengths(median, 1.0).mean(max_len)
    # Full slots: every engine runs `running` requests whose KV averages half a response.
    step = timing.step_seconds(running, int(running * (8 + mean_len / 2)))
    expected = engines * running / (mean_len * step)
    out = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    res = steady(out, report.plan.collection_samples)
    res["expected_samples_per_s"] = round(expected, 1)
    res["engines"], res["max_running_requests"] = engines, running
    res["engine_slot_occupancy"] = round(res["engines_running_mean"] / running, 3)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (collections)")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=128)
    parser.add_argument("--groups", type=int, default=64,
                        help="groups per collection (--fleet64: 4096 samples' worth)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=16, help="median response tokens")
    parser.add_argument("--raw-calls", type=int, default=20_000)
    parser.add_argument("--fleet64", action="store_true",
                        help="64 engines x 256 running requests at realistic timings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parse_with_smoke(parser, steps=4, engines=2, max_running=8, groups=4, group_size=2,
                            raw_calls=200)
    init_ray(num_cpus=2)
    try:
        raw = raw_calls_per_s(args.raw_calls, concurrency=512)
        res = run_fleet64(args) if args.fleet64 else run_orchestration(args)
    finally:
        ray.shutdown()
    line = {"samples_per_s": res.pop("samples_per_s"),
            "ray_calls_per_sample": res.pop("ray_calls_per_sample"),
            "raw_calls_per_s": round(raw, 1),
            "controller_overhead_fraction": res.pop("controller_overhead_fraction"), **res}
    line["samples_per_s_at_raw_call_rate"] = round(raw / max(line["ray_calls_per_sample"], 1e-9), 1)
    print(json.dumps(line), flush=True)
    if not args.json:
        print(json.dumps(line, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
