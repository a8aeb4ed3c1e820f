"""The CLI through a subprocess, and every shipped cluster config."""

import json

from rl_async.plan.config import PROFILES
import subprocess
import sys
from pathlib import Path

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.load import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "cluster_configs").glob("*.toml"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_all_four_cluster_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"local", "dev", "node", "three_node"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_cluster_config_loads_and_validates(path):
    cfg = load_config(path)
    report = validate(cfg)
    assert report.ok, report.errors
    # Each profile has its file; other demos (smollm2: a real model on CPU) use `local`.
    assert cfg.run.profile == (path.stem if path.stem in PROFILES else "local")


def test_plan_json_contract():
    out = cli("plan", "cluster_configs/node.toml", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    cap = doc["runtime"]["async_capacity"]
    for key in ["engines", "max_running_requests", "server_concurrency", "http_slots",
                "engine_slots", "requested_slots", "group_size", "collection_samples",
                "producer_samples", "producer_groups", "completed_buffer_groups",
                "completed_buffer_samples", "max_weight_staleness", "global_batch_size",
                "optimizer_steps_per_collection"]:
        assert isinstance(cap[key], int) and not isinstance(cap[key], bool), key
    assert cap["submission_granularity"] == "sample"
    assert cap["engines"] == 4 and cap["producer_samples"] == 512
    assert isinstance(doc["warnings"], list)


def test_plan_table_and_set():
    out = cli("plan", "cluster_configs/node.toml", "--set", "cluster.inference_gpus=8")
    assert out.returncode == 0, out.stderr
    assert "engines" in out.stdout and "8" in out.stdout


def test_validate_warning_exits_zero(tmp_path):
    out = cli("validate", "cluster_configs/node.toml", "--set", "async.async_max_concurrent_samples=30")
    assert out.returncode == 0
    assert "warning GROUP_ROUNDING" in out.stdout


def test_validate_invalid_exits_two_with_one_line_per_error():
    out = cli("validate", "cluster_configs/node.toml", "--set", "async.max_weigth_staleness=2",
              "--set", "cluster.gpus_per_engine=3")
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
    assert any("async.max_weigth_staleness: unknown key" in l for l in lines)


def test_validate_semantic_errors_one_line_each():
    out = cli("validate", "cluster_configs/node.toml", "--set", "cluster.gpus_per_engine=3",
              "--set", "async.async_max_concurrent_samples=0")
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 2
    assert any("cluster.gpus_per_engine = 3" in l for l in lines)
    assert any("async.async_max_concurrent_samples = 0" in l for l in lines)


def test_plan_on_invalid_file_exits_two(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[model]\nhf_config = {model_type="llama"}\n[async]\nmax_weight_staleness = 1\n'
                 '[miles]\nmax_weight_staleness = 2\n')
    out = cli("plan", str(f), "--json")
    assert out.returncode == 2
    assert "async.max_weight_staleness = 1" in out.stderr and "miles.max_weight_staleness = 2" in out.stderr


def test_replay_names_what_is_missing(tmp_path):
    out = cli("replay", str(tmp_path))
    assert out.returncode == 2 and "not a complete checkpoint" in out.stderr
    # A run made without run.record_rollouts: refused before any actor starts, naming the
    # missing file and the key that records it.
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    config = load_config("cluster_configs/local.toml").to_dict()
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "policy_version": 1,
                                                "config": config, "ledger": {}}))
    (tmp_path / "trained.jsonl").write_text(json.dumps(
        {"step": 1, "trained_at_version": 0, "groups": [["c0:x", 0, 0]]}) + "\n")
    out = cli("replay", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert "step_000001.json.gz" in out.stderr and "run.record_rollouts = true" in out.stderr


def test_a_missing_dataset_is_a_warning_to_plan_and_an_error_before_a_run(tmp_path):
    """A dataset path that does not exist used to surface only after engines and trainers
    had loaded; `run` now refuses before starting anything, naming the key."""
    import subprocess
    import sys

    sets = ["--set", "task.name=jsonl", "--set", f"task.path={tmp_path}/nope.jsonl"]
    plan = subprocess.run([sys.executable, "-m", "launch.cli", "validate",
                           "cluster_configs/local.toml", *sets],
                          capture_output=True, text=True)
    assert plan.returncode == 0 and "MISSING_PATH" in plan.stdout + plan.stderr
    run = subprocess.run([sys.executable, "-m", "launch.cli", "run",
                          "cluster_configs/local.toml", *sets], capture_output=True, text=True)
    assert run.returncode == 2
    assert f"task.path = '{tmp_path}/nope.jsonl': no such file" in run.stderr
    assert "Started a local Ray instance" not in run.stderr  # refused before any actor
