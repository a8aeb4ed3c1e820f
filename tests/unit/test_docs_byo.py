"""docs/bring-your-own.md's example is the shipped one (examples/byo/) and it works: the page
quotes the files verbatim, the run file validates, the rows load through the real tokenizer
and the reward module scores real decoded responses. The whole run is
`PYTHONPATH=examples/byo rl-async run examples/byo/my_run.toml` (about 2 minutes on 2 cores)."""

import asyncio
import re
import sys
from pathlib import Path

import pytest

from real_model import smollm2_dir, smollm2_tokenizer
from rl_async import Sample
from rl_async.algo.rewards import load_callable
from rl_async.algo.scoring import SampleScorer
from rl_async.algo.tasks import build_prompts, load_tokenizer, model_vocab_size
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "bring-your-own.md").read_text()
BYO = ROOT / "examples" / "byo"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


def test_the_page_quotes_the_shipped_files_verbatim():
    assert (BYO / "my_reward.py").read_text() in _blocks("python")
    assert (BYO / "my_run.toml").read_text() in _blocks("toml")
    rows = set((BYO / "train.jsonl").read_text().splitlines())
    (shown,) = _blocks("json")
    assert shown.splitlines() and set(shown.splitlines()) <= rows


@pytest.fixture
def cfg():
    return load_config(BYO / "my_run.toml", [f"model.path={smollm2_dir()}"])


def test_the_run_file_validates_and_its_rows_load(cfg):
    report = validate(cfg)
    assert report.ok, report.errors
    tok = load_tokenizer(cfg.model)
    train = build_prompts(cfg.task, model_vocab_size(cfg.model), "train", tok)
    held = build_prompts(cfg.task, model_vocab_size(cfg.model), "eval", tok)
    assert len(train) == 8 and len(held) == 4
    assert all(p.metadata["answer"] for p in train)


def test_the_reward_scores_real_decoded_responses(cfg, monkeypatch):
    monkeypatch.syspath_prepend(str(BYO))  # what PYTHONPATH=examples/byo does
    scorer = SampleScorer.from_config(cfg)
    tok = smollm2_tokenizer()

    def score(text: str, answer: str) -> float:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return asyncio.run(scorer.score(Sample("p", response_ids=ids,
                                               metadata={"answer": answer})))

    assert score("7 + 5 = 12", "12") == 1.0
    assert score("The answer is 11.", "12") == 0.0
    assert score("no number here", "12") == 0.0
    sys.modules.pop("my_reward", None)


def test_the_import_error_the_page_quotes_is_the_real_one():
    sys.modules.pop("my_reward", None)
    with pytest.raises(ValueError) as err:
        load_callable("my_reward:last_number_matches")
    assert " ".join(str(err.value).split()) in " ".join(PAGE.split())
