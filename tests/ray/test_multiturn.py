"""A multi-turn run on real actors (SPEC §12): the demo's environment, a short async run, and
what was trained read back from the recording, decoded span by span."""

import json
from itertools import groupby
from pathlib import Path

import pytest

from launch.run import run_training
from rl_async.algo.chat import digit_tokenizer
from rl_async.plan.checks import validate
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config
from rl_async.sim.calibrate import sim_timings
from rl_async.sim.run import simulate
from rl_async.state.rollouts import read_collection

pytestmark = pytest.mark.ray

ROWS = Path(__file__).resolve().parents[2] / "data" / "digit_sum" / "rows.jsonl"


def spans(sample):
    """(masked?, token ids) runs of a sample's response, in order."""
    pairs = zip(sample.loss_mask, sample.response_ids, sample.token_versions,
                sample.behavior_logprobs)
    return [(m, list(run)) for m, run in groupby(pairs, key=lambda p: p[0])]


# make_env: our protocol (reset/step/score). make_agent_env: the same game running its own
# loop through the gateway with a real openai client, inside the producer actor. vf_digits:
# the same game as a verifiers MultiTurnEnv (tests/vf_digits.py), its rubric the reward.
ENVS = {"protocol": ["task.env=examples/envs/digit_sum.py:make_env"],
        "gateway": ["task.env=examples/envs/digit_sum.py:make_agent_env"],
        "verifiers": ["task.name=verifiers", "task.env=vf_digits", "task.env_args={}",
                      "task.path="]}


@pytest.mark.parametrize("env", list(ENVS))
def test_multiturn_run_records_sampled_and_environment_tokens_apart(ray_cluster, tmp_path, env):
    cfg = load_config("cluster_configs/multiturn.toml", [*ENVS[env],
        "run.max_steps=3", "wandb.mode=disabled", "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
        "train.micro_batch_size=16", "task.num_eval_prompts=8", "run.record_rollouts=true",
        "sglang.max_running_requests=8", "run.name=t-multiturn", f"run.output_dir={tmp_path}"])
    out = tmp_path / "summary.json"
    assert run_training(cfg, validate(cfg), str(out)) == 0
    summary = json.loads(out.read_text())
    assert summary["ledger"]["unaccounted"] == 0 and summary["steps"] == 3
    rollout = summary["rollout"]
    # Every trajectory plays both digits (2 turns), none hits a budget, the env is timed.
    # (verifiers ends a rollout at an empty reply, EmptyModelResponseError: 1 turn, trained.)
    assert rollout["trajectories"] >= 3 * 16
    assert rollout["turns_mean"] == 2.0 or (env == "verifiers" and rollout["turns_mean"] > 1.5)
    assert rollout["truncated_fraction"] == 0.0 and rollout["env_seconds_mean"] > 0

    # The calibration carries the turn structure, and the simulator plays it back.
    turns = summary["calibration"]["turns"]
    assert turns["turns_mean"] > 1.5 and turns["env_tokens_per_gap"] > 0
    timings = sim_timings(cfg, summary["calibration"])
    predicted = simulate(cfg, plan_capacity(cfg)[0], timings, steps=2)
    assert abs(predicted["rollout"]["turns_mean"] - turns["turns_mean"]) < 0.25

    tok = digit_tokenizer()
    digits = [r["digits"] for r in map(json.loads, ROWS.read_text().splitlines())]
    run_dir = Path(summary["run_dir"])
    for step in (1, 2, 3):
        version, groups = read_collection(run_dir, step)
        for sample in (s for g in groups for s in g.samples):
            # row ids: "ds-07" (our rows), "7" (verifiers' example_id): the file's 8th row
            first, second = digits[int(sample.prompt_id.split("-")[-1])]
            if sample.turns == 1:  # verifiers' empty reply (special tokens only), trained
                assert env == "verifiers"
                assert tok.decode(sample.response_ids, skip_special_tokens=True) == ""
                continue
            assert sample.turns == 2
            # The prompt is the template's first user turn: BOS, the first digit, "|".
            assert tok.decode(sample.prompt_ids) == f"<s>{first}|"
            runs = spans(sample)
            # sampled (turn 1) | environment (the second digit) | sampled (turn 2)
            assert [m for m, _ in runs] == [1, 0, 1], runs
            for masked, run in runs:
                versions = [v for _, _, v, _ in run]
                if masked == 0:
                    # The env's message as the template renders it, context only.
                    text = tok.decode([t for _, t, _, _ in run])
                    # (a turn cut at max_response_len is closed by the template: "</s>")
                    assert text in (f"{second}|", f"</s>{second}|"), text
                    assert versions == [-1] * len(run)
                    assert all(lp == 0.0 for *_, lp in run)
                else:  # engine tokens with their sampling versions
                    assert all(0 <= v <= version for v in versions)
                    assert all(lp <= 0.0 for *_, lp in run)
