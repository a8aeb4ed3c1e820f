"""Resume details that bent a run without saying so: a changed run.max_steps keeps the lr
schedule's horizon (a cosine jumped to another curve, and replay reported a false mismatch);
intervals that are not multiples of the updates per collection are refused (they were
silently coarsened); the built-in task's keys do not block resuming a JSONL run."""

from __future__ import annotations

from launch.run import resolve_resume
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.state import checkpoints as ckpts


def checkpoint(tmp_path, cfg):
    run_dir = ckpts.new_run_dir(tmp_path, cfg.run.name)
    ckpts.staging_dir(run_dir, 10).mkdir(parents=True)
    return ckpts.finalize(run_dir, 10, {"policy_version": 10, "ledger": {},
                                        "config": cfg.to_dict()}, keep=0)


def test_a_longer_resumed_run_keeps_its_lr_schedule(tmp_path):
    cfg = load_config("cluster_configs/dev.toml", [f"run.output_dir={tmp_path}",
                                                   "train.lr_schedule=cosine"])
    path = checkpoint(tmp_path, cfg)
    longer = load_config("cluster_configs/dev.toml", [f"run.output_dir={tmp_path}",
                                                      "train.lr_schedule=cosine",
                                                      "run.max_steps=600"])
    resumed, _, resume = resolve_resume(longer, str(path))
    assert resume.step == 10 and resumed.run.max_steps == 600
    assert resumed.train.lr_schedule_steps == cfg.run.max_steps
    # on purpose: an explicit horizon is kept as given
    chosen = load_config("cluster_configs/dev.toml", [f"run.output_dir={tmp_path}",
                                                      "run.max_steps=600",
                                                      "train.lr_schedule_steps=600"])
    assert resolve_resume(chosen, str(path))[0].train.lr_schedule_steps == 600


def test_intervals_must_be_multiples_of_the_updates_per_collection():
    cfg = load_config("cluster_configs/dev.toml", ["train.global_batch_size=64",
                                                   "run.checkpoint_every=25",
                                                   "eval.every_steps=10", "run.max_steps=301"])
    errors = validate(cfg).errors
    assert any(e.startswith("run.checkpoint_every = 25 is not a multiple of the 2") for e in errors)
    assert any(e.startswith("run.max_steps = 301") for e in errors)
    assert not any(e.startswith("eval.every_steps") for e in errors)


def test_the_built_in_tasks_keys_do_not_block_a_jsonl_resume():
    saved = {"task": {"name": "jsonl", "modulus": 10}, "run": {"seed": 0}}
    now = {"task": {"name": "jsonl", "modulus": 12}, "run": {"seed": 0}}
    assert ckpts.incompatible_changes(saved, now) == []
    succ = [{"task": {"name": "successor", "modulus": m}, "run": {"seed": 0}} for m in (10, 12)]
    assert any("task.modulus" in c for c in ckpts.incompatible_changes(*succ))
