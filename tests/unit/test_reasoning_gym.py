"""task.name = "reasoning_gym" against the real library: prompts from its generator through
SmolLM2's real chat template, held-out questions kept out of training, the dataset's own
score_answer as the reward, and what validate says about a wrong dataset or table."""

from __future__ import annotations

import pytest

from rl_async.algo.reasoning_gym_task import reasoning_gym_reward
from rl_async.algo.tasks import build_prompts
from rl_async.base.types import Sample
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from real_model import smollm2_dir, smollm2_tokenizer

SETS = ["task.name=reasoning_gym", "task.dataset=basic_arithmetic", "task.num_eval_prompts=20",
        "task.dataset_config={size = 120, min_terms = 2, max_terms = 2, min_digits = 1, "
        "max_digits = 1}", "task.eval_path=", "task.path="]


def cfg(*extra: str):
    return load_config("cluster_configs/smollm2.toml",
                       [*SETS, f"model.path={smollm2_dir()}", *extra])


def test_prompts_come_from_the_generator_and_held_out_questions_never_train():
    c = cfg()
    tok = smollm2_tokenizer()
    train = build_prompts(c.task, len(tok), "train", tok, seed=3)
    held = build_prompts(c.task, len(tok), "eval", tok, seed=3)
    assert len(held) == 20 and 0 < len(train) <= 100
    assert not {p.metadata["question"] for p in held} & {p.metadata["question"] for p in train}
    text = tok.decode(held[0].prompt_ids)
    assert "<answer>answer here</answer>" in text and held[0].metadata["question"] in text
    assert text.endswith("<|im_start|>assistant\n")  # the real template's generation prompt
    # Seeded from run.seed: the same seed gives the same questions, another seed others (the
    # held-out ones are chosen by content, so a small question space can share them)
    again = build_prompts(c.task, len(tok), "eval", tok, seed=3)
    other = build_prompts(c.task, len(tok), "train", tok, seed=4)
    assert [p.metadata["question"] for p in again] == [p.metadata["question"] for p in held]
    assert [p.metadata["question"] for p in other] != [p.metadata["question"] for p in train]


def test_the_reward_is_the_datasets_own_score_answer():
    tok = smollm2_tokenizer()
    prompt = build_prompts(cfg().task, len(tok), "eval", tok, seed=0)[0]
    answer = prompt.metadata["answer"]

    def score(text):
        return reasoning_gym_reward(Sample(prompt_id=prompt.prompt_id, prompt_ids=[],
                                           metadata={**prompt.metadata, "response_text": text}))

    assert score(f"Thinking... <answer>{answer}</answer>") == 1.0
    assert score(f"<answer>{int(answer) + 1}</answer>") == 0.0
    assert score(f"The result is\n{answer}") == 1.0   # no tags: the last line is the answer
    assert score("") == 0.0
    with pytest.raises(KeyError, match="rg_entry"):
        reasoning_gym_reward(Sample(prompt_id="x", prompt_ids=[],
                                    metadata={"response_text": "1"}))


@pytest.mark.parametrize("override, message", [
    ("task.dataset=basic_arithmetik", "'basic_arithmetik' is not a reasoning-gym dataset"),
    ("task.dataset_config={min_terms = 0}", "task.dataset_config = {'min_terms': 0}"),
    ("task.dataset_config={size = 10}", "size = 10 <= task.num_eval_prompts = 20"),
    ("model.path=", "needs model.path"),
])
def test_validate_names_a_wrong_dataset_or_table(override, message):
    errors = validate(cfg(override)).errors
    assert any(message in e for e in errors), errors


def test_the_task_validates():
    assert validate(cfg()).errors == []


def test_the_reward_scores_with_the_configured_dataset_not_the_default():
    """decimal_arithmetic's scorer allows an error of one unit in the configured last decimal
    place: with max_num_decimal_places = 1, an answer 0.04 off is right. The library's
    default-config scorer (get_score_answer_fn) would call it wrong."""
    tok = smollm2_tokenizer()
    c = cfg("task.dataset=decimal_arithmetic",
            "task.dataset_config={size = 40, min_num_decimal_places = 1, "
            "max_num_decimal_places = 1}")
    prompt = build_prompts(c.task, len(tok), "eval", tok, seed=0)[0]
    near = str(float(prompt.metadata["answer"]) + 0.04)
    sample = Sample(prompt_id=prompt.prompt_id, prompt_ids=[],
                    metadata={**prompt.metadata, "response_text": f"<answer>{near}</answer>"})
    assert reasoning_gym_reward(sample) == 1.0
    import reasoning_gym

    default = reasoning_gym.get_score_answer_fn("decimal_arithmetic")
    assert default(near, prompt.metadata["rg_entry"]) == 0.0
