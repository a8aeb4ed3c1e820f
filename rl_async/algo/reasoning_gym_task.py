"""`task.name = "reasoning_gym"`: prompts and answers from reasoning-gym's procedural
generators, rewards from the dataset's own `score_answer` (the `envs` extra:
`pip install -e '.[envs]'`; `validate` refuses the task without it).

    [task]
    name = "reasoning_gym"
    dataset = "basic_arithmetic"                       # any reasoning_gym dataset name
    dataset_config = { size = 1000, min_terms = 2 }    # its config table (seed: run.seed)

One dataset of `size` entries is generated from `run.seed`; `task.num_eval_prompts` of them
are held out by the usual hash split, and training drops any entry whose question is also a
held-out one (small generators repeat questions). Each prompt is the library's default system
prompt (answer inside <answer></answer>) and the question, through the model's chat template.
The reward extracts the last <answer> span with the library's `extract_answer` (a response
without one is scored on its last non-empty line, so small models get partial signal) and
hands it to `score_answer(answer, entry)` of the dataset as configured (several scorers read
their config: decimal_arithmetic's tolerance, puzzle24's range), on the entry as the
generator made it (regenerated from its index, its types intact).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import TYPE_CHECKING, Any

from rl_async.base.types import Sample

EXTRA = "reasoning-gym (pip install -e '.[envs]')"

if TYPE_CHECKING:
    from rl_async.algo.tasks import Prompt


class ReasoningGymError(ValueError):
    """task.dataset / task.dataset_config do not make a reasoning-gym dataset."""


def available() -> bool:
    return importlib.util.find_spec("reasoning_gym") is not None


def create(name: str, args: dict[str, Any], seed: int, size: int | None = None):
    """The dataset (of `size` entries when given, else the table's), or a ReasoningGymError
    naming the key and the library's complaint."""
    import reasoning_gym

    if name not in reasoning_gym.factory.DATASETS:
        close = sorted(n for n in reasoning_gym.factory.DATASETS if name[:4] in n)[:8]
        raise ReasoningGymError(f"task.dataset = {name!r} is not a reasoning-gym dataset"
                                f"{f' (close: {close})' if close else ''}")
    try:
        table = {"size": 1000, **args, "seed": seed}
        if size is not None:
            table["size"] = size
        return reasoning_gym.create_dataset(name, **table)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ReasoningGymError(f"task.dataset_config = {args!r} for {name!r}: {exc}") from None


def _json_safe(value: Any) -> Any:
    """Tuples to lists, keys and odd values to strings (a row travels as JSON)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def rows(name: str, args: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """Every entry as a JSON-safe row: question, answer, and what scoring needs (the
    dataset's name, config and seed, the entry's index)."""
    out = []
    config = json.dumps(args, sort_keys=True)
    for i, entry in enumerate(create(name, args, seed)):
        safe = _json_safe(entry)
        out.append({"id": f"{name}-{i}", "question": safe["question"],
                    "answer": str(safe["answer"]), "rg_dataset": name, "rg_entry": safe,
                    "rg_config": config, "rg_seed": seed, "rg_index": i})
    return out


def system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


@functools.lru_cache(maxsize=16)
def _dataset(name: str, config: str, seed: int):
    """The dataset as the run configured it (scorers read their config)."""
    return create(name, json.loads(config), seed)


def extract(text: str) -> str | None:
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    if answer is None:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        answer = lines[-1] if lines else None
    return answer


def reasoning_gym_reward(sample: Sample) -> float:
    """The dataset's own score_answer of the extracted answer (0..1)."""
    text = sample.metadata.get("response_text")
    entry = sample.metadata.get("rg_entry")
    if text is None or entry is None:
        raise KeyError(f"prompt {sample.prompt_id!r}: reasoning_gym_reward needs metadata "
                       f"'rg_entry' (task.name = 'reasoning_gym') and a decoded 'response_text' "
                       f"(set model.path)")
    m = sample.metadata
    dataset = _dataset(m["rg_dataset"], m["rg_config"], int(m["rg_seed"]))
    return float(dataset.score_answer(extract(text), dataset[int(m["rg_index"])]))


def reasoning_gym_prompts(dataset: str, args: dict, num_eval: int, tokenizer, seed: int,
                          split: str) -> list[Prompt]:
    """reasoning-gym entries as chat prompts; held-out questions never appear in training."""
    from rl_async.algo.tasks import DatasetError, Prompt, encode_messages, held_out_split

    if tokenizer is None:
        raise DatasetError("task.name = 'reasoning_gym' needs model.path with a tokenizer "
                           "(its questions are text)")
    system = system_prompt()
    prompts = [Prompt(prompt_id=row["id"], metadata=row, prompt_ids=encode_messages(
        tokenizer, [{"role": "system", "content": system},
                    {"role": "user", "content": row["question"]}]))
        for row in rows(dataset, args, seed)]
    where = f"reasoning_gym:{dataset}"
    train, held = held_out_split(prompts, num_eval, where)
    if split != "train":
        return held
    seen = {p.metadata["question"] for p in held}
    train = [p for p in train if p.metadata["question"] not in seen]
    if not train:
        raise DatasetError(f"{where}: every question is also a held-out one; raise "
                           f"task.dataset_config.size or lower task.num_eval_prompts")
    return train
