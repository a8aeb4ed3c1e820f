"""W&B offline run files carry every SPEC §7 and §8 metric name and the resolved config."""

import pytest

from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.observe.queue_metrics import metric_names, with_prefix

from wandb_records import read_run  # tests/ray is on sys.path (rootdir-less test dir)

pytestmark = pytest.mark.ray

SPEC8 = ["train/ppo_clip_fraction", "train/tis_clip_fraction", "train/tis_ess_ratio",
         "train/ratio_p99", "train/ratio_max", "train/logprob_mismatch", "train/logprob_kl",
         "train/stale_token_fraction", "train/entropy", "train/grad_norm",
         "train/trainer_wait_seconds", "publish/publication_seconds", "publish/paused_seconds"]


def test_offline_run_files_hold_every_metric_name(ray_cluster, tmp_path):
    cfg = load_config("cluster_configs/local.toml", [
        "run.max_steps=2", "run.name=t-wandb", f"run.output_dir={tmp_path}",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16", "train.micro_batch_size=16", "task.num_eval_prompts=4"])
    assert cfg.wandb.mode == "offline"
    assert run_training(cfg, validate(cfg), None) == 0
    (run_file,) = (tmp_path / "t-wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, rows = read_run(run_file)
    assert rows >= 3  # initial eval, two steps (and the final eval)
    spec7 = set(with_prefix(dict.fromkeys(metric_names(), 0.0)))
    assert len(spec7) > 60  # 8 counts + 3 x 8 length bins + 3 x 9 age bins + wait + 8 others
    assert not spec7 - history, sorted(spec7 - history)[:10]
    assert not set(SPEC8) - history
    assert {"eval/reward", "ledger/unaccounted"} <= history
    # the built-in verifier scored inside the producer (reward.placement = "auto"), under
    # the reward actor's metric names; no reward actor ran (it reports its event loop)
    assert {"reward/calls", "reward/retries", "reward/failures"} <= history
    assert "reward/busy_fraction" not in history and "producer/busy_fraction" in history
    assert {"capacity_plan", "async", "rollout", "train"} <= config
