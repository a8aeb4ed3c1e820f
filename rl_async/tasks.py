"""Prompt sources: the built-in verifiable task and JSONL prompt files, plus their verifiers.

A prompt source is deterministic in its cursor: `prompt(cursor)` always returns the same
prompt for the same cursor and seed, so the ledger can checkpoint a cursor and restore the
exact stream (LESSONS: miles#2254 lost groups when the cursor ran ahead of training).

Built-in task "successor": the prompt is `BOS d1 .. dk` (k = task.prompt_digits digits in
[0, modulus)); the reward is 1.0 when the first response token is (dk + 1) mod modulus,
else 0.0. The leading digits are distractors, so the policy must learn to read the right
position and apply the rule; a tenth of the digit strings is held out for evaluation, so the
eval reward measures generalisation to unseen prompts, not memorisation. A random tiny model
starts near 1/vocab and RL lifts it close to 1.0 in a few dozen updates on a CPU.

JSONL rows: {"prompt_ids": [int, ...], "answer": ...} or {"prompt": "digits as text",
"answer": ...}; every other field is kept as metadata for the reward function.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_async.types import Group, Sample

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4  # token id of digit 0


class DatasetError(ValueError):
    """A bad dataset row; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource:
    """A deterministic, seeded, endlessly cycling stream of prompts (one epoch = one shuffle)."""

    def __init__(self, prompts: list[Prompt], seed: int):
        if not prompts:
            raise DatasetError("the prompt source is empty: no prompts to train on")
        self.prompts = prompts
        self.seed = seed

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt(self, cursor: int) -> Prompt:
        epoch, index = divmod(cursor, len(self.prompts))
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return self.prompts[order[index]]

    def group(self, cursor: int, group_size: int) -> Group:
        """The cursor-th prompt as a fresh group of `group_size` samples."""
        p = self.prompt(cursor)
        samples = [Sample(prompt_id=p.prompt_id, prompt_ids=list(p.prompt_ids),
                          metadata=dict(p.metadata)) for _ in range(group_size)]
        return Group(group_id=f"c{cursor}:{p.prompt_id}", samples=samples)


def successor_prompts(modulus: int, vocab_size: int, digits: int = 3,
                      split: str = "train") -> list[Prompt]:
    """All `modulus ** digits` digit strings. Strings whose digit sum is a multiple of 10 are
    the held-out eval split: every answer digit occurs there, with unseen leading digits."""
    if DIGIT0 + modulus > vocab_size:
        raise DatasetError(
            f"task.modulus = {modulus} needs a vocabulary of at least {DIGIT0 + modulus} tokens "
            f"(4 specials + digits); model.hf_config.vocab_size = {vocab_size}")
    prompts = []
    for index in range(modulus ** digits):
        ds = [(index // modulus ** i) % modulus for i in reversed(range(digits))]
        if (sum(ds) % 10 == 0) != (split == "eval"):
            continue
        prompts.append(Prompt(
            prompt_id="succ" + "-".join(map(str, ds)),
            prompt_ids=[BOS] + [DIGIT0 + d for d in ds],
            metadata={"answer_ids": [DIGIT0 + (ds[-1] + 1) % modulus]}))
    return prompts


def successor_reward(sample: Sample) -> float:
    """1.0 when the response starts with the expected answer token(s), else 0.0."""
    answer = sample.metadata["answer_ids"]
    return 1.0 if list(sample.response_ids[: len(answer)]) == list(answer) else 0.0


def exact_match_reward(sample: Sample) -> float:
    """JSONL tasks: 1.0 when the response (up to EOS) equals the row's `answer_ids`."""
    answer = sample.metadata.get("answer_ids")
    if answer is None:
        raise KeyError(f"prompt {sample.prompt_id!r} has no 'answer_ids' for exact_match_reward")
    response = list(sample.response_ids)
    if EOS in response:
        response = response[: response.index(EOS)]
    return 1.0 if response == list(answer) else 0.0


def _row_to_prompt(row: Any, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise DatasetError(f"{where}: prompt_ids must be a non-empty list of token ids >= 0")
    elif "prompt" in row and isinstance(row["prompt"], str) and row["prompt"].strip().isdigit():
        ids = [BOS] + [DIGIT0 + int(ch) for ch in row["prompt"].strip()] + [SEP]
    else:
        raise DatasetError(f"{where}: needs 'prompt_ids' (list of ints) or 'prompt' (digits)")
    meta = {k: v for k, v in row.items() if k not in ("prompt_ids", "prompt", "id")}
    if "answer" in meta and "answer_ids" not in meta and str(meta["answer"]).isdigit():
        meta["answer_ids"] = [DIGIT0 + int(ch) for ch in str(meta["answer"])]
    return Prompt(prompt_id=str(row.get("id", where)), prompt_ids=list(ids), metadata=meta)


def load_jsonl(path: str | Path) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"task.path = {str(p)!r}: file not found")
    prompts = []
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        prompts.append(_row_to_prompt(row, where))
    if not prompts:
        raise DatasetError(f"task.path = {str(p)!r}: no prompts in the file")
    return prompts


def build_prompts(task_cfg, vocab_size: int, split: str = "train") -> list[Prompt]:
    """Prompts for a TaskSection: `split` is "train" or "eval"."""
    if task_cfg.name == "successor":
        return successor_prompts(task_cfg.modulus, vocab_size, task_cfg.prompt_digits, split)
    path = task_cfg.path if split == "train" else (task_cfg.eval_path or task_cfg.path)
    return load_jsonl(path)


def default_reward_path(task_cfg) -> str:
    return ("rl_async.tasks:successor_reward" if task_cfg.name == "successor"
            else "rl_async.tasks:exact_match_reward")


def model_vocab_size(model_cfg) -> int:
    """Vocabulary size of the configured model, without building it."""
    from transformers import AutoConfig

    if model_cfg.hf_config is not None:
        hf = dict(model_cfg.hf_config)
        return int(AutoConfig.for_model(hf.pop("model_type"), **hf).vocab_size)
    return int(AutoConfig.from_pretrained(model_cfg.path, local_files_only=True).vocab_size)
