"""Held-out evaluation is held out: with task.eval_path unset, task.num_eval_prompts rows of
task.path are carved out for evaluation and removed from training (it used to evaluate on
the first training rows), the same rows every run whatever the file's order; the plan says so."""

from __future__ import annotations

import json
import types

import pytest

from rl_async.algo.tasks import DatasetError, build_prompts


def task(tmp_path, rows, n, eval_path=None):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": [1, 2 + i % 60],
                                        "answer": str(i)}) + "\n" for i in rows))
    return types.SimpleNamespace(name="jsonl", path=str(path), eval_path=eval_path,
                                 num_eval_prompts=n)


def test_eval_rows_are_removed_from_training_and_chosen_by_content(tmp_path):
    cfg = task(tmp_path, range(40), 8)
    train = build_prompts(cfg, 64, "train")
    held = build_prompts(cfg, 64, "eval")
    assert len(held) == 8 and len(train) == 32
    assert not {p.prompt_id for p in held} & {p.prompt_id for p in train}
    assert [p.prompt_id for p in held] != [f"r{i}" for i in range(8)]  # not the first rows
    again = task(tmp_path, reversed(range(40)), 8)  # the same rows, another order
    assert {p.prompt_id for p in build_prompts(again, 64, "eval")} == {p.prompt_id for p in held}


def test_rows_without_ids_split_the_same_whatever_the_file_order(tmp_path):
    """Id-less rows are named by file and line: the split hashes what a row asks, so another
    order of the same rows holds out the same prompts."""
    def split(order):
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps({"prompt_ids": [1, 2 + i]}) + "\n" for i in order))
        cfg = types.SimpleNamespace(name="jsonl", path=str(path), eval_path=None,
                                    num_eval_prompts=6)
        return {tuple(p.prompt_ids) for p in build_prompts(cfg, 64, "eval")}

    assert split(range(30)) == split(reversed(range(30)))


def test_a_duplicate_of_a_held_out_prompt_never_trains(tmp_path):
    rows = [{"id": f"r{i}", "prompt_ids": [1, 2 + i]} for i in range(20)]
    rows += [{"id": f"dup{i}", "prompt_ids": [1, 2 + i]} for i in range(20)]  # twins, new ids
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = types.SimpleNamespace(name="jsonl", path=str(path), eval_path=None, num_eval_prompts=5)
    held = {tuple(p.prompt_ids) for p in build_prompts(cfg, 64, "eval")}
    train = {tuple(p.prompt_ids) for p in build_prompts(cfg, 64, "train")}
    assert held and not held & train


def test_holding_out_every_row_is_an_error_naming_the_keys(tmp_path):
    with pytest.raises(DatasetError, match="task.num_eval_prompts = 5 would hold out every row"):
        build_prompts(task(tmp_path, range(5), 5), 64, "train")


def test_an_eval_file_is_used_as_given(tmp_path):
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"id": "e0", "prompt_ids": [3]}) + "\n")
    cfg = task(tmp_path, range(10), 8, eval_path=str(other))
    assert len(build_prompts(cfg, 64, "train")) == 10
    assert [p.prompt_id for p in build_prompts(cfg, 64, "eval")] == ["e0"]


def test_the_plan_says_the_split_is_carved_from_training(tmp_path):
    from rl_async.plan.checks import validate
    from rl_async.plan.load import load_config

    cfg = task(tmp_path, range(40), 8)
    run = load_config("cluster_configs/local.toml", ["task.name=jsonl", f"task.path={cfg.path}",
                                                     "task.num_eval_prompts=8"])
    [warning] = [w for w in validate(run).warnings if w.code == "EVAL_SPLIT_FROM_TRAIN"]
    assert "removed from training" in warning.message
