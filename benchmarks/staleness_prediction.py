"""Predicted vs measured staleness: `rl-async simulate` against dry runs of the same config.

For each trainer utilisation (0.5, 0.8, 0.95) and response-length tail (lognormal sigma 0.5
and 1.2), one config (cluster_configs/three_node.toml shrunk to 2 synthetic engines of 8
slots, 4 x 4 samples per update, responses of median 16 tokens up to 64, lag 6, no
evaluations) is
1. sized: the simulator first measures the generation-bound rate (trainer compute 0), then
   the trainer is given `utilisation / rate` seconds per sample (synthetic.train_seconds_per
   _sample), so it is busy about that share of the time;
2. predicted: `simulate` (the real controller, producer, buffer and ledger on a virtual
   clock with the synthetic engines' timing model);
3. measured: a dry run (the whole Ray actor system with synthetic engines and trainer, real
   time at synthetic.time_scale = 1).

Compared (summary `staleness` block, the same definitions on both sides): mean and p99 of
the delivered age, in flight and in queue; trained samples/s. Goal: predicted mean within
10% of measured and p99 within 1 version, in every cell.

    python benchmarks/staleness_prediction.py --json [--steps 40]
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from _common import init_ray, ROOT, TimedRun  # noqa: I001  (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray

from rl_async.plan.checks import validate
from rl_async.plan.dry_run import dry_run_config
from rl_async.plan.load import load_config
from rl_async.sim.calibrate import sim_timings
from rl_async.sim.run import simulate
from rl_async.sim.timings import TrainerTiming

BASE = ["cluster.inference_gpus=4", "cluster.trainer_gpus=2", "cluster.trainer_workers=2",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16", "sglang.max_running_requests=8",
        "rollout.max_response_len=64", "synthetic.response_len_median=16",
        "synthetic.time_scale=1", "synthetic.publish_bytes=10000000",
        "publication.bucket_bytes=4000000", "publication.verify_checksum=false",
        "run.checkpoint_every=0", "eval.every_steps=0", "task.num_eval_prompts=8",
        "wandb.mode=disabled"]
UTILISATIONS = (0.5, 0.8, 0.95)
TAILS = (0.5, 1.2)
MEAN_TOLERANCE, P99_TOLERANCE = 0.10, 1.0
KEYS = ("mean_delivered", "p99_delivered", "inflight_mean", "inflight_p99", "queue_mean",
        "queue_p99")


def config(sigma: float, train_s: float, steps: int, name: str, out: str):
    overrides = [*BASE, f"synthetic.response_len_sigma={sigma}",
                 f"synthetic.train_seconds_per_sample={train_s}", f"run.max_steps={steps}",
                 f"run.name={name}", f"run.output_dir={out}"]
    cfg, _ = dry_run_config(load_config(ROOT / "cluster_configs/three_node.toml", overrides), overrides)
    report = validate(cfg)
    if not report.ok:
        raise SystemExit(f"invalid benchmark config {overrides}: {report.errors}")
    return cfg, report.plan


def cell(sigma: float, utilisation: float, steps: int, out: str) -> dict:
    cfg, plan = config(sigma, 0.0, steps, "probe", out)
    generation_bound = simulate(cfg, plan, replace(sim_timings(cfg), trainer=TrainerTiming(0.0)),
                                steps)["samples_per_s"]
    train_s = utilisation / generation_bound
    name = f"u{int(utilisation * 100)}-s{sigma}"
    cfg, plan = config(sigma, train_s, steps, name, out)
    predicted = simulate(cfg, plan, sim_timings(cfg), steps)
    result = ray.get(TimedRun.remote().run.remote(cfg, plan))
    real = result["summary"]
    measured_sps = real["throughput"]["trained_samples"] / max(real["wall_seconds"], 1e-9)
    pst, mst = predicted["staleness"], real["staleness"]
    mean_err = abs(pst["mean_delivered"] - mst["mean_delivered"]) / max(mst["mean_delivered"],
                                                                        1e-9)
    p99_err = abs(pst["p99_delivered"] - mst["p99_delivered"])
    return {"utilisation_target": utilisation, "sigma": sigma,
            "train_seconds_per_sample": round(train_s, 5),
            "utilisation_measured": round(1 - real["throughput"]["trainer_wait_fraction"], 3),
            "predicted": {**{k: round(pst[k], 3) for k in KEYS},
                          "samples_per_s": round(predicted["samples_per_s"], 2)},
            "measured": {**{k: round(mst[k], 3) for k in KEYS},
                         "samples_per_s": round(measured_sps, 2)},
            "mean_relative_error": round(mean_err, 3), "p99_error": p99_err,
            "within": mean_err <= MEAN_TOLERANCE and p99_err <= P99_TOLERANCE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--utilisations", default=",".join(map(str, UTILISATIONS)))
    parser.add_argument("--tails", default=",".join(map(str, TAILS)))
    parser.add_argument("--out", default="/tmp/rl-async-staleness-prediction")
    args = parse_with_smoke(parser, steps=4, utilisations="0.8", tails="1.2")
    init_ray(num_cpus=2)
    started = time.monotonic()
    cells = {f"utilisation {u}, sigma {s}": cell(float(s), float(u), args.steps, args.out)
             for s in args.tails.split(",") for u in args.utilisations.split(",")}
    out = {"cells": cells, "within_target": sum(c["within"] for c in cells.values()),
           "of": len(cells), "benchmark_seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
