"""Atomic trainer checkpoints: model, optimizer, optimizer-step counter, policy version."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_FILE = "trainer_state.pt"
FORMAT_VERSION = 1


def save_state(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write `state` to `directory/trainer_state.pt` via a temporary file and a rename.

    A crash mid-write leaves either the previous checkpoint or none, never a torn file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_FILE
    tmp = directory / f".{CHECKPOINT_FILE}.tmp.{os.getpid()}"
    torch.save({"format_version": FORMAT_VERSION, **state}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def load_state(directory: str | os.PathLike, map_location: str | torch.device) -> dict[str, Any]:
    path = Path(directory) / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no trainer checkpoint at {path}: pass a directory written by "
                                f"save_checkpoint")
    # Our own file: optimizer state holds plain Python values, so allow full unpickling.
    state = torch.load(path, map_location=map_location, weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {state.get('format_version')!r}, expected "
                         f"{FORMAT_VERSION}: it was written by another rl-async version")
    return state


def rng_state() -> dict[str, Any]:
    """Python and torch RNG states (CUDA too where present), for an exact continuation."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
