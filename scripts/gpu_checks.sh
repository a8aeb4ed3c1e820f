#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (about 10 minutes):
# the embedded engine on CUDA, the torch trainer in bf16 on CUDA, megatron-core training
# steps, and (when SGLang is importable) the SGLang round trip. Results go to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=${OUT:-/tmp/rl-async-gpu}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  # A GPU machine takes the CUDA build of the pinned torch range from the index.
  .venv/bin/python -m pip install -q "torch>=2.4,<2.15"
  .venv/bin/python -m pip install -q -e ".[dev]"
  .venv/bin/python -m pip install -q --no-deps "megatron-core==0.16.1"
fi
.venv/bin/python -c "import torch; print('cuda', torch.cuda.is_available(), torch.__version__)" \
  | tee "$OUT/torch.txt"
.venv/bin/pytest -m gpu tests/gpu tests/unit -q -rs 2>&1 | tee "$OUT/pytest-gpu.txt"
exit "${PIPESTATUS[0]}"
