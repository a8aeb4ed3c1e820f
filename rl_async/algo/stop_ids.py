"""The token ids a checkpoint stops on by itself, by SGLang 0.5.23's rule, so the embedded
engine stops where an SGLang server serving the same checkpoint stops.

SGLang ends a request (`Req._check_token_based_finish`, python/sglang/srt/managers/
schedule_batch.py) on a token in `stop_token_ids`, in the model's `eos_token_ids`, equal to
`tokenizer.eos_token_id`, or in `tokenizer.additional_stop_token_ids`:

- `eos_token_ids` = `eos_token_id` of config.json united with generation_config.json's
  (`ModelConfig._get_hf_eos_token_id`, python/sglang/srt/configs/model_config.py);
- `additional_stop_token_ids` = the ids of the turn-end markers some checkpoints ship without
  EOS metadata, where the tokenizer's added vocabulary has them
  (`attach_additional_stop_token_ids`, python/sglang/srt/utils/hf_transformers/common.py).
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

# python/sglang/srt/utils/hf_transformers/common.py, _ADDITIONAL_STOP_TOKEN_TEXTS
ADDITIONAL_STOP_TOKEN_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>",
                               "<|ifm|im_end|>")


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def config_eos_ids(model_path: str | Path) -> set[int]:
    """`eos_token_id` of config.json and of generation_config.json (an int or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        if path.is_file():
            ids |= _ids(json.loads(path.read_text()).get("eos_token_id"))
    return ids


def tokenizer_stop_ids(tokenizer) -> set[int]:
    """The tokenizer's eos_token_id and the added-vocabulary turn-end markers."""
    if tokenizer is None:
        return set()
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    added = tokenizer.get_added_vocab()
    return ids | {added[t] for t in ADDITIONAL_STOP_TOKEN_TEXTS if t in added}


def model_stop_ids(model_path: str | Path, tokenizer=None) -> set[int]:
    """Every id SGLang stops the checkpoint at when a request names no stop ids."""
    return config_eos_ids(model_path) | tokenizer_stop_ids(tokenizer)


# The rollouts' stop ids (what producers send with every request)

def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(cfg, tokenizer=None) -> tuple[int, ...]:
    """rollout.stop_token_ids, else the built-in task's EOS, else every end-of-sequence id
    the model declares: config.json's and generation_config.json's eos_token_id (chat
    models often list their turn terminator only in the latter: Gemma's <end_of_turn>), the
    tokenizer's eos token (`tokenizer`, or the checkpoint's own files) and the turn-end
    markers SGLang stops at too: the embedded engine stops where SGLang would."""
    if cfg.rollout.stop_token_ids is not None:
        return tuple(cfg.rollout.stop_token_ids)
    from rl_async.algo.tasks import ENV_TASKS, EOS

    if cfg.task.name == "successor" or (cfg.task.name in ENV_TASKS and cfg.model.path is None):
        return (EOS,)  # the built-in vocabulary's EOS (the digit chat template's turn end)
    if cfg.model.path is None:
        return ()
    from transformers import AutoConfig

    ids = _eos_ids(AutoConfig.from_pretrained(cfg.model.path, local_files_only=True).eos_token_id)
    generation = Path(cfg.model.path).expanduser() / "generation_config.json"
    if generation.is_file():
        ids += _eos_ids(json.loads(generation.read_text()).get("eos_token_id"))
    stops = (_tokenizer_stops(tokenizer) if tokenizer is not None
             else _checkpoint_tokenizer_stops(cfg.model.path))
    return tuple(dict.fromkeys(ids + stops))  # in order, once each


def _tokenizer_stops(tokenizer) -> list[int]:
    """The tokenizer's eos id, then the turn-end markers SGLang also stops at
    (<|eom_id|> and kin, where the added vocabulary has them)."""
    eos = _eos_ids(tokenizer.eos_token_id)
    return eos + sorted(tokenizer_stop_ids(tokenizer) - set(eos))


@functools.lru_cache(maxsize=8)
def _checkpoint_tokenizer_stops(path: str) -> list[int]:
    """_tokenizer_stops of the checkpoint's own tokenizer (loaded once per path: sampling
    settings are built at every evaluation)."""
    from rl_async.algo.tasks import load_tokenizer

    tokenizer = load_tokenizer(types.SimpleNamespace(path=path))
    return [] if tokenizer is None else _tokenizer_stops(tokenizer)
