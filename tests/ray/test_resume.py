"""Durable runs on real actors: SIGKILL the driver mid-run, no orphan goes on, resume ends
where the run should, with no prompt trained twice (rl_async.state.checkpoints)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rl_async.state import checkpoints as ckpts
pytestmark = pytest.mark.ray

# Enough updates that the kill (after the second checkpoint) lands mid-run: with 8, a fast
# run could finish first and the resume would have nothing left to train. dev.toml makes
# an update in ~65 ms here, and a loaded CI machine let 30 of them pass before the kill, so
# both runs last tens of seconds; the poll below is tight for the same reason.
STEPS = 300
STEPS_OF = {"dev.toml": STEPS, "multiturn.toml": 300}
ARGS = ["run.checkpoint_every=1", "wandb.mode=disabled",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16", "train.micro_batch_size=16", "task.num_eval_prompts=8",
        "sglang.max_running_requests=8", "run.keep_checkpoints=2"]


AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}


def cli(out: Path, *extra: str, config: str = "dev.toml") -> list[str]:
    sets = [a for kv in [*ARGS, f"run.max_steps={STEPS_OF[config]}", f"run.output_dir={out}",
                         "run.name=t-resume"]
            for a in ("--set", kv)]
    return [sys.executable, "-m", "launch.cli", "run", f"cluster_configs/{config}", *sets, *extra]


def env():
    return {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def run_dirs(out: Path) -> list[Path]:
    return sorted((out / "t-resume").glob("run-*"))


# dev.toml: synchronous, single-turn. multiturn.toml: fully async, two-turn trajectories
# against an environment, so the kill lands with trajectories between turns in flight.
@pytest.mark.parametrize("config", ["dev.toml", "multiturn.toml"])
def test_sigkilled_driver_leaves_no_orphans_and_resume_trains_each_prompt_once(tmp_path, config):
    driver = subprocess.Popen(cli(tmp_path, config=config), env=env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dirs(tmp_path) and len(ckpts.complete_checkpoints(run_dirs(tmp_path)[0])) >= 2):
            assert driver.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint after 240 s"
            time.sleep(0.02)
        family = psutil.Process(driver.pid).children(recursive=True)
        driver.send_signal(signal.SIGKILL)  # mid-collection: step 3 is being generated/trained
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
    run_dir = run_dirs(tmp_path)[0]
    # No orphans: every actor of the run, and the raylet and GCS the driver started, go
    # with it. (Ray's per-node dashboard and runtime-env agents can outlive a SIGKILLed
    # local head for a while; they run nothing of the run, and are stopped here by pid.)
    agents = [p for p in family if p.name() in AGENTS]
    gone, alive = psutil.wait_procs([p for p in family if p not in agents], timeout=60)
    assert not alive, alive
    for p in agents:
        if p.is_running():
            p.kill()
    written = {p.name for p in run_dir.iterdir()}
    time.sleep(3)
    assert {p.name for p in run_dir.iterdir()} == written  # nobody writes checkpoints now
    last = ckpts.complete_checkpoints(run_dir)[-1]
    killed_at = ckpts.load_meta(last)["step"]
    steps = STEPS_OF[config]
    assert killed_at < steps  # the kill landed mid-run

    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(cli(tmp_path, "--resume", "--summary-json", str(summary_path),
                              config=config), env=env(), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["resumed_from"] == {"step": killed_at, "path": str(last)}
    assert summary["steps"] == steps and summary["policy_version"] == steps
    assert summary["run_dir"] == str(run_dir)  # the same run continues in its directory
    ledger = summary["ledger"]
    assert ledger["unaccounted"] == 0
    # (an async run stops with its next groups in flight: resident in the ledger, not lost)
    assert ledger["in_flight_groups"] == 0 or config != "dev.toml"
    assert ledger["delivered_groups"] == steps * 4  # cumulative over the run
    # The trained log of the surviving lineage: every step once, every prompt once.
    rows = [json.loads(line) for line in (run_dir / ckpts.TRAINED_LOG).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    cursors = [int(g[0].split(":")[0][1:]) for r in rows for g in r["groups"]]
    assert len(cursors) == len(set(cursors)) == steps * 4
    if config == "dev.toml":  # synchronous: the stream continues where the checkpoint says
        assert sorted(cursors) == list(range(steps * 4))
    else:  # the environment played every trained trajectory to its end: two turns each
        assert summary["rollout"]["turns_mean"] == 2.0
        assert summary["rollout"]["truncated_fraction"] == 0.0
    assert Path(summary["export_dir"]).parent.name == ckpts.step_name(steps)


def test_resume_refuses_a_breaking_config_change_and_a_missing_checkpoint(tmp_path):
    proc = subprocess.run(cli(tmp_path, "--resume"), env=env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "no complete checkpoint under" in proc.stderr
    run_dir = ckpts.new_run_dir(tmp_path, "t-resume")
    staged = ckpts.staging_dir(run_dir, 3)
    staged.mkdir()
    from rl_async.plan.load import load_config

    cfg = load_config("cluster_configs/dev.toml",
                      [*ARGS, f"run.max_steps={STEPS}", f"run.output_dir={tmp_path}",
                       "run.name=t-resume"])
    ckpts.finalize(run_dir, 3, {"policy_version": 3, "ledger": {}, "config": cfg.to_dict()}, 0)
    # twice the samples per collection: a global batch to match keeps one update per
    # collection (validate refuses a checkpoint interval that steps would skip over)
    proc = subprocess.run(cli(tmp_path, "--resume", "--set", "rollout.n_samples_per_prompt=8",
                              "--set", "train.global_batch_size=32"),
                          env=env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert "rollout.n_samples_per_prompt = 8 but the checkpoint was written with 4" in proc.stderr


def test_resume_refuses_a_changed_prompt_stream(tmp_path):
    """The held-out split shapes the training list the ledger's cursors index: resuming with
    another task.num_eval_prompts would train some prompts twice and move held-out rows into
    training. The run refuses, naming the key, before any engine loads."""
    rows = tmp_path / "digits.jsonl"  # digit prompts: no tokenizer needed
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"{i % 10}{i // 10 % 10}{i % 7}",
                                        "answer": str((i + 1) % 10)}) + "\n" for i in range(40)))
    task = ["--set", "task.name=jsonl", "--set", f"task.path={rows}",
            "--set", "reward.function=rl_async.algo.tasks:exact_match_reward",
            "--set", "run.max_steps=2"]
    first = subprocess.run(cli(tmp_path, *task), env=env(), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    same = subprocess.run(cli(tmp_path, *task, "--set", "run.max_steps=3", "--resume"),
                          env=env(), capture_output=True, text=True)
    assert same.returncode == 0, same.stderr[-3000:]
    changed = subprocess.run(cli(tmp_path, *task, "--set", "run.max_steps=4",
                                 "--set", "task.num_eval_prompts=6", "--resume"),
                             env=env(), capture_output=True, text=True)
    assert changed.returncode != 0
    assert "training prompt list differs" in changed.stderr, changed.stderr[-3000:]
    assert "task.num_eval_prompts = 6 (the checkpoint has 8)" in changed.stderr
