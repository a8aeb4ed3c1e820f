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

import json
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
