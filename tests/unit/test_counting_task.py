"""The built-in task's long-tailed counting variant (task.count_tokens) and per-row response
budgets (a prompt's `max_new_tokens`)."""

import json
from collections import Counter

import pytest

from rl_async.algo.successor import successor_prompts, successor_reward
from rl_async.algo.tasks import DIGIT0, EOS, DatasetError, load_jsonl, response_budget
from rl_async.base.types import Sample
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config


def test_lengths_span_2_to_count_tokens_by_leading_digits_in_both_splits():
    train = successor_prompts(10, 16, 3, "train", count_tokens=16)
    held = successor_prompts(10, 16, 3, "eval", count_tokens=16)
    for split in (train, held):
        assert {p.metadata["count"] for p in split} == set(range(2, 17))
        assert all(p.metadata["max_new_tokens"] == p.metadata["count"] for p in split)
    # The length never depends on the answer digit: every answer meets every length.
    pairs = Counter((p.metadata["answer_ids"][0], p.metadata["count"]) for p in train)
    assert len(pairs) == 10 * 15
    same_lead = [p for p in train if p.prompt_id.startswith("succ4-7-")]
    assert len({p.metadata["count"] for p in same_lead}) == 1
    # Off (0): the plain task's prompts, untouched.
    assert "count" not in successor_prompts(10, 16, 3, "train")[0].metadata


def _sample(response: list[int], n: int, first: int = 8) -> Sample:
    s = Sample("p", metadata={"answer_ids": [DIGIT0 + first], "count": n, "modulus": 10})
    s.response_ids = [DIGIT0 + d if d >= 0 else EOS for d in response]
    return s


def test_counting_reward_is_the_share_counted_right_before_the_first_mistake():
    assert successor_reward(_sample([8, 9, 0, 1], 4)) == 1.0   # wraps at the modulus
    assert successor_reward(_sample([8, 9, 5, 1], 4)) == 0.5   # a mistake ends the count
    assert successor_reward(_sample([8, 9, -1], 4)) == 0.5     # stopped early (EOS)
    assert successor_reward(_sample([7, 8, 9, 0], 4)) == 0.0   # wrong from the start
    assert successor_reward(_sample([8, 9, 0, 1, 2, 3], 4)) == 1.0  # only n tokens count


def test_a_rows_max_new_tokens_caps_its_response_and_is_checked_at_load(tmp_path):
    assert response_budget({}, 16) == 16
    assert response_budget({"max_new_tokens": 5}, 16) == 5
    assert response_budget({"max_new_tokens": 64}, 16) == 16  # rollout.max_response_len wins
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_ids": [1, 5], "max_new_tokens": 3}) + "\n"
                 + json.dumps({"prompt_ids": [1, 6], "max_new_tokens": 0}) + "\n")
    with pytest.raises(DatasetError, match=r"p.jsonl:2: max_new_tokens = 0 must be an int >= 1"):
        load_jsonl(f)


def test_validate_names_the_keys_when_the_count_does_not_fit():
    def errors(*sets):
        return validate(load_config("cluster_configs/dev.toml", list(sets))).errors

    assert not errors("task.count_tokens=16", "rollout.max_response_len=16")
    assert any("task.count_tokens = 16 needs rollout.max_response_len >= 16" in e
               for e in errors("task.count_tokens=16", "rollout.max_response_len=8"))
    assert any("task.count_tokens = 1" in e
               for e in errors("task.count_tokens=1", "rollout.max_response_len=8"))
