"""The GPU checks of memory (scripts/gpu_checks.py runs them): what the memory plan and the
chunked log-probs promise, measured on the device.

    logprobs_chunked           vocabulary-chunked log-probs and entropy equal the plain fp32
                               computation on a [2, 2048, 152064] bf16 logits tensor, and
                               their peak memory is reported beside the plain one's
    memory_plan_torch_step     the measured peak of a torch-trainer step (a ~0.2B Qwen2-shaped
                               model, bf16 autocast, 4k-token micro-batches) against the plan's
                               estimate for the same run file (rl_async/plan/memory.py)
    megatron_resume_and_memory megatron-core on the GPU: the distributed optimizer (bf16
                               params) resumes from a checkpoint and takes the step an
                               uninterrupted trainer takes; the peak of a step with local
                               attention, and with selective recompute, against the plan
"""

from __future__ import annotations

import torch

from gpu_check_train import Skip

GiB = 1024 ** 3
MODEL = {"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 1024,
         "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "max_position_embeddings": 4096,
         "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / GiB


def check_logprobs_chunked(device: str) -> dict:
    from rl_async.train.logits import token_logprobs

    shape = (2, 2048, 152064) if device == "cuda" else (2, 64, 5000)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
    targets = torch.randint(0, shape[-1], shape[:2], generator=gen, device=device)

    def chunked():
        x = logits.detach().requires_grad_(True)
        lp, ent = token_logprobs(x, targets, 0.9, with_entropy=True)
        lp.sum().backward()
        return lp.detach(), ent, x.grad

    def plain():
        x = logits.detach().requires_grad_(True)
        logp = torch.log_softmax(x.float() / 0.9, -1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1).detach()
        lp.sum().backward()
        return lp.detach(), ent, x.grad

    if device == "cuda":
        (a, peak_a), (b, peak_b) = _peak(chunked), _peak(plain)
    else:
        (a, peak_a), (b, peak_b) = (chunked(), 0.0), (plain(), 0.0)
    worst = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    if worst > 2e-3:
        raise AssertionError(f"chunked vs plain log-probs/entropy/grad differ by {worst:.2e}")
    return {"shape": list(shape), "max_abs_diff": worst, "chunked_peak_gib": round(peak_a, 2),
            "plain_peak_gib": round(peak_b, 2)}


def _groups(n_groups: int, size: int, prompt: int, response: int):
    from rl_async.base.types import Group, Sample

    gen = torch.Generator().manual_seed(3)
    out = []
    for g in range(n_groups):
        ids = torch.randint(3, MODEL["vocab_size"], (prompt,), generator=gen).tolist()
        out.append(Group(f"g{g}", [Sample(
            prompt_id=f"p{g}", prompt_ids=ids,
            response_ids=torch.randint(3, MODEL["vocab_size"], (response,), generator=gen).tolist(),
            token_versions=[0] * response, behavior_logprobs=[-10.0] * response,
            reward=float(i % 2)) for i in range(size)]))
    return out


def _inputs(**kw):
    """The plan's inputs for the run these checks train: 2 groups of 4 samples of 1024 prompt
    + 1024 response tokens, bf16, micro-batches of 2 (a pydantic-free MemoryInputs: the GPU
    machine has no pydantic)."""
    from rl_async.plan.memory import MemoryInputs

    base = dict(backend="torch", trainer_workers=1, trainer_gpus=1, micro_batch_size=2,
                prompt_tokens=1024, max_response_len=1024, half_precision=True)
    return MemoryInputs(**{**base, **kw})


def check_memory_plan_torch(device: str) -> dict:
    if device != "cuda":
        raise Skip("a GPU measurement (CPU peak memory is not the allocator's)")
    from rl_async.plan.memory import Dims, trainer_memory
    from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

    plan = trainer_memory(_inputs(), Dims.from_config(MODEL))
    parts = ("weights", "gradients", "optimizer", "autocast_weights", "activations", "logits")
    want = sum(plan[k] for k in parts) / GiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier checks left behind is not ours
    trainer = TorchTrainer(TorchTrainerConfig(hf_config=MODEL, global_batch_size=8,
                                              micro_batch_size=2, device="cuda", lr=1e-5))
    groups = _groups(2, 4, 1024, 1024)
    trainer.train_collection(groups, 1)  # optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_collection(groups, 2)
    torch.cuda.synchronize()
    measured = (torch.cuda.max_memory_allocated() - before) / GiB
    ratio = want / measured
    if not 0.6 <= ratio <= 1.6:
        raise AssertionError(f"the plan says {want:.2f} GiB, the step peaked at {measured:.2f} "
                             f"(ratio {ratio:.2f}; allowed 0.6-1.6)")
    return {"plan_gib": round(want, 2), "measured_peak_gib": round(measured, 2),
            "ratio": round(ratio, 2),
            "plan_parts_gib": {k: round(plan[k] / GiB, 3) for k in parts}}


def check_megatron_resume_and_memory(device: str) -> dict:
    if device != "cuda":
        raise Skip("the CPU variant is tests/unit/test_megatron_resume_and_memory.py")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise Skip(f"megatron-core is not importable ({exc}); pass --wheels DIR") from exc
    import tempfile

    from gpu_check_train import _init_single_process
    from megatron.core import parallel_state

    from rl_async.plan.memory import Dims, trainer_memory
    from rl_async.state.models import build_causal_lm
    from rl_async.train.megatron_backend import MegatronTrainer, MegatronTrainerConfig
    from rl_async.train.megatron_model import MegatronParallelConfig

    _init_single_process(device)
    out: dict = {}
    groups = _groups(2, 4, 1024, 1024)
    hf = build_causal_lm(MODEL, None, 0, "float32")
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    def build(recompute: str):
        parallel = MegatronParallelConfig(params_dtype="bfloat16", recompute=recompute,
                                          transformer_impl="local")
        return MegatronTrainer(hf.config, state, MegatronTrainerConfig(
            parallel=parallel, global_batch_size=8, micro_batch_size=2, lr=1e-5))

    for recompute in ("none", "selective"):
        trainer = build(recompute)
        trainer.train_collection(groups, 1)
        _, peak = _peak(lambda: trainer.train_collection(groups, 2))
        plan = trainer_memory(_inputs(backend="megatron", transformer_impl="local",
                                      recompute=recompute), Dims.from_config(MODEL))
        out[f"{recompute}_peak_above_static_gib"] = round(peak, 2)
        out[f"{recompute}_plan_activations_logits_gib"] = round(
            (plan["activations"] + plan["logits"] + plan.get("recompute_transient", 0.0))
            / GiB, 2)
        if recompute == "none":
            with tempfile.TemporaryDirectory() as d:
                trainer.save_checkpoint(d, {"version": 2})
                want = trainer.train_collection(_groups(2, 4, 256, 256), 3)
                weights = {k: v.float().cpu() for k, v in trainer.named_tensors_for_publication()}
                del trainer
                parallel_state.destroy_model_parallel()
                resumed = build(recompute)
                resumed.load_checkpoint(d)
            got = resumed.train_collection(_groups(2, 4, 256, 256), 3)
            again = {k: v.float().cpu() for k, v in resumed.named_tensors_for_publication()}
            diff = max(float((weights[k] - again[k]).abs().max()) for k in weights)
            if abs(got["train/loss"] - want["train/loss"]) > 1e-6 or diff > 0:
                raise AssertionError(f"resumed step differs: loss {got['train/loss']} vs "
                                     f"{want['train/loss']}, max weight diff {diff}")
            out["resume_loss"] = got["train/loss"]
            del resumed
        parallel_state.destroy_model_parallel()
    return out
