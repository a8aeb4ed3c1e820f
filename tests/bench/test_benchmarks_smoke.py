"""Every benchmark runs in CI, in its `--smoke` mode (seconds, tiny sizes, the same code path
and the same JSON keys), so a benchmark that breaks fails the suite instead of rotting until
someone needs its numbers (benchmarks/weight_publication.py crashed on main for a while)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# benchmark -> keys its JSON line must carry (SPEC §11 for the two it names)
KEYS = {
    "buffer_ops.py": {"capacities", "us_per_group"},
    "engine_throughput.py": {"embedded_tokens_per_s", "hf_generate_tokens_per_s", "ratio"},
    "weight_publication.py": {"publication_seconds", "raw_broadcast_seconds", "ratio", "bytes"},
    "orchestration.py": {"samples_per_s", "ray_calls_per_sample", "raw_calls_per_s",
                         "controller_overhead_fraction"},
    "async_vs_sync.py": {"speedup"},
    "time_to_reward.py": {"target_reward", "modes", "best_speedup"},
    "simulate_vs_real.py": {"calibrated_on", "cases"},
    "vs_trl.py": {"target_reward", "sides", "speedup"},
    "gateway_overhead.py": {"turns", "direct_seconds", "gateway_seconds", "overhead",
                            "overhead_http", "overhead_at_max_turns"},
}

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("script", sorted(KEYS))
def test_benchmark_smoke_prints_its_json_line(script, tmp_path):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS[script] <= set(line), (sorted(line), done.stdout[-2000:])
