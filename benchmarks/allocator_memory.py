"""What `cluster.cpu_allocator = "reuse"` costs in resident memory, and what it buys in time.

The setting (rl_async/base/allocator.py) keeps glibc from unmapping freed blocks, so CPU
engine and trainer processes stop page-faulting fresh memory every step; the cost is memory
the processes keep. This runs the same config with `reuse` and with `system` (glibc's
defaults) on one local cluster, alternating which runs first, and reads each process's
resident memory from the metrics every collection logs (`engine/0/rss_bytes`,
`trainer/rss_bytes`):

- the local demo (cluster_configs/local.toml) for --updates (2,000 by default);
- the real SmolLM2-135M config (cluster_configs/smollm2.toml) for --smollm2-updates.

Per config, setting and process: resident memory at the first logged collection, its peak,
its last value, and the growth over the run's second half (bytes; a leak or fragmentation
drift shows here, a one-off peak does not); and the training loop's seconds. The line's
`extra_bytes` is reuse minus system per process (peak and last), `seconds_ratio` system's
loop seconds over reuse's (> 1: reuse is faster).

    python benchmarks/allocator_memory.py --json [--updates 2000] [--smollm2-updates 60]
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from _common import ROOT, init_ray, load_checked, TimedRun  # noqa: I001  (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray

SETTINGS = ("reuse", "system")
PROCESSES = {"engine": "engine/0/rss_bytes", "trainer": "trainer/rss_bytes"}


def run_one(path: str, setting: str, updates: int, extra: list[str]) -> dict:
    cfg, report = load_checked(path, [
        f"run.name=alloc-{setting}", f"run.max_steps={updates}", "wandb.mode=disabled",
        f"cluster.cpu_allocator={setting}", "run.output_dir=/tmp/rl-async-allocator-runs",
        *extra])
    result = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    rows = [m for _t, _s, m in result["rows"] if PROCESSES["trainer"] in m]
    stamps = [t for t, _s, m in result["rows"] if PROCESSES["trainer"] in m]
    out = {"updates": result["summary"]["steps"],
           "loop_seconds": round(stamps[-1] - stamps[0], 2)}
    for name, key in PROCESSES.items():
        series = [m[key] for m in rows if key in m]
        half = series[len(series) // 2]
        out[name] = {"first": series[0], "peak": max(series), "last": series[-1],
                     "second_half_growth": series[-1] - half, "samples": len(series)}
    return out


def compare(runs: dict[str, dict]) -> dict:
    reuse, system = runs["reuse"], runs["system"]
    return {
        "extra_bytes": {name: {"peak": reuse[name]["peak"] - system[name]["peak"],
                               "last": reuse[name]["last"] - system[name]["last"]}
                        for name in PROCESSES},
        "seconds_ratio": round(system["loop_seconds"] / reuse["loop_seconds"], 3),
        **runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--updates", type=int, default=2000, help="local demo updates")
    parser.add_argument("--smollm2-updates", type=int, default=60,
                        help="SmolLM2 updates (0: skip)")
    args = parse_with_smoke(parser, updates=4, smollm2_updates=0)
    init_ray(num_cpus=2)
    started = time.monotonic()
    configs = {"local": ("cluster_configs/local.toml", args.updates, ["eval.every_steps=100"]),
               "smollm2": ("cluster_configs/smollm2.toml", args.smollm2_updates,
                           ["eval.every_steps=0", "eval.n_samples=0",
                            f"task.path={ROOT}/data/arith/train.jsonl",
                            f"task.eval_path={ROOT}/data/arith/eval.jsonl"])}
    result = {}
    for k, (name, (path, updates, extra)) in enumerate(configs.items()):
        if not updates:
            continue
        order = SETTINGS if k % 2 == 0 else SETTINGS[::-1]  # alternate who runs first
        result[name] = compare({s: run_one(path, s, updates, extra) for s in order})
    result["benchmark_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
