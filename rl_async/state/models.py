"""Build the Hugging Face causal LM that both the engine and the trainer serve.

The trainer and every engine must start from IDENTICAL weights, otherwise the behaviour
log-probs of version 0 would not be the trainer's. `build_causal_lm` therefore builds the
model deterministically: for a config it initialises on CPU in float32 under a forked RNG
seeded with `seed`, then casts and moves, so the result does not depend on the device, on the
caller's global RNG state, or on which process builds it. A checkpoint directory is loaded
from local files only (no hub access at run time).
"""

from __future__ import annotations

import inspect

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"`, `"torch.bfloat16"` or a torch dtype -> torch dtype; errors name the value."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key in DTYPES:
        return DTYPES[key]
    value = getattr(torch, key, None)
    if isinstance(value, torch.dtype):
        return value
    raise ValueError(f"dtype = {dtype!r}: unknown; use one of {sorted(DTYPES)}")


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`."""
    name = getattr(model, "_rl_async_cache_kwarg", None)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        model._rl_async_cache_kwarg = name
    return name


def build_causal_lm(hf_config: dict | None = None, path: str | None = None, seed: int = 0,
                    dtype: str | torch.dtype = "float32", device: str = "cpu",
                    attn_implementation: str | None = None) -> torch.nn.Module:
    """A transformers causal LM from `hf_config` (a dict with `model_type`, e.g. a tiny
    `{"model_type": "llama", "vocab_size": 32, "hidden_size": 64, ...}`) initialised with
    `seed`, or from the local checkpoint directory `path`. Exactly one of the two is required.

    Returns the model in eval mode on `device` with parameters of `dtype`; gradients stay
    enabled (the trainer builds its copy with this same function).
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: import on use

    if (hf_config is None) == (path is None):
        raise ValueError(
            f"model spec: hf_config = {hf_config!r}, path = {path!r}: set exactly one "
            f"(hf_config for a freshly initialised model, path for a local checkpoint)"
        )
    torch_dtype = resolve_dtype(dtype)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True, **extra)
    else:
        if "model_type" not in hf_config:
            raise ValueError(f"hf_config = {hf_config!r}: missing 'model_type' (e.g. 'llama')")
        kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
        config = AutoConfig.for_model(hf_config["model_type"], **kwargs)
        # Forked RNG: the same seed gives the same weights whatever the caller did before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
        model = model.to(torch_dtype)
    return model.to(device).eval()


def tiny_llama_config(vocab_size: int = 32, hidden_size: int = 64, num_layers: int = 2,
                      max_position_embeddings: int = 256, model_type: str = "llama") -> dict:
    """A tiny config for tests, demos and benchmarks (llama or qwen2 architecture)."""
    return {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
