#!/usr/bin/env bash
# The GPU checks (scripts/gpu_checks.py) as one offline command for a lent GPU machine:
#
#   scripts/gpu_checks.sh [--cpu] [--out REPORT.json] [--wheels DIR] [--budget-s SECONDS]
#
# Needs a Python with torch and transformers (PYTHON=..., else .venv/bin/python, else
# python3); needs no Ray, no SGLang, no network, and installs nothing from an index:
# megatron-core, when the Python lacks it, comes from a local wheel folder (--wheels DIR or
# RL_ASYNC_WHEELS) into a private directory under the output folder. The checkout is imported
# from here (PYTHONPATH), not installed. Writes one JSON report (default $OUT/gpu_checks.json,
# or /tmp/rl-async-gpu/gpu_checks.json) and finishes within the budget (default 480 s, so a
# lent machine's 10-minute command limit leaves room; the checks stop starting 60 s before
# it). Checks this machine cannot run (no Transformer Engine, no SGLang, one GPU) are
# `skipped` with the reason, listed at the end. `--cpu` runs the same checks on the CPU (CI).
# Exit status: 0 when every check passed, 1 otherwise, 124 when the budget ran out.
set -uo pipefail
cd "$(dirname "$0")/.."

cpu=()
out=""
wheels="${RL_ASYNC_WHEELS:-}"
budget=480
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=(--cpu); shift ;;
    --out) out="$2"; shift 2 ;;
    --wheels) wheels="$2"; shift 2 ;;
    --budget-s) budget="$2"; shift 2 ;;
    *) echo "gpu_checks.sh: unknown argument '$1' (use --cpu, --out, --wheels, --budget-s)" >&2
       exit 2 ;;
  esac
done
out="${out:-${OUT:-/tmp/rl-async-gpu}/gpu_checks.json}"
mkdir -p "$(dirname "$out")"

py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import megatron.core" 2>/dev/null; then
  if [ -n "$wheels" ]; then
    deps="$(dirname "$out")/gpu_checks_deps"
    # --no-index: the wheel folder only, never the network; --no-deps: nothing else changes.
    if "$py" -m pip install -q --no-index --find-links "$wheels" --no-deps --target "$deps" \
         megatron-core; then
      export PYTHONPATH="$PYTHONPATH:$deps"
    else
      echo "gpu_checks.sh: no usable megatron-core wheel in $wheels; the megatron check will" \
           "be skipped" >&2
    fi
  fi
fi

if [ "${#cpu[@]}" -eq 0 ]; then
  nvidia-smi > "$(dirname "$out")/nvidia-smi.txt" 2>&1 || true
fi
# The checks stop starting new work 60 s before the budget; `timeout` is the hard stop.
inner=$(( budget > 120 ? budget - 60 : budget / 2 ))
timeout --kill-after=10 "$budget" "$py" scripts/gpu_checks.py ${cpu[@]+"${cpu[@]}"} --out "$out" \
  --budget-s "$inner"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  "$py" - "$out" "$budget" <<'EOF'
import json, sys
path, budget = sys.argv[1], sys.argv[2]
try:
    report = json.load(open(path))
except (OSError, ValueError):
    report = {"checks": {}}
report.update(passed=False, timed_out=True,
              error=f"scripts/gpu_checks.sh stopped the checks after --budget-s {budget}")
json.dump(report, open(path, "w"), indent=2)
EOF
  rc=124
fi
echo "gpu_checks: report in $out (exit $rc)"
exit "$rc"
