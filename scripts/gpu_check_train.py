"""The GPU checks of the engine, the trainers and the publication codec (scripts/gpu_checks.py
runs them): the embedded engine against HF `generate`, a torch-trainer step in bf16 autocast,
a megatron-core TP1 step with the HF round trip, and the bucket codec on the device."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HF = {"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "tie_word_embeddings": False}
SEED = 7


class Skip(Exception):
    """A check that cannot run here (e.g. megatron-core missing); not a failure."""


def close(got: float, want: float, rel: float, abs_: float) -> bool:
    return abs(got - want) <= abs_ + rel * abs(want)


def compare(got: dict, want: dict, keys, rel: float, abs_: float) -> dict:
    """{key: [got, want]} for every key that differs beyond the tolerance."""
    return {k: [got[k], want[k]] for k in keys if not close(got[k], want[k], rel, abs_)}


def groups(version: int = 1):
    """Two groups of four samples; spread behaviour log-probs so TIS clips some tokens."""
    from rl_async.base.types import Group, Sample

    gen = torch.Generator().manual_seed(11)
    out = []
    for g in range(2):
        prompt = torch.randint(3, HF["vocab_size"], (4 + g,), generator=gen).tolist()
        samples = []
        for i in range(4):
            n = 3 + (i + g) % 4
            samples.append(Sample(
                prompt_id=f"p{g}", prompt_ids=prompt,
                response_ids=torch.randint(3, HF["vocab_size"], (n,), generator=gen).tolist(),
                token_versions=[version - 1 + (i + k) % 2 for k in range(n)],
                behavior_logprobs=(-3.0 - 3.0 * torch.rand(n, generator=gen)).tolist(),
                reward=float((i * 7 + g) % 3)))
        out.append(Group(group_id=f"g{g}", samples=samples))
    return out


# ---------------------------------------------------------------------------- the checks

def check_engine(device: str) -> dict:
    """Greedy: the engine batches 4 requests of different lengths; HF generates each alone."""
    from rl_async.engine.base import SamplingParams
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from rl_async.state.models import build_causal_lm

    prompts = [[5, 9, 13], [40, 41, 42, 43, 44, 45], [7], [88, 3, 60, 12]]
    new = 8
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=HF, init_seed=SEED, device=device,
                                                 max_running_requests=4))

    async def run():
        try:
            return await asyncio.gather(*(
                engine.generate(p, SamplingParams(max_new_tokens=new, temperature=0.0), f"r{i}")
                for i, p in enumerate(prompts)))
        finally:
            await engine.close()

    outs = asyncio.run(run())
    hf = build_causal_lm(HF, None, SEED, "float32", device)
    mismatched, worst = [], 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ids = torch.tensor([prompt], device=device)
        gen = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                          output_logits=True)
        want = gen.sequences[0, len(prompt):].tolist()
        if out.output_ids != want:
            mismatched.append({"request": i, "engine": out.output_ids, "hf": want})
            continue
        lp = torch.stack([torch.log_softmax(l[0].float(), -1)[t] for l, t in
                          zip(gen.logits, want)]).cpu()
        worst = max(worst, float((lp - torch.tensor(out.output_logprobs)).abs().max()))
    if mismatched or worst > 1e-3:
        raise AssertionError(f"engine vs HF generate: token mismatches {mismatched}, "
                             f"max |log-prob diff| {worst:.2e} (allowed 1e-3)")
    return {"requests": len(prompts), "new_tokens": new, "max_logprob_diff": worst}


def torch_trainer(device: str, **kw):
    from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

    return TorchTrainer(TorchTrainerConfig(
        hf_config=HF, seed=SEED, lr=1e-3, global_batch_size=8, micro_batch_size=4,
        device=device, **kw))


LOSS_KEYS = ("train/loss", "train/tis_clip_fraction", "train/tis_ess_ratio",
             "train/logprob_mismatch", "train/entropy", "train/grad_norm")


def check_torch_trainer(device: str) -> dict:
    """bf16 autocast on GPU vs fp32 on CPU: same loss and metrics within bf16 error."""
    got = torch_trainer(device).train_collection(groups(), 1)
    want = torch_trainer("cpu").train_collection(groups(), 1)
    bad = compare(got, want, LOSS_KEYS, rel=5e-2, abs_=5e-3)
    if bad or any(v != v for v in got.values()):
        raise AssertionError(f"torch trainer on {device} vs CPU differ: {bad}")
    return {"loss": got["train/loss"], "cpu_loss": want["train/loss"],
            "bf16_autocast": device != "cpu"}


def _init_single_process(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def check_megatron(device: str) -> dict:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise Skip(f"megatron-core is not importable ({exc}); pass --wheels DIR with a "
                   f"megatron_core wheel") from exc
    if device == "cpu":  # megatron-core assumes CUDA in a few places: the test-only shims
        sys.path.insert(0, str(ROOT / "tests" / "unit"))
        from megatron_cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    from rl_async.state.models import build_causal_lm
    from rl_async.train import megatron_convert as conv
    from rl_async.train.megatron_backend import MegatronTrainer, MegatronTrainerConfig

    _init_single_process(device)
    hf = build_causal_lm(HF, None, SEED, "float32")
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    shape = conv.ModelShape.from_hf_config(hf.config)
    back = conv.megatron_to_hf(conv.hf_to_megatron(state, shape, vocab_rows=128), shape)
    if back.keys() != state.keys() or not all(torch.equal(back[k], state[k]) for k in state):
        raise AssertionError("HF -> megatron -> HF conversion is not exact")
    trainer = MegatronTrainer(hf.config, state, MegatronTrainerConfig(
        global_batch_size=8, micro_batch_size=4, lr=1e-3,
        use_distributed_optimizer=device == "cuda"))  # CUDA-only in megatron-core
    loaded = dict(trainer.named_tensors_for_publication())
    if not all(torch.equal(loaded[k].cpu(), state[k]) for k in state):
        raise AssertionError("the megatron model's exported weights differ from the HF ones")
    got = trainer.train_collection(groups(), 1)
    want = torch_trainer(device, bf16=False).train_collection(groups(), 1)
    bad = compare(got, want, LOSS_KEYS, rel=1e-3, abs_=1e-4)
    if bad:
        raise AssertionError(f"megatron vs torch trainer (fp32, {device}) differ: {bad}")
    trained = dict(trainer.named_tensors_for_publication())
    moved = sum(not torch.equal(trained[k].cpu(), state[k]) for k in state)
    if moved == 0:
        raise AssertionError("the optimizer step changed no weight")
    details = {"loss": got["train/loss"], "torch_loss": want["train/loss"],
               "tensors_changed": moved, "tensors": len(state)}
    if device == "cuda":  # bf16 params (megatron's mixed-precision optimizer): GPU only
        from rl_async.train.megatron_model import MegatronParallelConfig

        bf16 = MegatronTrainer(hf.config, state, MegatronTrainerConfig(
            parallel=MegatronParallelConfig(params_dtype="bfloat16"), global_batch_size=8,
            micro_batch_size=4, lr=1e-3)).train_collection(groups(), 1)
        if not close(bf16["train/loss"], want["train/loss"], rel=5e-2, abs_=5e-3):
            raise AssertionError(f"megatron bf16 loss {bf16['train/loss']} vs fp32 torch "
                                 f"{want['train/loss']}")
        details["bf16_loss"] = bf16["train/loss"]
    return details


def check_buckets(device: str) -> dict:
    from rl_async.state.weights import bucket_named_tensors, flatten_bucket, unflatten_bucket

    gen = torch.Generator().manual_seed(3)
    named = [(f"t{i}", torch.randn(*shape, generator=gen).to(dtype).to(device))
             for i, (shape, dtype) in enumerate([
                 ((3, 5), torch.float32), ((7,), torch.bfloat16), ((4, 4, 2), torch.float16),
                 ((33,), torch.bfloat16), ((2, 3), torch.float32), ((500,), torch.float32)])]
    named.append(("steps", torch.arange(5, dtype=torch.int64, device=device)))
    buckets = bucket_named_tensors(named, max_bucket_bytes=256)  # several, one oversize
    rebuilt, reused = [], None
    for bucket in buckets:
        flat, names, dtypes, shapes = flatten_bucket(bucket)
        if flat.device.type != torch.device(device).type or flat.dtype != torch.uint8:
            raise AssertionError(f"flat bucket on {flat.device} as {flat.dtype}")
        reused = torch.empty_like(flat)
        again, *_ = flatten_bucket(bucket, out=reused)  # the publication's reused buffer
        if again.data_ptr() != reused.data_ptr() or not torch.equal(again, flat):
            raise AssertionError("flatten_bucket(out=...) did not fill the given buffer")
        rebuilt += unflatten_bucket(flat, names, dtypes, shapes)
    bad = [n for (n, a), (m, b) in zip(named, rebuilt)
           if n != m or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)]
    if bad or len(rebuilt) != len(named):
        raise AssertionError(f"pack/unpack changed {bad} ({len(rebuilt)} of {len(named)} back)")
    return {"tensors": len(named), "buckets": len(buckets)}
