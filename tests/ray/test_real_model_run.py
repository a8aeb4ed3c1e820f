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
