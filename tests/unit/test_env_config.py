"""Multi-turn environments in the config, the trainer's batches and the recordings: what
validate refuses, that environment tokens are never trained, and what a recording shows."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from rl_async.base.types import Group, Sample
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.state.rollouts import group_from_dict, rollout_path, write_collection
from rl_async.train.batching import item_from_sample, pack

DEMO = "cluster_configs/multiturn.toml"


def errors(*sets: str) -> list[str]:
    return validate(load_config(DEMO, sets)).errors


def test_the_multiturn_demo_validates_and_mixed_policy_is_refused():
    assert errors() == []
    assert any("refresh.mode = 'mixed_policy' with task.name = 'env'" in e
               for e in errors("refresh.mode=mixed_policy"))


@pytest.mark.parametrize("override, message", [
    ("task.env=examples/envs/nowhere.py:make_env", "file 'examples/envs/nowhere.py' not found"),
    ("task.env=examples/envs/digit_sum.py:nothing", "has no 'nothing'"),
    ("reward.function=rl_async.algo.tasks:successor_reward", "score() (a verifiers"),
    ("rollout.max_prompt_len=16", "max_trajectory_tokens = 16 must exceed"),
])
def test_validate_names_what_is_wrong_with_an_environment_run(override, message):
    assert any(message in e for e in errors(override)), errors(override)


def test_validate_bounds_the_trajectory_by_the_plan_and_the_model():
    unbounded = load_config(DEMO, ())
    unbounded.rollout.max_trajectory_tokens = None
    assert any("needs rollout.max_trajectory_tokens" in e and "context length, 64" in e
               for e in validate(unbounded).errors)
    assert any("max_trajectory_tokens = 100 exceeds the model's context length" in e
               for e in errors("rollout.max_trajectory_tokens=100"))
    # The memory plan sizes a sample as the whole trajectory, not one turn.
    from rl_async.plan.memory import inputs

    cfg = load_config(DEMO, ("rollout.max_prompt_len=4",))
    assert inputs(cfg).prompt_tokens + inputs(cfg).max_response_len == 16
    from rl_async.algo.tasks import engine_prompt_limit

    assert engine_prompt_limit(cfg) == 15  # a later turn sends the whole trajectory


def test_validate_refuses_a_chat_template_with_no_stable_delta(tmp_path):
    moving = tmp_path / "moving.jinja"  # the closing of a reply depends on what follows it
    moving.write_text("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
                      "{{ m['content'] }}{% if loop.last %}{{ eos_token }}{% else %}?"
                      "{% endif %}{% else %}{{ m['content'] }}|{% endif %}{% endfor %}")
    found = errors(f"task.chat_template={moving}")
    assert any("gives no stable token delta" in e and "task.chat_template" in e
               and "user follow-up" in e for e in found), found
    unstopped = tmp_path / "unstopped.jinja"  # turns end with "|", which is no stop token
    unstopped.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}|"
                         "{% endfor %}")
    assert any("not a stop token" in e and "rollout.stop_token_ids" in e
               for e in errors(f"task.chat_template={unstopped}"))
    assert any("task.chat_template = 'nowhere.jinja': file not found" in e
               for e in errors("task.chat_template=nowhere.jinja"))


def test_an_environment_key_without_the_env_task_is_an_error():
    cfg = load_config("cluster_configs/local.toml", ("task.env=examples/envs/digit_sum.py:make_env",))
    assert any("set task.name = 'env'" in e for e in validate(cfg).errors)


def trajectory() -> Sample:
    # prompt [1, 5, 3]; turn 1 sampled [6, 2]; environment [7, 3]; turn 2 sampled [8, 2]
    return Sample(prompt_id="p", prompt_ids=[1, 5, 3], response_ids=[6, 2, 7, 3, 8, 2],
                  behavior_logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3, -0.4],
                  token_versions=[4, 4, -1, -1, 5, 5], loss_mask=[1, 1, 0, 0, 1, 1],
                  turns=2, reward=1.0, finish_reason="done")


def test_environment_tokens_are_context_never_trained():
    item = item_from_sample(trajectory(), 0.5, "group g sample 0")
    assert item.trained_tokens == 4 and item.response_len == 6
    batch = pack([item], "cpu")
    assert batch.mask_BT[0].tolist() == [True, True, False, False, True, True]
    assert batch.input_ids_BL[0].tolist() == [1, 5, 3, 6, 2, 7, 3, 8, 2]  # all are context
    assert batch.versions_BT[0].tolist() == [4, 4, -1, -1, 5, 5]
    assert trajectory().oldest_version() == 4
    bad = trajectory()
    bad.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="2 loss_mask entries for 6 response tokens"):
        item_from_sample(bad, 0.5, "group g sample 0")
    assert torch.equal(batch.advantages_BT[0], torch.full((6,), 0.5))


def test_a_recording_shows_tokens_loss_mask_versions_and_turns(tmp_path):
    single = Sample(prompt_id="q", prompt_ids=[1, 4], response_ids=[9], behavior_logprobs=[-1.0],
                    token_versions=[3], reward=0.0)
    groups = [Group("c0:p", [trajectory()], cursor=0), Group("c1:q", [single], cursor=1)]
    write_collection(tmp_path, 7, 5, groups)
    record = json.loads(gzip.open(rollout_path(tmp_path, 7)).read())
    traj, one = record["groups"][0]["samples"][0], record["groups"][1]["samples"][0]
    assert traj["tokens"] == [1, 5, 3, 6, 2, 7, 3, 8, 2]
    assert traj["loss_mask"] == [1, 1, 0, 0, 1, 1] and traj["versions"] == [4, 4, -1, -1, 5, 5]
    assert traj["turns"] == 2
    assert one["loss_mask"] == [1] and one["versions"] == [3] and one["turns"] == 0
    assert [group_from_dict(g) for g in record["groups"]] == groups  # replay reads it back
