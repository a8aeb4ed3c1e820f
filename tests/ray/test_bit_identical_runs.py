"""Same seed, same run: sync runs are bit-identical, async at lag 0 equals sync (1 and 2
trainer workers, DDP over gloo), and a lag-1 run replays from its recorded collections.

Every comparison is exact (bytes of the exported safetensors, floats with ==), so any
nondeterminism fails it: arrival-order seeds, completion-order collections, batch-dependent
decoding, or async lag 0 sampling ahead and discarding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.replay import replay
from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.state.rollouts import compare_exports, read_collection

from wandb_records import history_rows  # tests/ray is on sys.path (rootdir-less test dir)

pytestmark = pytest.mark.ray

SMALL = ["run.max_steps=4", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "train.global_batch_size=16", "train.micro_batch_size=8", "task.num_eval_prompts=8",
         "sglang.max_running_requests=8", "eval.every_steps=2", "eval.n_samples=2",
         "run.deterministic=true", "run.record_rollouts=true"]


def run(tmp_path, path, name, *extra, wandb="disabled"):
    cfg = load_config(path, [*SMALL, f"run.name={name}", f"run.output_dir={tmp_path}",
                             f"wandb.mode={wandb}", *extra])
    out = tmp_path / f"{name}.json"
    assert run_training(cfg, validate(cfg), str(out)) == 0, out.read_text()
    summary = json.loads(out.read_text())
    return summary, Path(summary["run_dir"])


def trained(run_dir: Path) -> list[str]:
    return (run_dir / "trained.jsonl").read_text().splitlines()


def recordings(run_dir: Path, steps=range(1, 5)) -> list:
    """Each step's recorded collection, minus the buffer's arrival numbers (completion order:
    timing, which the trainer never sees, since collections train in canonical order)."""
    out = []
    for step in steps:
        version, groups = read_collection(run_dir, step)
        out.append((version, [g.replace(arrival_seq=-1) for g in groups]))
    return out


DETERMINISTIC_KEYS = ("train/", "rollout/reward_mean", "eval/", "policy/version")


def exact_metrics(tmp_path, name) -> list[dict[str, str]]:
    """The W&B history minus anything that measures time (the rest must match exactly)."""
    (run_file,) = (tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb")
    return [{k: v for k, v in row.items() if k.startswith(DETERMINISTIC_KEYS)
             and not any(t in k for t in ("seconds", "_per_s", "wait"))}
            for row in history_rows(run_file)]


def assert_same_run(a, b):
    (sa, da), (sb, db) = a, b
    result = compare_exports(sa["export_dir"], sb["export_dir"])
    assert result["identical"], result
    assert [c[::2] for c in sa["eval"]["curve"]] == [c[::2] for c in sb["eval"]["curve"]]
    assert sa["eval"]["pass@2"] == sb["eval"]["pass@2"]
    assert sa["ledger"] == sb["ledger"]
    assert trained(da) == trained(db)  # same groups, same attempts, same sampling versions
    assert recordings(da) == recordings(db)  # same tokens, log-probs, rewards and seeds


def test_sync_is_bit_reproducible_and_async_lag0_equals_it(ray_cluster, tmp_path):
    sync_a = run(tmp_path, "cluster_configs/dev.toml", "sync-a", wandb="offline")
    sync_b = run(tmp_path, "cluster_configs/dev.toml", "sync-b", wandb="offline")
    assert_same_run(sync_a, sync_b)
    metrics = exact_metrics(tmp_path, "sync-a")
    assert sum("train/loss" in row for row in metrics) == 4
    assert metrics == exact_metrics(tmp_path, "sync-b")
    # The same config in fully async mode at lag 0 (local.toml differs from dev.toml only in
    # the async settings): nothing generated ahead, nothing discarded, the same weights.
    lag0 = run(tmp_path, "cluster_configs/local.toml", "async-lag0",
               "async.max_weight_staleness=0")
    assert lag0[0]["ledger"]["discarded_groups"] == 0
    assert_same_run(sync_a, lag0)


def test_two_trainer_workers_ddp_lag0_equals_sync(ray_cluster, tmp_path):
    two = ["cluster.trainer_workers=2"]
    sync = run(tmp_path, "cluster_configs/dev.toml", "ddp-sync", *two)
    lag0 = run(tmp_path, "cluster_configs/local.toml", "ddp-lag0", *two,
               "async.max_weight_staleness=0")
    assert_same_run(sync, lag0)


def test_an_async_lag1_run_replays_bit_identically(ray_cluster, tmp_path):
    summary, run_dir = run(tmp_path, "cluster_configs/local.toml", "lag1",
                           "async.max_weight_staleness=1")
    result = replay(str(run_dir), str(tmp_path / "replayed"))
    assert result["collections"] == 4 and result["steps"] == 4
    assert result["identical"], result
    assert result["run_export"] == summary["export_dir"]


def test_a_run_whose_trainer_threads_changed_replays_bit_identically(ray_cluster, tmp_path):
    """A thread count can split CPU reductions (BLAS dot products do here): replay trains
    each collection with the threads it was trained with. The thread balancer changes them
    mid-run; so does a resume with another cluster.trainer_cpus, which this test uses
    because it is deterministic."""
    first = run(tmp_path, "cluster_configs/local.toml", "threads",
                "async.max_weight_staleness=1", "run.max_steps=2")
    cfg = load_config("cluster_configs/local.toml", [
        *SMALL, "run.name=threads", f"run.output_dir={tmp_path}", "wandb.mode=disabled",
        "async.max_weight_staleness=1", "cluster.trainer_cpus=2"])
    out = tmp_path / "resumed.json"
    assert run_training(cfg, validate(cfg), str(out), resume=str(first[1])) == 0
    run_dir = Path(json.loads(out.read_text())["run_dir"])
    steps = [json.loads(line) for line in trained(run_dir)]
    assert [e.get("trainer_threads") for e in steps] == [1, 1, 2, 2]
    result = replay(str(run_dir), str(tmp_path / "replayed"))
    assert result["trainer_threads"] == [1, 1, 2, 2]  # each collection with its own
    assert result["collections"] == 4 and result["identical"], result
