"""The GPU checks of the first real fleet's stack (scripts/gpu_checks.py runs them): what the
review of SGLang 0.5.23, Transformer Engine and megatron-core 0.16.1 found the first
three_node run would meet. Each skips, with the reason, where this machine lacks its part.

    te_tp1_step            Transformer Engine imports, and a megatron-core TP1 step with the
                           Transformer Engine layer spec (bf16, distributed optimizer) trains
    resume_fused_adam      with TE installed megatron-core trains with TE's FusedAdam (the
                           class is asserted): save, rebuild, load and step equals the
                           uninterrupted step, and every param group's step is restored
    memory_swiglu          the peak of a megatron step with the fused SwiGLU and with the
                           unfused one, beside the memory plan's activations for each: the
                           measured difference against the plan's 2f/t per token per layer
    sglang_health_rule     where SGLang is installed: a paused server's generating /health
                           answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT, while the probe
                           rl-async's supervisor uses (SGLangEngine.health) passes
"""

from __future__ import annotations

import importlib.util

import torch

from gpu_check_memory import MODEL, _groups, _inputs, _peak
from gpu_check_train import Skip, _init_single_process

GiB = 1024 ** 3


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # an import hook that refuses it counts as absent
        return False


def _needs(device: str, *modules: str) -> None:
    if device != "cuda":
        raise Skip("needs a GPU (the CPU variants are the unit tests: tests/unit/"
                   "test_megatron_resume_and_memory.py, test_memory_plan.py, "
                   "test_sglang_rules.py)")
    for module in modules:
        if not _installed(module):
            raise Skip(f"needs {module}, not installed here (rl-async doctor FILE says what "
                       f"a run needs)")


def _trainer(impl: str, fusion: bool | None = None, **parallel):
    """A megatron trainer on MODEL (bf16 params, the distributed optimizer)."""
    from rl_async.state.models import build_causal_lm
    from rl_async.train.megatron_backend import MegatronTrainer, MegatronTrainerConfig
    from rl_async.train.megatron_model import MegatronParallelConfig

    hf = build_causal_lm(MODEL, None, 0, "float32")
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    cfg = MegatronParallelConfig(params_dtype="bfloat16", transformer_impl=impl,
                                 activation_fusion=fusion, **parallel)
    return MegatronTrainer(hf.config, state, MegatronTrainerConfig(
        parallel=cfg, global_batch_size=8, micro_batch_size=2, lr=1e-5))


def _reset() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.cuda.empty_cache()


def check_te_tp1_step(device: str) -> dict:
    _needs(device, "megatron.core", "transformer_engine")
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401  (the extension built for this torch)

    _init_single_process(device)
    trainer = _trainer("transformer_engine")
    metrics = trainer.train_collection(_groups(2, 4, 256, 256), 1)
    _reset()
    if metrics["train/loss"] != metrics["train/loss"]:
        raise AssertionError(f"TE step loss is NaN: {metrics}")
    return {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__,
            "loss": metrics["train/loss"], "grad_norm": metrics.get("train/grad_norm")}


def check_resume_fused_adam(device: str) -> dict:
    _needs(device, "megatron.core", "transformer_engine")
    import tempfile

    from rl_async.train.megatron_checkpoint import _distributed_parts

    _init_single_process(device)
    groups, later = _groups(2, 4, 256, 256), _groups(2, 4, 128, 128)
    first = _trainer("transformer_engine")
    inner = [p.optimizer for p in _distributed_parts(first.optimizer)]
    names = sorted({f"{type(o).__module__}.{type(o).__name__}" for o in inner})
    if not all(n.startswith("transformer_engine.") and n.endswith("FusedAdam") for n in names):
        raise AssertionError(f"megatron-core built {names}, not Transformer Engine's FusedAdam")
    first.train_collection(groups, 1)
    steps = [[g.get("step") for g in o.param_groups] for o in inner]
    with tempfile.TemporaryDirectory() as d:
        first.save_checkpoint(d, {"version": 1})
        want = first.train_collection(later, 2)
        weights = {k: v.float().cpu() for k, v in first.named_tensors_for_publication()}
        del first, inner
        _reset()
        resumed = _trainer("transformer_engine")
        resumed.load_checkpoint(d)
    again = [[g.get("step") for g in p.optimizer.param_groups]
             for p in _distributed_parts(resumed.optimizer)]
    got = resumed.train_collection(later, 2)
    diff = max(float((weights[k] - v.float().cpu()).abs().max())
               for k, v in resumed.named_tensors_for_publication())
    _reset()
    if again != steps or got["train/loss"] != want["train/loss"] or diff > 0:
        raise AssertionError(f"resumed FusedAdam differs: group steps {again} vs {steps}, loss "
                             f"{got['train/loss']} vs {want['train/loss']}, weights by {diff}")
    return {"optimizer": names, "group_steps": steps, "loss": got["train/loss"]}


