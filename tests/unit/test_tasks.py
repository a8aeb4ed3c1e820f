"""Prompt sources, the built-in task, JSONL loading and verifiers."""

import json

import pytest

from rl_async.plan.load import resolve
from rl_async.algo.stop_ids import stop_token_ids
from rl_async.algo.tasks import (BOS, DIGIT0, EOS, DatasetError, PromptSource, answer_match_reward,
                            final_answer, load_jsonl, successor_prompts, successor_reward)
from rl_async.base.types import Sample


def test_successor_split_is_disjoint_and_covers_every_answer():
    train = successor_prompts(10, 16, 3, "train")
    held = successor_prompts(10, 16, 3, "eval")
    assert len(train) + len(held) == 1000 and len(held) == 100
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held}
    assert {p.metadata["answer_ids"][0] for p in held} == {DIGIT0 + d for d in range(10)}
    p = next(p for p in train if p.prompt_id == "succ1-2-3")
    assert p.prompt_ids == [BOS, DIGIT0 + 1, DIGIT0 + 2, DIGIT0 + 3]
    assert p.metadata["answer_ids"] == [DIGIT0 + 4]


def test_successor_needs_room_in_the_vocabulary():
    with pytest.raises(DatasetError, match="vocab_size = 8"):
        successor_prompts(10, 8)


def test_successor_reward_reads_the_first_token():
    s = Sample("p", metadata={"answer_ids": [DIGIT0 + 4]})
    s.response_ids = [DIGIT0 + 4, EOS]
    assert successor_reward(s) == 1.0
    s.response_ids = [DIGIT0 + 5, DIGIT0 + 4]
    assert successor_reward(s) == 0.0


def test_prompt_source_is_deterministic_in_its_cursor_and_reshuffles_per_epoch():
    prompts = successor_prompts(10, 16, 2, "train")
    a, b = PromptSource(prompts, seed=3), PromptSource(prompts, seed=3)
    assert [a.prompt(c).prompt_id for c in range(200)] == [b.prompt(c).prompt_id for c in range(200)]
    n = len(prompts)
    first = [a.prompt(c).prompt_id for c in range(n)]
    second = [a.prompt(c).prompt_id for c in range(n, 2 * n)]
    assert sorted(first) == sorted(second) and first != second
    group = a.group(5, 4)
    assert group.size == 4 and len({id(s) for s in group.samples}) == 4


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": "x"}\n')
    with pytest.raises(DatasetError, match=r"p.jsonl:2: prompt_ids"):
        load_jsonl(f)
    f.write_text('{"prompt_ids": [1]}\nnot json\n')
    with pytest.raises(DatasetError, match=r"p.jsonl:2: not valid JSON"):
        load_jsonl(f)
    f.write_text('{"prompt": "what is two plus two?"}\n')
    with pytest.raises(DatasetError, match="needs model.path with a tokenizer"):
        load_jsonl(f)
    with pytest.raises(DatasetError, match="file not found"):
        load_jsonl(tmp_path / "missing.jsonl")


class FakeTokenizer:
    chat_template = None

    def encode(self, text):
        return [len(w) for w in text.split()]


def test_jsonl_text_prompts_use_the_tokenizer_and_keep_metadata(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "q1", "prompt": "add two and two", "answer": "4",
                             "source": "gsm"}) + "\n")
    (p,) = load_jsonl(f, FakeTokenizer())
    assert p.prompt_id == "q1" and p.prompt_ids == [3, 3, 3, 3]
    assert p.metadata == {"answer": "4", "source": "gsm"}


@pytest.mark.parametrize("text,answer", [("so the answer is 42.", "42"),
                                         (r"thus \boxed{7} and 9", "7"),
                                         ("1,024 apples", "1024"), ("no numbers", None)])
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_answer_match_reward_needs_decoded_text():
    s = Sample("p", metadata={"answer": "4", "response_text": "2 + 2 = 4"})
    assert answer_match_reward(s) == 1.0
    with pytest.raises(KeyError, match="response_text"):
        answer_match_reward(Sample("p", metadata={"answer": "4"}))


def test_stop_tokens_default_to_the_task_eos_or_the_setting():
    cfg = resolve({"model": {"hf_config": {"model_type": "llama"}}})
    assert stop_token_ids(cfg) == (EOS,)
    cfg = resolve({"model": {"hf_config": {"model_type": "llama"}},
                   "rollout": {"stop_token_ids": [7, 9]}})
    assert stop_token_ids(cfg) == (7, 9)


def test_stop_tokens_unite_config_generation_config_and_tokenizer(tmp_path):
    """Chat models often name their turn terminator only in generation_config.json (Gemma's
    <end_of_turn>): without it a turn would never stop."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 107]}))
    cfg = resolve({"model": {"path": str(tmp_path)}, "task": {"name": "jsonl"}})
    assert stop_token_ids(cfg) == (1, 107)

    class Tok:
        eos_token_id = 106

        def get_added_vocab(self):
            return {"<eos>": 1}

    assert stop_token_ids(cfg, Tok()) == (1, 107, 106)
