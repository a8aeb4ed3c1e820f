"""SGLang 0.5.23's stop set for a checkpoint (rl_async/algo/stop_ids.py), with a real Hugging
Face tokenizer: config and generation-config EOS ids, the tokenizer's eos id, and the
turn-end markers SGLang adds from the tokenizer's added vocabulary."""

from __future__ import annotations

import json

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from rl_async.algo.stop_ids import config_eos_ids, model_stop_ids, tokenizer_stop_ids


def _tokenizer(extra: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "hello": 1, "</s>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, "<unk>")),
                                  eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": extra})
    return tok


def test_the_stop_set_unites_configs_tokenizer_eos_and_turn_end_markers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert config_eos_ids(tmp_path) == {2, 7}
    tok = _tokenizer(["<|eom_id|>", "<|im_start|>"])
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    assert tokenizer_stop_ids(tok) == {2, eom}  # <|im_start|> is no turn end
    assert model_stop_ids(tmp_path, tok) == {2, 7, eom}
    assert model_stop_ids(tmp_path) == {2, 7}  # weights-only checkpoints: configs only


def test_rollouts_stop_at_the_tokenizers_turn_end_markers_as_sglang_does(tmp_path):
    """rl_async.algo.stop_ids.stop_token_ids (what every engine is asked to stop at) includes
    the markers SGLang adds from the tokenizer, so the embedded engine stops where SGLang
    stops on the same checkpoint."""
    import types

    from rl_async.algo.stop_ids import stop_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                       "eos_token_id": 2}))
    tok = _tokenizer(["<|eom_id|>"])
    tok.save_pretrained(tmp_path)
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(stop_token_ids=None),
                                task=types.SimpleNamespace(name="jsonl"),
                                model=types.SimpleNamespace(path=str(tmp_path)))
    assert stop_token_ids(cfg) == (2, eom)
    assert stop_token_ids(cfg, tok) == (2, eom)
