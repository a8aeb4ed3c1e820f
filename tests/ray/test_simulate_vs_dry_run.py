"""The simulator against real actors: a dry run (the real actor system with synthetic engines
and trainers, on real time) and `simulate` (the same core on a virtual clock) share one timing
model, so what differs is everything the simulator leaves out (actor calls, serialisation,
scheduling on a loaded machine). Their trainer wait, staleness and discards must agree.

Steps last ~0.5-1 s of real time, so orchestration overhead (milliseconds) is small beside
them; tolerances are the issue's, widened for a 12-step run (a single discarded group moves
the fraction by ~0.01)."""

import json

import pytest

from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.plan.dry_run import dry_run_config
from rl_async.sim.calibrate import sim_timings
from rl_async.sim.run import simulate
from test_dry_run import SHRINK

pytestmark = pytest.mark.ray

# test_dry_run's shrunk three_node.toml (2 engines of 8 slots, long-tailed responses: median
# 16, up to 64 tokens) at the [synthetic] decode timings in real time (time_scale 1), one
# optimizer update per 16-sample collection, no evaluations, lag 1: a response longer than a
# step is older than the lag when trained, so groups are discarded and regenerated: the
# sensitive part of the model. Later overrides win.
CASE = [*SHRINK, "train.global_batch_size=16", "run.max_steps=12", "eval.every_steps=0",
        "synthetic.time_scale=1", "synthetic.train_seconds_per_sample=0.02",
        "publication.verify_checksum=false", "async.max_weight_staleness=1",
        "run.name=t-sim-vs-dry", "wandb.mode=disabled"]


def test_simulate_predicts_a_dry_run_of_the_same_config(ray_cluster, tmp_path):
    cfg, _ = dry_run_config(load_config("cluster_configs/three_node.toml", CASE), CASE)
    cfg.run.output_dir = str(tmp_path)
    report = validate(cfg)
    assert report.ok, report.errors
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    real = json.loads(out.read_text())
    led = real["ledger"]
    assert led["unaccounted"] == 0 and led["discarded_groups"] > 0  # the case discards

    sim = simulate(cfg, report.plan, sim_timings(cfg), cfg.run.max_steps)
    real_discards = led["discarded_groups"] / (led["discarded_groups"] + led["delivered_groups"])
    got = {"trainer wait": (real["throughput"]["trainer_wait_fraction"],
                            sim["trainer_wait_fraction"], 0.15),
           "mean staleness": (real["staleness"]["mean_delivered"], sim["mean_staleness"], 0.3),
           "discarded groups": (real_discards, sim["discarded_groups_fraction"], 0.15)}
    off = {k: (r, s) for k, (r, s, tol) in got.items() if abs(r - s) > tol}
    assert not off, f"real vs simulated outside tolerance: {off} (all: {got})"