def check_memory_swiglu(device: str) -> dict:
    _needs(device, "megatron.core")
    from rl_async.plan.memory import Dims, trainer_memory

    impl = "transformer_engine" if _installed("transformer_engine") else "local"
    recompute = "none" if impl == "transformer_engine" else "selective"  # no s x s scores
    _init_single_process(device)
    groups, out = _groups(2, 4, 1024, 1024), {"attention": impl, "recompute": recompute}
    for fused in (True, False):
        trainer = _trainer(impl, fused, recompute=recompute)
        trainer.train_collection(groups, 1)  # optimizer state and compiled kernels exist
        _, peak = _peak(lambda: trainer.train_collection(groups, 2))
        plan = trainer_memory(_inputs(backend="megatron", transformer_impl=impl,
                                      recompute=recompute, activation_fusion=fused),
                              Dims.from_config(MODEL))
        key = "fused" if fused else "unfused"
        out[f"{key}_peak_above_static_gib"] = round(peak, 3)
        out[f"{key}_plan_activations_gib"] = round(plan["activations"] / GiB, 3)
        del trainer
        _reset()
    measured = out["unfused_peak_above_static_gib"] - out["fused_peak_above_static_gib"]
    planned = out["unfused_plan_activations_gib"] - out["fused_plan_activations_gib"]
    out["measured_difference_gib"], out["plan_difference_gib"] = round(measured, 3), planned
    if not 0.5 * planned <= measured <= 1.5 * planned:
        raise AssertionError(f"unfused - fused peak {measured:.3f} GiB vs the plan's "
                             f"{planned:.3f} GiB (2f/t per token per layer)")
    return out


def check_sglang_health_rule(device: str) -> dict:
    _needs(device, "sglang")
    import asyncio
    import os
    import tempfile

    from rl_async.engine.base import TransientEngineError
    from rl_async.engine.sglang_engine import SGLangEngine, SGLangEngineConfig
    from rl_async.state.models import build_causal_lm, tiny_llama_config

    async def probe(engine, path: str) -> str:
        try:
            await engine._call("GET", path, timeout_s=60, timeout_key="check")
            return "200"
        except TransientEngineError as exc:
            return str(exc).split("HTTP ")[-1][:3]

    async def main(model_dir: str) -> dict:
        engine = SGLangEngine(SGLangEngineConfig(
            model_path=model_dir, gpu_ids=(0,), port=0, mem_fraction_static=0.3,
            startup_timeout_s=300, read_retries=0,
            server_args={"skip_tokenizer_init": True, "dtype": "bfloat16"}))
        await engine.start()
        try:
            await engine.pause_generation("abort")
            paused = {"health_generate": await probe(engine, "/health_generate"),
                      "health": await probe(engine, "/health")}
            await engine.health()  # the supervisor's probe passes on a paused engine
            await engine.continue_generation()
            running = await probe(engine, "/health_generate")
        finally:
            await engine.shutdown()
        if paused["health_generate"] != "503" or running != "200":
            raise AssertionError(f"paused {paused}, running {running}: not SGLang 0.5.23's "
                                 f"rule the double follows (tests/fake_sglang_server.py)")
        return {"paused": paused, "running_health_generate": running}

    os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"] = "3"  # SGLang's own knob (20 s by default)
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            build_causal_lm(tiny_llama_config(vocab_size=512, max_position_embeddings=512),
                            dtype="bfloat16").save_pretrained(model_dir)
            return asyncio.run(main(model_dir))
    finally:
        os.environ.pop("SGLANG_HEALTH_CHECK_TIMEOUT", None)
