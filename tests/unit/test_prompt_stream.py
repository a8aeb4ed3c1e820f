"""A resume continues the prompt stream its checkpoint's cursors index, or refuses: the digest
of the training prompt list changes with any key that shapes it, and the refusal names the
key that changed (or, when none did, the data files)."""

from __future__ import annotations

from rl_async.algo.tasks import Prompt, stream_digest
from rl_async.state.checkpoints import stream_change


def prompts(n, shift=0):
    return [Prompt(f"p{i}", [1, 2 + i + shift], {"answer": str(i), "where": f"f:{i}"})
            for i in range(n)]


def test_the_digest_follows_order_content_and_length_not_file_positions():
    base = stream_digest(prompts(10))
    assert base == stream_digest(prompts(10))
    moved = [Prompt(p.prompt_id, p.prompt_ids, {**p.metadata, "where": "g:0"})
             for p in prompts(10)]
    assert stream_digest(moved) == base  # another path to the same rows
    assert stream_digest(list(reversed(prompts(10)))) != base
    assert stream_digest(prompts(9)) != base
    assert stream_digest(prompts(10, shift=1)) != base
    changed_answer = prompts(10)
    changed_answer[3] = Prompt("p3", [1, 5], {"answer": "x"})
    assert stream_digest(changed_answer) != base


def test_a_changed_stream_names_the_key_or_the_files():
    saved = {"task": {"name": "jsonl", "num_eval_prompts": 8, "path": "t.jsonl"},
             "run": {"seed": 0}}
    now = {"task": {"name": "jsonl", "num_eval_prompts": 6, "path": "t.jsonl"},
           "run": {"seed": 0}}
    assert stream_change(saved, now, "40:a", "40:a") is None
    assert stream_change(saved, now, None, "40:a") is None  # a checkpoint from before digests
    why = stream_change(saved, now, "32:a", "34:b")
    assert "task.num_eval_prompts = 6 (the checkpoint has 8)" in why
    why = stream_change(saved, saved, "32:a", "32:b")
    assert "task.path / task.eval_path changed on disk" in why
