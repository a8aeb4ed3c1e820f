"""Resume details that bent a run without saying so: a changed run.max_steps keeps the lr
schedule's horizon (a cosine jumped to another curve, and replay reported a false mismatch);
intervals that are not multiples of the updates per collection are refused (they were
silently coarsened); the built-in task's keys do not block resuming a JSONL run."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def make(run_dir, step):
    ckpts.staging_dir(run_dir, step).mkdir(parents=True)
    (ckpts.staging_dir(run_dir, step) / "weights.bin").write_bytes(b"w")
    return ckpts.finalize(run_dir, step, {"policy_version": step, "ledger": {}, "config": {}},
                          keep=0)


def test_a_latest_pointer_left_behind_by_a_crash_is_not_trusted(tmp_path):
    run_dir = ckpts.new_run_dir(tmp_path, "r")
    make(run_dir, 10)
    newer = make(run_dir, 20)
    (run_dir / ckpts.LATEST).write_text('"step_000010"')  # the crash before the pointer moved
    assert ckpts.find_checkpoint(tmp_path, "r") == newer


def test_pruning_never_leaves_a_half_deleted_checkpoint_that_looks_complete(tmp_path,
                                                                            monkeypatch):
    run_dir = ckpts.new_run_dir(tmp_path, "r")
    make(run_dir, 10)
    make(run_dir, 20)

    def crash_midway(path, **kw):  # deletes the weights, then the process dies
        (Path(path) / "weights.bin").unlink()
        raise OSError("killed")
    monkeypatch.setattr(ckpts.shutil, "rmtree", crash_midway)
    ckpts.staging_dir(run_dir, 30).mkdir()
    with pytest.raises(OSError, match="killed"):
        ckpts.finalize(run_dir, 30, {"config": {}}, keep=2)  # prunes step 10
    monkeypatch.undo()
    # the half-deleted step 10 left the step_* namespace first: never resumed from
    assert [p.name for p in ckpts.complete_checkpoints(run_dir)] == ["step_000020",
                                                                     "step_000030"]
    assert (run_dir / ".step_000010.deleting").is_dir()
    make(run_dir, 40)  # the next checkpoint finishes the deletion
    assert not (run_dir / ".step_000010.deleting").exists()


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    run_dir = ckpts.new_run_dir(tmp_path, "r")
    for step in (10, 20, 30):
        make(run_dir, step)
    moved = ckpts.abandon_later_checkpoints(run_dir, 10)
    assert [p.name for p in moved] == ["abandoned-step_000020", "abandoned-step_000030"]
    assert ckpts.find_checkpoint(tmp_path, "r").name == "step_000010"


def test_a_torn_last_line_of_the_trained_log_is_dropped_and_a_torn_middle_one_is_named(
        tmp_path):
    run_dir = ckpts.new_run_dir(tmp_path, "r")
    for step in (1, 2):
        ckpts.append_trained(run_dir, step, step - 1, [("c0:p", 0, 0)])
    log = run_dir / ckpts.TRAINED_LOG
    log.write_text(log.read_text() + '{"step": 3, "trained_at_vers')  # a crash mid-append
    ckpts.trim_trained_log(run_dir, 5)
    assert [e["step"] for e in ckpts.read_trained(log)] == [1, 2]
    log.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ckpts.ResumeError, match=r"trained.jsonl:2: not valid JSON"):
        ckpts.read_trained(log)


def test_a_resumed_runs_summary_counts_the_whole_run():
    """Steps and the ledger were cumulative after a resume, but time, throughput, the eval
    curve and the non-finite count started again at zero: the checkpoint now keeps them."""
    import asyncio

    from inprocess_fleet import Disk, InProcessFleet

    from rl_async.loop.controller import Controller
    from rl_async.plan.capacity import plan_capacity
    from rl_async.plan.load import load_config

    def config(steps):
        return load_config("cluster_configs/dev.toml", [
            f"run.max_steps={steps}", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2", "train.global_batch_size=4",
            "train.micro_batch_size=4", "sglang.max_running_requests=2", "eval.every_steps=2",
            "run.checkpoint_every=2", "wandb.mode=disabled"])

    cfg = config(4)
    plan = plan_capacity(cfg)[0]
    disk = Disk()
    first = asyncio.run(Controller(cfg, plan, InProcessFleet(cfg, plan, disk, 0),
                                   lambda m, s: None).run())
    saved = disk.checkpoints[-1]
    longer = config(8)
    resume = {"step": saved["step"], "version": saved["version"], "ledger": saved["ledger"]}
    second = asyncio.run(Controller(longer, plan, InProcessFleet(longer, plan, disk, 1, resume),
                                    lambda m, s: None, start_step=saved["step"],
                                    start_version=saved["version"],
                                    resumed=saved["progress"]).run())
    assert second["steps"] == 8
    assert second["throughput"]["trained_samples"] == 8 * 4  # not only the 4 resumed steps
    assert second["eval"]["curve"][:len(first["eval"]["curve"])] == first["eval"]["curve"]
    assert second["eval"]["initial_reward"] == first["eval"]["initial_reward"]
    assert second["wall_seconds"] >= saved["progress"]["wall_seconds"]
    assert second["eval"]["curve"][-1][1] >= first["eval"]["curve"][-1][1]
