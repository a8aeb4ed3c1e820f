"""A real pretrained instruct model end to end on real actors: chat-template prompts from the
shipped JSONL task, dynamic sampling, pass@k eval, checksum-verified publication, and an
export that `from_pretrained` loads with exactly the trainer's weights."""

import json
import subprocess
import sys

import pytest
import torch

from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from real_model import smollm2_dir

pytestmark = pytest.mark.ray


def test_smollm2_run_trains_and_exports_a_loadable_model(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config("cluster_configs/smollm2.toml", [
        f"model.path={smollm2_dir()}", f"run.output_dir={tmp_path}", "run.name=t-smol",
        "run.max_steps=2", "wandb.mode=disabled", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
        "train.micro_batch_size=8", "task.num_eval_prompts=4", "eval.n_samples=2",
        "publication.verify_checksum=true"])
    report = validate(cfg)
    assert report.ok, report.errors
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    summary = json.loads(out.read_text())
    ledger = summary["ledger"]
    assert summary["steps"] == 2 and ledger["unaccounted"] == 0
    assert ledger["in_flight_groups"] == 0 and ledger["delivered_groups"] == 4
    assert ledger["filtered_groups"] >= 0 and "pass@2" in summary["eval"]
    # The export holds exactly the final trainer weights (the checkpoint's fp32 state).
    export = summary["export_dir"]
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    state = torch.load(f"{export}/../trainer_state.pt", map_location="cpu", weights_only=False)
    theirs = model.state_dict()
    assert set(theirs) == set(state["model"])
    assert all(torch.equal(theirs[n], t) for n, t in state["model"].items())
    assert state["step"] == 2
    # Tokenizer and chat template travel with it, so the export is usable as is.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert tok.chat_template and model.generation_config.eos_token_id == tok.eos_token_id
    # `rl-async export` of the same checkpoint gives the same weights.
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "export", f"{export}/..",
                           str(tmp_path / "again")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", local_files_only=True)
    assert all(torch.equal(again.state_dict()[n], t) for n, t in theirs.items())


SMALL = ["run.max_steps=3", "wandb.mode=disabled", "rollout.rollout_batch_size=2",
         "rollout.n_samples_per_prompt=4", "train.global_batch_size=8",
         "train.micro_batch_size=8", "task.num_eval_prompts=4", "eval.n_samples=1",
         "filter.zero_variance=false"]


def test_smollm2_with_a_calculator_tool_trains_3_updates_and_exports(ray_cluster, tmp_path):
    """Our environment protocol with a tool message, on the real model and template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config("cluster_configs/smollm2.toml", [
        f"model.path={smollm2_dir()}", f"run.output_dir={tmp_path}", "run.name=t-tool", *SMALL,
        "task.name=env", "task.env=examples/envs/calculator.py:make_env",
        "task.env_args={hint = true}",
        "rollout.max_trajectory_tokens=192", "rollout.max_response_len=12",
        "run.record_rollouts=true"])
    report = validate(cfg)
    assert report.ok, report.errors
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 3 and summary["ledger"]["unaccounted"] == 0
    # hint: a first reply without a call gets the tool's result and a second turn.
    assert summary["rollout"]["trajectories"] >= 24 and summary["rollout"]["turns_mean"] > 1
    model = AutoModelForCausalLM.from_pretrained(summary["export_dir"], local_files_only=True)
    assert model.config.vocab_size > 1000
    # The recording holds what was trained: a tool turn's tokens are masked, never trained.
    from rl_async.state.rollouts import read_collection
    from pathlib import Path

    _, groups = read_collection(Path(summary["run_dir"]), 3)
    samples = [s for g in groups for s in g.samples]
    tok = AutoTokenizer.from_pretrained(summary["export_dir"], local_files_only=True)
    two = [s for s in samples if s.turns == 2]
    assert two
    for s in two:  # the tool's message sits between the turns, masked
        assert len(s.loss_mask) == len(s.response_ids) and 0 in s.loss_mask
        masked = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
        assert "<|im_start|>tool\ncalculator: " in masked


def test_smollm2_on_a_reasoning_gym_dataset(ray_cluster, tmp_path):
    cfg = load_config("cluster_configs/smollm2.toml", [
        f"model.path={smollm2_dir()}", f"run.output_dir={tmp_path}", "run.name=t-rg", *SMALL,
        "run.max_steps=2", "task.name=reasoning_gym", "task.dataset=basic_arithmetic",
        "task.dataset_config={size = 200, min_terms = 2, max_terms = 2, min_digits = 1, "
        "max_digits = 1}", "task.path=", "task.eval_path=", "rollout.max_response_len=24"])
    report = validate(cfg)
    assert report.ok, report.errors
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 2 and summary["ledger"]["unaccounted"] == 0
    assert 0.0 <= summary["eval"]["final_reward"] <= 1.0
