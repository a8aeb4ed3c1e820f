"""Text prompts through a REAL pretrained tokenizer and chat template (SmolLM2-135M-Instruct)."""

import json

import pytest

from rl_async.algo.tasks import DatasetError, encode_messages, load_jsonl
from real_model import arith_rows, smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_prompt_rows_go_through_the_chat_template_as_plain_int_ids(tok, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"id": "q1", "prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    [p] = load_jsonl(f, tok, vocab_size=len(tok))
    assert p.prompt_id == "q1" and p.metadata == {"answer": "5"}
    assert all(type(t) is int and 0 <= t < len(tok) for t in p.prompt_ids)
    text = tok.decode(p.prompt_ids)
    # The template's system turn, the user turn and the opened assistant turn, in order.
    assert text.index("<|im_start|>system") < text.index("What is 2 + 3?") < \
        text.rindex("<|im_start|>assistant")
    assert text.endswith("<|im_start|>assistant\n")
    assert p.prompt_ids == [int(t) for t in tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False)]


def test_messages_rows_keep_system_and_earlier_turns(tok, tmp_path):
    messages = [{"role": "system", "content": "Answer tersely."},
                {"role": "user", "content": "What is 1 + 1?"},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "And 2 + 2?"}]
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"messages": messages, "answer": "4"}) + "\n")
    [p] = load_jsonl(f, tok, vocab_size=len(tok))
    assert p.prompt_ids == encode_messages(tok, messages)
    text = tok.decode(p.prompt_ids)
    assert "Answer tersely." in text and "helpful AI assistant" not in text
    assert text.index("What is 1 + 1?") < text.index("And 2 + 2?")
    assert "messages" not in p.metadata and p.prompt_id.endswith("m.jsonl:1")


@pytest.mark.parametrize("row, match", [
    ({"prompt_ids": [1, 2, 10 ** 6]}, r"m.jsonl:2: prompt_ids has token ids \[1000000\] outside"),
    ({"prompt_ids": [1, True]}, r"m.jsonl:2: prompt_ids must be a non-empty list of int"),
    ({"prompt_ids": [1, -3]}, r"m.jsonl:2: prompt_ids has token ids \[-3\]"),
    ({"messages": []}, r"m.jsonl:2: messages must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, r"m.jsonl:2: messages\[0\]"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     r"m.jsonl:2: messages ends with an assistant turn"),
])
def test_bad_rows_name_file_line_and_field(tok, tmp_path, row, match):
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=match):
        load_jsonl(f, tok, vocab_size=len(tok))


def test_the_shipped_arithmetic_task_loads_with_disjoint_splits(tok):
    train = load_jsonl(arith_rows("train"), tok, vocab_size=len(tok))
    held = load_jsonl(arith_rows("eval"), tok, vocab_size=len(tok))
    assert (len(train), len(held)) == (240, 60)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held}
    assert all(p.metadata["answer"].isdigit() for p in train + held)
