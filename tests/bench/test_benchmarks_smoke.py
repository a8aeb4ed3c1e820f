"""Every benchmark runs in CI, in its `--smoke` mode (seconds, tiny sizes, the same code path
and the same JSON keys), so a benchmark that breaks fails the suite instead of rotting until
someone needs its numbers (benchmarks/weight_publication.py crashed on main for a while)."""

from __future__ import annotations

import json
import math
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
    "weight_publication.py": {"publication_seconds", "raw_broadcast_seconds", "ratio", "bytes",
                              "snapshot_seconds", "transfer_seconds", "load_seconds",
                              "pause_seconds", "pause_fraction", "cpu_ratio"},
    "publication_scaling.py": {"engines", "chain", "ratio_last_to_1", "bytes"},
    "orchestration.py": {"samples_per_s", "ray_calls_per_sample", "raw_calls_per_s",
                         "controller_overhead_fraction"},
    "async_vs_sync.py": {"speedup"},
    "time_to_reward.py": {"target_reward", "modes", "best_speedup"},
    "simulate_vs_real.py": {"calibrated_on", "cases"},
    "vs_trl.py": {"target_reward", "sides", "speedup"},
    "gateway_overhead.py": {"turns", "direct_seconds", "gateway_seconds", "overhead",
                            "overhead_http", "overhead_at_max_turns"},
    "allocator_memory.py": {"local", "benchmark_seconds"},
    "offpolicy_lag.py": {"target_reward", "cells", "goals"},
    "staleness_prediction.py": {"cells", "within_target", "of"},
    "routing_replay.py": {"r3", "off", "r3_over_off", "noise"},
}

# benchmark -> figures that must be finite and > 0 even at smoke sizes ("a.*.b": every entry
# of a dict): a benchmark that prints 0 or NaN where it measured something is broken.
POSITIVE = {
    "engine_throughput.py": ["ratio", "embedded_tokens_per_s", "hf_generate_tokens_per_s"],
    "weight_publication.py": ["ratio", "publication_seconds", "raw_broadcast_seconds", "bytes"],
    "orchestration.py": ["samples_per_s", "raw_calls_per_s"],
    "async_vs_sync.py": ["speedup", "sync_seconds", "async_seconds"],
    "time_to_reward.py": ["modes.*.median_loop_s"],
    "vs_trl.py": ["sides.*.seconds_per_update_median", "sides.*.generated_samples_per_update",
                  "sides.*.trained_samples_per_update"],
    "buffer_ops.py": ["us_per_group.*"],
    "publication_scaling.py": ["chain.seconds", "chain.rank0_bytes", "bytes"],
    "allocator_memory.py": ["local.seconds_ratio", "local.reuse.engine.peak",
                            "local.system.trainer.peak"],
    "offpolicy_lag.py": ["cells.*.*.loop_seconds"],
    "staleness_prediction.py": ["cells.*.measured.samples_per_s",
                                "cells.*.predicted.samples_per_s"],
    "routing_replay.py": ["r3.seconds_per_update", "off.seconds_per_update",
                          "r3.replay_bytes_per_sample"],
}

pytestmark = pytest.mark.ray


def values_at(line, path: str):
    """The values at a dotted path, "*" standing for every value of a dict; lists flattened."""
    nodes = [line]
    for part in path.split("."):
        nodes = [v for n in nodes for v in (n.values() if part == "*" else [n[part]])]
    return [x for n in nodes for x in (n if isinstance(n, list) else [n])]


@pytest.mark.parametrize("script", sorted(KEYS))
def test_benchmark_smoke_prints_its_json_line(script, tmp_path):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS[script] <= set(line), (sorted(line), done.stdout[-2000:])
    for path in POSITIVE.get(script, []):
        for value in values_at(line, path):
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, \
                (script, path, value)
