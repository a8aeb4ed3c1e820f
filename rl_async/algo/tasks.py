"""Prompt sources: the built-in verifiable task and JSONL prompt files, plus their verifiers.

A prompt source is deterministic in its cursor: `prompt(cursor)` always returns the same
prompt for the same cursor and seed, so the ledger can checkpoint a cursor and restore the
exact stream (LESSONS: miles#2254 lost groups when the cursor ran ahead of training).

Built-in task "successor": rl_async.algo.successor.

JSONL rows: {"prompt_ids": [int, ...], ...}, {"prompt": "text", "answer": "..."} or
{"messages": [{"role": "system", "content": ...}, {"role": "user", ...}], "answer": ...}.
Text and messages go through the model's tokenizer and its chat template (when it has one;
a digit-only prompt without a tokenizer uses the built-in digit tokens). Token ids are
checked against the model's vocabulary when the file is loaded. Every other field is
kept as metadata for the reward function; `answer_match_reward` compares the decoded
response's final answer with `answer`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_async.algo.rewards import inline_safe
from rl_async.base.types import Group, Sample

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0 = 4  # token id of digit 0


class DatasetError(ValueError):
    """A bad dataset row; the message names the file, the line and the field."""


# Tasks whose samples are trajectories an environment plays and scores (SPEC §12).
ENV_TASKS = ("env", "verifiers")


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
        # The current epoch's shuffle, kept: shuffling per prompt made every prompt O(dataset)
        # (the prompt source's main cost at fleet rates). Cursors move forward, so one epoch
        # is cached; a cursor of another epoch (resume, tests) recomputes it.
        self._epoch: int | None = None
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt(self, cursor: int) -> Prompt:
        epoch, index = divmod(cursor, len(self.prompts))
        if epoch != self._epoch:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self.prompts[self._order[index]]

    def group(self, cursor: int, group_size: int) -> Group:
        """The cursor-th prompt as a fresh group of `group_size` samples."""
        p = self.prompt(cursor)
        samples = [Sample(prompt_id=p.prompt_id, prompt_ids=list(p.prompt_ids),
                          metadata=dict(p.metadata)) for _ in range(group_size)]
        return Group(group_id=f"c{cursor}:{p.prompt_id}", samples=samples)


@inline_safe
def exact_match_reward(sample: Sample) -> float:
    """JSONL tasks: 1.0 when the response (up to EOS) equals the row's `answer_ids`."""
    answer = sample.metadata.get("answer_ids")
    if answer is None:
        raise KeyError(f"prompt {sample.prompt_id!r} has no 'answer_ids' for exact_match_reward")
    response = list(sample.response_ids)
    if EOS in response:
        response = response[: response.index(EOS)]
    return 1.0 if response == list(answer) else 0.0


ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """`messages`: a non-empty list of {"role", "content"} chat messages (system, user, earlier
    turns); the conversation to continue, so its last message must not be the assistant's."""
    if not (isinstance(messages, list) and messages):
        raise DatasetError(f"{where}: messages must be a non-empty list of "
                           f"{{\"role\": ..., \"content\": ...}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: messages[{i}] = {m!r}: needs a role in {ROLES} and a "
                               f"string content")
    if messages[-1]["role"] == "assistant":
        raise DatasetError(f"{where}: messages ends with an assistant turn; the last message "
                           f"is the one the policy answers (user or tool)")
    return messages


