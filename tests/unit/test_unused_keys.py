"""Keys that a setup reads but that do nothing in it are named by validate (UNUSED_KEY), and
the embedded engine honours sglang.request_timeout_s (it had no request deadline at all)."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.engine.base import SamplingParams, TransientEngineError
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.state.models import tiny_llama_config


def unused(*overrides):
    cfg = load_config("cluster_configs/local.toml", list(overrides))
    return [w.message.split(" is set")[0] for w in validate(cfg).warnings
            if w.code == "UNUSED_KEY"]


def test_keys_of_another_setup_are_named():
    assert unused() == []  # the demo sets only what it uses
    assert unused("sglang.mem_fraction_static=0.5", "sglang.ignore_eos=true") == [
        "sglang.mem_fraction_static", "sglang.ignore_eos"]
    rows = "data/arith/train.jsonl"
    assert "task.modulus" in unused("task.name=jsonl", f"task.path={rows}",
                                    f"task.eval_path={rows}", "task.modulus=7")


def test_the_embedded_engine_ends_a_request_past_its_deadline():
    async def main():
        engine = EmbeddedEngine(EmbeddedEngineConfig(
            hf_config=tiny_llama_config(max_position_embeddings=4096), request_timeout_s=0.2,
            max_running_requests=2))
        try:
            with pytest.raises(TransientEngineError, match="sglang.request_timeout_s = 0.2 s"):
                await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4000))
            for _ in range(50):  # the slot is freed
                if engine.load().running == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.load().running == 0 and engine.load().waiting == 0
            out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            assert len(out.output_ids) <= 2
        finally:
            await engine.close()

    asyncio.run(main())
