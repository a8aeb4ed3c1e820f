"""End-to-end SGLangEngine on a real SGLang server (pinned 0.5.23) with a tiny random Llama:
launch, greedy generate, a weight update over a torch.distributed group (NCCL with two GPUs,
gloo with one: NCCL cannot put two ranks on one GPU), a colocated update from tensors, and
shutdown of the launched process group."""

from __future__ import annotations

import asyncio
import math
import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("sglang", reason="sglang is not installed")

from rl_async.engine.base import SamplingParams  # noqa: E402
from rl_async.engine.sglang_args import SGLangEngineConfig, free_port  # noqa: E402
from rl_async.engine.sglang_engine import SGLangEngine  # noqa: E402

VOCAB, HIDDEN = 1024, 256


def _tiny_model(path: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _trainer_group(port: int, backend: str):
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}",
                                     world_size=2, rank=0, group_name="rl_async_test")


def test_launch_generate_update_shutdown(tmp_path):
    weights = _tiny_model(str(tmp_path / "tiny"))
    two_gpus = torch.cuda.device_count() >= 2
    backend, device = ("nccl", "cuda:1") if two_gpus else ("gloo", "cpu")
    config = SGLangEngineConfig(
        model_path=str(tmp_path / "tiny"), gpu_ids=(0,), port=0, mem_fraction_static=0.3,
        max_running_requests=8, startup_timeout_s=600, log_path=str(tmp_path / "server.log"),
        server_args={"skip_tokenizer_init": True, "dtype": "bfloat16",
                     "skip_server_warmup": True, "random_seed": 0},
    )
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompt = [1, 17, 42, 99]

    async def main():
        engine = SGLangEngine(config)
        await engine.start()
        try:
            first = await engine.generate(prompt, greedy)
            again = await engine.generate(prompt, greedy)
            assert first.output_ids == again.output_ids
            # Rollouts stop: at the model's EOS (2) or at the length, never past an EOS.
            assert (first.finish_reason == "stop") == (first.output_ids[-1] == 2)
            assert 2 not in first.output_ids[:-1] and len(first.output_ids) <= 8
            assert first.token_versions == [0] * len(first.output_ids)
            assert all(lp <= 1e-6 for lp in first.output_logprobs)
            # ... and at a stop id: SGLang checks stop_token_ids only with ignore_eos false.
            stop = first.output_ids[0]
            stopped = await engine.generate(prompt, SamplingParams(
                max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
            assert stopped.output_ids == [stop] and stopped.finish_reason == "stop"
            sampled = await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=3))
            assert len(sampled.output_logprobs) == 4

            # Distributed update: lm_head := 0, so every logit ties and greedy picks token 0.
            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(_trainer_group, port, backend),
                engine.init_weights_update_group("127.0.0.1", port, 1, 2, "rl_async_test",
                                                 backend))
            zeros = torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16, device=device)
            await engine.pause_generation("abort")
            await asyncio.gather(
                engine.update_weights_from_distributed(["lm_head.weight"], ["bfloat16"],
                                                       [[VOCAB, HIDDEN]], "rl_async_test",
                                                       weight_version=1),
                asyncio.to_thread(torch.distributed.broadcast, zeros, 0, group))
            await engine.continue_generation()
            assert await engine.get_weight_version() == 1
            flat = await engine.generate(prompt, greedy)
            assert flat.output_ids == [0] * 8 and flat.finish_reason == "length"
            assert flat.token_versions == [1] * 8
            assert all(abs(lp + math.log(VOCAB)) < 1e-2 for lp in flat.output_logprobs)

            # Colocated update from tensors: restore the original head (CUDA IPC handle).
            head = weights["lm_head.weight"].to("cuda:0")
            await engine.update_weights_from_tensor([("lm_head.weight", head)], weight_version=2)
            restored = await engine.generate(prompt, greedy)
            assert restored.output_ids == first.output_ids
            assert restored.token_versions == [2] * len(first.output_ids)
            load = await engine.refresh_load()
            assert load.max_running_requests == 8 and load.running == 0
        finally:
            pid = engine._process.pid if engine._process else None
            await engine.shutdown()
        return pid

    pid = asyncio.run(main())
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole launched process group is gone
