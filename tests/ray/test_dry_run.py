"""`rl-async run --dry-run`: a GPU run file's actor system on CPUs with synthetic backends."""

import json

import pytest

from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.plan.dry_run import dry_run_config

pytestmark = pytest.mark.ray

# three_node.toml shrunk: 2 TP2 engines, 2 trainer ranks (megatron TP2 -> one data-parallel
# shard), 2 optimizer updates per collection, a mid-run evaluation while generation goes on
# (eval.drain = false); fast simulated time.
SHRINK = ["cluster.inference_gpus=4", "cluster.trainer_gpus=2", "cluster.trainer_workers=2",
          "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
          "train.global_batch_size=8", "sglang.max_running_requests=8", "run.max_steps=6",
          "eval.every_steps=2", "task.num_eval_prompts=8", "rollout.max_response_len=64",
          "synthetic.response_len_median=16", "synthetic.time_scale=0.05",
          "synthetic.publish_bytes=10000000", "publication.bucket_bytes=4000000",
          "publication.verify_checksum=true", "run.checkpoint_every=0", "run.name=t-dry"]


def test_dry_run_of_a_gpu_file_runs_every_actor_on_cpus_and_loses_nothing(ray_cluster, tmp_path):
    gpu_cfg = load_config("cluster_configs/three_node.toml", SHRINK)
    cfg, notes = dry_run_config(gpu_cfg, SHRINK)
    report = validate(cfg)
    assert report.ok, report.errors
    assert cfg.engine.backend == cfg.train.backend == "synthetic"
    assert cfg.cluster.inference_gpus == cfg.cluster.trainer_gpus == 0
    assert report.plan.engines == 2 and cfg.run.max_steps == 6  # set explicitly: kept
    assert any("successor" in n for n in notes)
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 6 and summary["policy_version"] == 6
    ledger = summary["ledger"]
    assert ledger["unaccounted"] == 0 and ledger["in_flight_groups"] == 0
    assert ledger["delivered_groups"] == 3 * 4  # 3 collections of 4 groups
    assert summary["staleness"]["max_delivered"] <= summary["staleness"]["max_weight_staleness"]


def test_dry_run_caps_steps_and_speeds_up_time_unless_set():
    cfg, notes = dry_run_config(load_config("cluster_configs/three_node.toml", []), [])
    assert cfg.run.max_steps == 10 and cfg.synthetic.time_scale == 0.1
    assert cfg.cluster.cpu_engines == 8 and cfg.cluster.trainer_workers == 8
    assert cfg.wandb.mode == "disabled" and len(notes) == 4
    assert cfg.run.output_dir == "runs/dry-run"  # not the file's shared storage
