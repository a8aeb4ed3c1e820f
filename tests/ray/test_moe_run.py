"""A tiny Qwen3-MoE (and a dense Qwen3) with the real Qwen3 tokenizer and chat template, end
to end on real actors with routing replay: the engine records the experts of every token, the trainer
replays them, recordings carry them, the summary reports them, and the export loads as the
same architecture with weights that moved.

The prompts are the shipped arithmetic task through Qwen3's chat template. A random model
over 151,936 tokens never writes the right number, so the reward here is the parity of the
first response token (tests/moe_rewards.py): random, so groups have a spread and the
weights move. Learning is shown by the 16-token demo (cluster_configs/qwen3_moe.toml)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from launch.replay import replay
from launch.run import run_training
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.state.tokenizers import cached_tokenizer

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "qwen3-tiny"])
def test_a_tiny_qwen3_trains_with_routing_replay_and_exports(ray_cluster, tmp_path, name):
    """Qwen3-MoE with routing replay ("auto" -> r3), and dense Qwen3 (nothing to replay)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_async.state.prepare_model import prepare_random

    if cached_tokenizer("qwen3") is None:
        pytest.skip("the qwen3 tokenizer is not in the cache: rl-async prepare-tokenizer qwen3")
    start = prepare_random(name, tmp_path / "model")
    moe = name == "qwen3-moe-tiny"
    cfg = load_config("cluster_configs/smollm2.toml", [
        f"model.path={start}", f"run.output_dir={tmp_path}", "run.name=t-moe",
        "run.max_steps=3", "wandb.mode=disabled", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_response_len=4",
        "train.global_batch_size=8", "train.micro_batch_size=8", "train.lr=1e-3",
        "task.num_eval_prompts=4", "eval.n_samples=1", "filter.zero_variance=false",
        "reward.function=moe_rewards:first_token_parity", "run.record_rollouts=true"])
    report = validate(cfg)
    assert report.ok, report.errors
    out = tmp_path / "summary.json"
    assert run_training(cfg, report, str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 3 and summary["ledger"]["unaccounted"] == 0
    routing = summary["routing"]
    assert routing["moe"] == routing["replay"] == moe, routing
    export = summary["export_dir"]
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    assert AutoTokenizer.from_pretrained(export, local_files_only=True).chat_template
    before = AutoModelForCausalLM.from_pretrained(start, local_files_only=True).state_dict()
    moved = [n for n, t in model.state_dict().items() if not torch.equal(t, before[n])]
    assert any("self_attn" in n for n in moved), moved
    if not moe:
        assert routing["replayed_tokens"] == 0
        return
    assert any("experts" in n for n in moved) and any("mlp.gate" in n for n in moved), moved
    assert routing["replayed_tokens"] == 3 * 8 * 4 and routing["unreplayed_tokens"] == 0
    assert routing["agreement"] > 0.5  # same weights bar the updates and a kernel's rounding
    # on-policy tokens: the engine's own function, to float rounding, with its experts
    assert routing["logprob_mismatch_replay"] < 1e-4, routing
    assert routing["logprob_mismatch_replay"] <= routing["logprob_mismatch_own"] + 1e-6

    # Recordings: per response token, [MoE layers][top-k] expert ids within range.
    run_dir = summary["run_dir"]
    with gzip.open(f"{run_dir}/rollouts/step_000001.json.gz") as f:
        recorded = json.loads(f.read())
    sample = recorded["groups"][0]["samples"][0]
    routed = sample["routed_experts"]
    assert len(routed) == len(sample["response_ids"])
    assert all(len(layers) == 2 and all(len(k) == 2 and all(0 <= e < 8 for e in k)
                                        for k in layers) for layers in routed)
    assert len(sample["prompt_routed_experts"]) == len(sample["prompt_ids"]) - 1
    # ... and `rl-async replay` trains them again, experts replayed, to the same weights.
    result = replay(run_dir, str(tmp_path / "replayed"))
    assert result["steps"] == 3 and result["identical"], result
