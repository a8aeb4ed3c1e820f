"""Math answers (task.name = "math") are compared by math-verify, not by string: nested
braces, fractions, 0.5 vs \\frac{1}{2}, 3.0 vs 3, thousands separators, units, and wrong
answers; the plain reward reads nested \\boxed{} whole; validate requires the extra."""

from __future__ import annotations

import pytest

from rl_async.algo.math_reward import math_reward
from rl_async.algo.tasks import answer_match_reward, final_answer
from rl_async.base.types import Sample


def graded(answer: str, response: str, reward=math_reward) -> float:
    return reward(Sample(prompt_id="p", prompt_ids=[1], response_ids=[2],
                         metadata={"answer": answer, "response_text": response}))


@pytest.mark.parametrize("answer,response", [
    ("\\frac{1}{2}", "So the probability is \\boxed{\\frac{1}{2}}."),
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("1/2", "The answer is $0.5$"),
    ("3", "Therefore \\boxed{3.0}"),
    ("1000", "It costs 1,000 dollars."),
    ("5", "The side is \\boxed{5\\text{ cm}}"),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{\\sqrt{2}}{2}}"),
])
def test_equivalent_answers_score(answer, response):
    assert graded(answer, response) == 1.0


@pytest.mark.parametrize("answer,response", [
    ("\\frac{1}{2}", "\\boxed{2}"),     # the old regex read \boxed{\frac{1}{2}} as "2"
    ("2", "\\boxed{\\frac{1}{2}}"),
    ("7", "I think it is 8."),
    ("7", "no answer here"),
])
def test_wrong_answers_do_not(answer, response):
    assert graded(answer, response) == 0.0


def test_the_plain_reward_reads_nested_boxes_whole():
    assert final_answer("so \\boxed{\\frac{1}{2}} is it") == "\\frac{1}{2}"
    assert final_answer("\\boxed{3} then \\boxed{x^{2}}") == "x^{2}"
    assert final_answer("unclosed \\boxed{\\frac{1}{2} and 7") == "7"
    assert graded("2", "\\boxed{\\frac{1}{2}}", answer_match_reward) == 0.0


def test_an_unreadable_gold_answer_is_an_error_naming_the_prompt():
    with pytest.raises(ValueError, match="prompt 'p': math-verify cannot read its answer"):
        graded("", "\\boxed{1}")


def test_validate_requires_the_math_extra(monkeypatch, tmp_path):
    from rl_async.algo import math_reward as module
    from rl_async.plan.checks import validate
    from rl_async.plan.load import load_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt_ids": [1, 2], "answer": "3"}\n')
    cfg = load_config("cluster_configs/local.toml", ["task.name=math", f"task.path={rows}"])
    assert validate(cfg).ok
    monkeypatch.setattr(module, "available", lambda: False)
    assert any("task.name = 'math' grades answers with math-verify" in e
               for e in validate(cfg).errors)
