"""`run.deterministic` in the trainer: deterministic kernels and seeded RNGs, set once per
trainer process before its model is built (actors/trainer.py `build_trainer`).

    torch.use_deterministic_algorithms(True)   an op with no deterministic implementation
                                               raises, naming itself (no silent fallback)
    CUBLAS_WORKSPACE_CONFIG=:4096:8            what cuBLAS needs for reproducible GEMMs on
                                               GPU (set in the actor's environment too, so
                                               it is there before cuBLAS initialises)
    cuDNN benchmark off, deterministic on
    Python, torch (CPU and CUDA) RNGs seeded from model.init_seed

What stays non-bit-reproducible on GPU even so (docs/reproducibility.md): NCCL reductions
(DDP and TP all-reduce order and algorithm), SGLang's own kernels unless
--enable-deterministic-inference (which rl-async passes with run.deterministic) covers the
attention backend in use, and any retraction under KV pressure.
"""

from __future__ import annotations

import os
import random

import torch

CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def configure(deterministic: bool, seed: int) -> None:
    if not deterministic:
        return
    for key, value in CUBLAS_ENV.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    random.seed(seed)
    torch.manual_seed(seed)  # CUDA generators too, where CUDA is present
