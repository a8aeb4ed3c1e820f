"""The policy as a Hugging Face directory a user can load: `save_pretrained`'s layout.

    export_hf(named HF tensors, model spec, OUT)
      OUT.tmp/  model.safetensors (or model-0000k-of-0000n.safetensors + index.json)
                config.json (dtype = model.dtype), generation_config.json, tokenizer files
      rename OUT.tmp -> OUT                     (a reader never sees a half-written export)

Both trainer backends hand over the same thing: full tensors under Hugging Face names (the
torch trainer's parameters; megatron-core's gathered and converted by its Megatron->HF
conversion), tied weights once under their first name, exactly what `save_pretrained` writes
and `AutoModelForCausalLM.from_pretrained` reads. No model is instantiated here: a 7B export
costs one cast copy of the weights, not a second model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from rl_async.state.models import resolve_dtype
from rl_async.state.weights import require_finite

SHARD_BYTES = 5 * 1024 ** 3  # save_pretrained's default max_shard_size
WEIGHTS = "model.safetensors"


def _hf_config(hf_config: dict | None, path: str | None):
    from transformers import AutoConfig

    if path is not None:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    spec = dict(hf_config)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _write_weights(named: Sequence[tuple[str, torch.Tensor]], out: Path, dtype: torch.dtype,
                   shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in named:
        require_finite(name, tensor, "Hugging Face export")
        t = tensor.detach().to("cpu", dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() != nbytes:
            # A view into a larger storage (megatron's gate/up halves of one fc1, a CPU
            # tensor that .to() did not copy): safetensors refuses tensors sharing memory.
            t = t.clone()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata={"format": "pt"})
        return
    index: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / f"{WEIGHTS}.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=2))


def _write_tokenizer_and_generation(out: Path, config, path: str | None,
                                    tokenizer_path: str | None) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    source = tokenizer_path or path
    if source is not None:
        try:
            AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
        except (OSError, ValueError) as exc:  # a config-only dir: the export still loads
            print(f"[rl-async] export: no tokenizer saved ({source}: {exc})", flush=True)
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True) if path else None
    except OSError:  # the checkpoint has no generation_config.json
        gen = None
    (gen or GenerationConfig.from_model_config(config)).save_pretrained(out)


def export_hf(named: Sequence[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, *,
              hf_config: dict | None = None, path: str | None = None,
              dtype: str = "float32", tokenizer_path: str | None = None,
              shard_bytes: int = SHARD_BYTES) -> Path:
    """Write `named` (HF names -> full tensors) as a loadable Hugging Face directory at
    `out_dir`, replacing any previous export there. The model spec is the run's: exactly one
    of `hf_config` (a config dict with `model_type`) or `path` (the source checkpoint, whose
    config, generation config and tokenizer are carried over)."""
    if (hf_config is None) == (path is None):
        raise ValueError("export_hf: set exactly one of hf_config or path (model.hf_config / "
                         "model.path)")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch_dtype = resolve_dtype(dtype)
    config = _hf_config(hf_config, path)
    config.dtype = torch_dtype
    config.save_pretrained(tmp)
    _write_weights(named, tmp, torch_dtype, shard_bytes)
    _write_tokenizer_and_generation(tmp, config, path, tokenizer_path)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                      dtype: str = "float32") -> Path:
    """`rl-async export CHECKPOINT OUT`: the checkpoint's policy as a Hugging Face directory.
    A checkpoint written with its export (`CHECKPOINT/hf`) is copied; an older torch-trainer
    checkpoint (`trainer_state.pt` only) is rebuilt from its saved model spec and weights."""
    ckpt = Path(checkpoint)
    if (ckpt / "hf" / "config.json").is_file():
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(ckpt / "hf", tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return out
    from rl_async.state.models import build_causal_lm
    from rl_async.state.trainer_state import CHECKPOINT_FILE, load_state

    if not (ckpt / CHECKPOINT_FILE).is_file():
        raise FileNotFoundError(
            f"{ckpt}: not a checkpoint (no hf/ export and no {CHECKPOINT_FILE}); megatron-core "
            f"checkpoints are exported when written: use their hf/ directory")
    state = load_state(ckpt, map_location="cpu")
    spec = state["config"]
    model = build_causal_lm(spec.get("hf_config"), spec.get("model_path"), spec.get("seed", 0))
    model.load_state_dict(state["model"])
    return export_hf(list(model.named_parameters()), out_dir, hf_config=spec.get("hf_config"),
                     path=spec.get("model_path"), dtype=dtype)