def encode_messages(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation ready for the assistant's answer: through the chat template
    when the tokenizer has one, else the plain text of a single message.

    The template is rendered to text and then encoded without extra special tokens, so the
    result is a plain list of ints whatever `apply_chat_template(tokenize=True)` returns in the
    installed transformers (a BatchEncoding in 5.x: listing it gives its keys)."""
    if getattr(tokenizer, "chat_template", None):
        # task.chat_template_kwargs ride on the tokenizer (rl_async.algo.chat).
        kwargs = getattr(tokenizer, "rl_async_template_kwargs", None) or {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **kwargs)
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    if len(messages) != 1:
        raise DatasetError("a multi-turn `messages` row needs a tokenizer with a chat template "
                           "(model.path's tokenizer_config.json has none)")
    return [int(t) for t in tokenizer.encode(messages[0]["content"])]


def _check_ids(ids: Any, where: str, field_name: str, vocab_size: int | None) -> list[int]:
    if not (isinstance(ids, list) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise DatasetError(f"{where}: {field_name} must be a non-empty list of int token ids")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise DatasetError(f"{where}: {field_name} has token ids {bad[:5]} outside the model's "
                           f"vocabulary [0, {vocab_size})")
    return ids


def _row_to_prompt(row: Any, where: str, tokenizer=None, vocab_size: int | None = None) -> Prompt:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text = row.get("prompt")
    if "prompt_ids" in row:
        ids, field_name = row["prompt_ids"], "prompt_ids"
    elif "messages" in row:
        if tokenizer is None:
            raise DatasetError(f"{where}: messages need model.path with a tokenizer")
        ids, field_name = encode_messages(tokenizer, _check_messages(row["messages"], where)), \
            "messages"
    elif isinstance(text, str) and text.strip() and tokenizer is not None:
        ids, field_name = encode_messages(tokenizer, [{"role": "user", "content": text}]), "prompt"
    elif isinstance(text, str) and text.strip().isdigit():
        ids, field_name = [BOS] + [DIGIT0 + int(ch) for ch in text.strip()], "prompt"
    else:
        raise DatasetError(f"{where}: needs 'prompt_ids' (list of ints), 'messages' (chat) or "
                           f"a non-empty 'prompt' (text needs model.path with a tokenizer; "
                           f"digits work without)")
    ids = _check_ids(ids, where, field_name, vocab_size)
    meta = {k: v for k, v in row.items() if k not in ("prompt_ids", "prompt", "messages", "id")}
    if "max_new_tokens" in meta:
        response_budget(meta, 1, where)  # checked at load, not at the first request
    if ("answer" in meta and "answer_ids" not in meta and tokenizer is None
            and str(meta["answer"]).isdigit()):
        meta["answer_ids"] = [DIGIT0 + int(ch) for ch in str(meta["answer"])]
    return Prompt(prompt_id=str(row.get("id", where)), prompt_ids=list(ids), metadata=meta)


def response_budget(metadata: dict[str, Any], limit: int, where: str = "") -> int:
    """A prompt's response budget: its row's `max_new_tokens` (a positive int) capped by
    rollout.max_response_len (`limit`), else the limit."""
    cap = metadata.get("max_new_tokens")
    if cap is None:
        return limit
    if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
        raise DatasetError(f"{where or 'prompt'}: max_new_tokens = {cap!r} must be an int >= 1 "
                           f"(the row's response budget)")
    return min(cap, limit)


def jsonl_rows(path: str | Path):
    """(where, row) for every non-blank line of `task.path`, `where` = "file:line"; a missing
    file or a line that is not JSON stops the run naming it."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"task.path = {str(p)!r}: file not found")
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None


def load_jsonl(path: str | Path, tokenizer=None, vocab_size: int | None = None) -> list[Prompt]:
    """Every row of a JSONL prompt file; token ids are checked against `vocab_size` here, at
    load time, so a bad row stops the run at start with its file, line and field."""
    p = Path(path)
    prompts = [_row_to_prompt(row, where, tokenizer, vocab_size)
               for where, row in jsonl_rows(p)]
    if not prompts:
        raise DatasetError(f"task.path = {str(p)!r}: no prompts in the file")
    return prompts


def build_prompts(task_cfg, vocab_size: int, split: str = "train",
                  tokenizer=None, seed: int = 0) -> list[Prompt]:
    """Prompts for a TaskSection: `split` is "train" or "eval". Without `task.eval_path`,
    `task.num_eval_prompts` rows of `task.path` are held out for evaluation and removed
    from training (`held_out_split`), so a held-out reward is never measured on training
    prompts."""
    if task_cfg.name == "successor":
        from rl_async.algo.successor import successor_prompts

        return successor_prompts(task_cfg.modulus, vocab_size, task_cfg.prompt_digits, split,
                                 task_cfg.count_tokens)
    if task_cfg.name == "reasoning_gym":
        from rl_async.algo.reasoning_gym_task import reasoning_gym_prompts

        return reasoning_gym_prompts(task_cfg.dataset, task_cfg.dataset_config,
                                     task_cfg.num_eval_prompts, tokenizer, seed, split)
    if task_cfg.name == "verifiers":
        from rl_async.algo.verifiers_env import verifiers_prompts

        return verifiers_prompts(task_cfg, split)
    load = load_jsonl
    if task_cfg.name == "env":  # rows for the environment's reset, not prompts
        from rl_async.algo.environments import env_rows

        load = lambda path, tokenizer, vocab_size: env_rows(path)  # noqa: E731
    if task_cfg.eval_path is not None:
        path = task_cfg.path if split == "train" else task_cfg.eval_path
        return load(path, tokenizer, vocab_size)
    train, held = held_out_split(load(task_cfg.path, tokenizer, vocab_size),
                                 task_cfg.num_eval_prompts, task_cfg.path)
    return train if split == "train" else held


def held_out_split(prompts: list[Prompt], n: int, where: str) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, `n` held-out prompts): the held-out ones are the first `n` by a
    hash of each row's content (its prompt, not its id or line), the same in every run
    whatever the file's order (a file sorted by difficulty still gives a mixed held-out set);
    training keeps the rest in file order, minus any row whose prompt equals a held-out one
    (a duplicate would put the evaluated prompt into training)."""
    if n >= len(prompts):
        raise DatasetError(f"task.num_eval_prompts = {n} would hold out every row of "
                           f"task.path = {where!r} ({len(prompts)} rows) for evaluation: set "
                           f"task.eval_path, or lower task.num_eval_prompts")
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(_content(p).encode()).hexdigest())
    held = ranked[:n]
    held_contents = {_content(p) for p in held}
    return [p for p in prompts if _content(p) not in held_contents], held


def _content(p: Prompt) -> str:
    """What a row asks: its prompt tokens (an environment's row without its id), never where
    it sits in the file."""
    if p.prompt_ids:
        return json.dumps(p.prompt_ids)
    row = {k: v for k, v in p.metadata.get("row", {}).items() if k != "id"}
    return json.dumps(row, sort_keys=True, default=str)


def stream_digest(prompts: list[Prompt]) -> str:
    """A digest of the training prompt list in order (ids, tokens and fields): the ledger's
    cursors index this list, so a resume must find the same one (rl_async.state.checkpoints
    refuses another, naming the keys that changed)."""
    h = hashlib.sha256()
    for p in prompts:
        meta = {k: v for k, v in p.metadata.items() if k != "where"}
        h.update(json.dumps([p.prompt_id, p.prompt_ids, meta], sort_keys=True,
                            default=str).encode())
        h.update(b"\n")
    return f"{len(prompts)}:{h.hexdigest()[:32]}"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_cfg, chat_template: str | None = None,
                   chat_template_kwargs: dict | None = None):
    """The checkpoint's tokenizer (local files only), or None for config-built models and
    weights-only checkpoints (no tokenizer file: token-id tasks need none; text rows then
    fail to load, naming the missing tokenizer). The chat settings (task.chat_template,
    task.chat_template_kwargs) ride on the tokenizer (rl_async.algo.chat)."""
    if model_cfg.path is None:
        return None
    from pathlib import Path

    if not any((Path(model_cfg.path).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_cfg.path, local_files_only=True)
    if chat_template is not None or chat_template_kwargs:
        from rl_async.algo.chat import apply_chat_settings

        apply_chat_settings(tok, chat_template, chat_template_kwargs)
    return tok


def engine_prompt_limit(cfg) -> int | None:
    """The longest input an engine must accept: rollout.max_prompt_len, or for a multi-turn
    environment the whole trajectory so far (a later turn's request is every earlier token),
    up to rollout.max_trajectory_tokens - 1."""
    budget = cfg.rollout.max_trajectory_tokens
    if cfg.task.name in ENV_TASKS and budget is not None:
        return max(budget - 1, cfg.rollout.max_prompt_len or 0)
    return cfg.rollout.max_prompt_len


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced (\\boxed{\\frac{1}{2}} gives
    \\frac{1}{2}, not 2); None when there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def final_answer(text: str) -> str | None:
    """The last \\boxed{...} in `text`, else its last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


@inline_safe
def answer_match_reward(sample: Sample) -> float:
    """Text tasks: 1.0 when the final answer of the decoded response equals the row's
    `answer` (the scorer fills `metadata["response_text"]` from the tokenizer, where the reward
    runs: rl_async.algo.scoring)."""
    text = sample.metadata.get("response_text")
    if text is None or "answer" not in sample.metadata:
        raise KeyError(f"prompt {sample.prompt_id!r}: answer_match_reward needs metadata "
                       f"'answer' and a decoded 'response_text' (set model.path)")
    return 1.0 if final_answer(text) == str(sample.metadata["answer"]).strip() else 0.0


def default_reward_path(task_cfg) -> str:
    return {"successor": "rl_async.algo.successor:successor_reward",
            "math": "rl_async.algo.math_reward:math_reward",
            "reasoning_gym": "rl_async.algo.reasoning_gym_task:reasoning_gym_reward"}.get(
                task_cfg.name, "rl_async.algo.tasks:answer_match_reward")


def model_vocab_size(model_cfg) -> int:
    """Vocabulary size of the configured model, without building it."""
    from transformers import AutoConfig

    if model_cfg.hf_config is not None:
        hf = dict(model_cfg.hf_config)
        return int(AutoConfig.for_model(hf.pop("model_type"), **hf).vocab_size)
    return int(AutoConfig.from_pretrained(model_cfg.path, local_files_only=True).vocab_size)


def __getattr__(name: str):
    """The successor task's old home: run files name `rl_async.algo.tasks:successor_reward`.
    Resolved lazily because rl_async.algo.successor imports this module."""
    if name in ("successor_prompts", "successor_reward"):
        from rl_async.algo import successor

        return getattr(successor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
