"""How well `rl-async simulate` predicts real runs: calibrate on one real run, predict others.

1. Run cluster_configs/local.toml for real (`rl-async run --summary-json`): its summary's
   `calibration` section holds the measured timings (decode operating point, response
   lengths, trainer seconds per sample, publication, controller overhead).
2. For each case (the calibration config itself, a tighter policy lag, the synchronous dev
   profile), simulate it with that calibration and run it for real.
3. Compare the summary numbers both produce with the same definitions (the simulator runs the
   real controller): trainer_wait_fraction, mean staleness (summary staleness.mean_delivered),
   discarded-group fraction (ledger discarded / (discarded + delivered)), steps/hour.

    python benchmarks/simulate_vs_real.py --json [--calibration SUMMARY] [--max-steps N]

prints one JSON line {"calibrated_on", "cases": [{"name", "real", "simulated"}, ...]}.
`--calibration` reuses a summary instead of the first real run. Each real run takes about a
minute on 2 cores; the simulations take seconds.
"""

from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rl_async.capacity import plan_capacity  # noqa: E402
from rl_async.config_load import load_config  # noqa: E402
from rl_async.sim.calibrate import load_calibration, sim_timings  # noqa: E402
from rl_async.sim.run import simulate  # noqa: E402

CALIBRATE_ON = ("cluster_configs/local.toml", ())
CASES = {
    "local (lag 2, calibration run)": ("cluster_configs/local.toml", ()),
    "local, lag 1": ("cluster_configs/local.toml", ("async.max_weight_staleness=1",)),
    "dev (synchronous)": ("cluster_configs/dev.toml", ()),
}
KEYS = ("trainer_wait_fraction", "mean_staleness", "discarded_groups_fraction", "steps_per_hour")


def real_run(path: str, overrides: tuple[str, ...], max_steps: int, out_dir: str) -> dict:
    summary = Path(out_dir) / f"summary-{abs(hash((path, overrides)))}.json"
    sets = [*overrides, f"run.max_steps={max_steps}", f"run.output_dir={out_dir}",
            "wandb.mode=disabled"]
    cmd = [sys.executable, "-m", "launch.cli", "run", path, "--summary-json", str(summary)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                               "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"real run of {path} {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(summary.read_text()) | {"_path": str(summary)}


def from_summary(s: dict) -> dict:
    led = s["ledger"]
    return {"trainer_wait_fraction": s["throughput"]["trainer_wait_fraction"],
            "mean_staleness": s["staleness"]["mean_delivered"],
            "discarded_groups_fraction": led["discarded_groups"]
            / max(1, led["discarded_groups"] + led["delivered_groups"]),
            "steps_per_hour": s["steps"] / s["wall_seconds"] * 3600}


def predict(path: str, overrides: tuple[str, ...], max_steps: int, calibration: dict) -> dict:
    cfg = load_config(ROOT / path, overrides)
    p = simulate(cfg, plan_capacity(cfg)[0], sim_timings(cfg, calibration), max_steps)
    return {k: p[k] for k in KEYS} | {"simulator_cpu_seconds": p["simulator_cpu_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line (the default)")
    ap.add_argument("--calibration", help="a summary JSON to calibrate on (skips that run)")
    ap.add_argument("--max-steps", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-async-sim-vs-real-") as out_dir:
        if args.calibration:
            cal_path = args.calibration
        else:
            cal_path = real_run(*CALIBRATE_ON, args.max_steps, out_dir)["_path"]
        calibration = load_calibration(cal_path)
        cases = []
        for name, (path, overrides) in CASES.items():
            sim = predict(path, overrides, args.max_steps, calibration)
            real = (json.loads(Path(cal_path).read_text())
                    if (path, overrides) == CALIBRATE_ON else
                    real_run(path, overrides, args.max_steps, out_dir))
            cases.append({"name": name, "real": from_summary(real), "simulated": sim})
    print(json.dumps({"calibrated_on": " ".join(CALIBRATE_ON[0:1]), "max_steps": args.max_steps,
                      "cases": cases}))


if __name__ == "__main__":
    main()
