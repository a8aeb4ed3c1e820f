"""Routing replay (R3) against none, side by side in one run, on the MoE demo.

`cluster_configs/qwen3_moe.toml` (a tiny Qwen3-MoE, 8 experts, top-2, learning the successor
task on 2 cores) with `train.routing_replay = "r3"` and `"off"`, alternating which runs first
per seed. Engine and trainer here run the same fp32 kernels, so their routers agree to the
last bit; a GPU engine (bf16, other kernels, other batch shapes) does not. The benchmark
makes the difference on purpose: every engine's routers pick their top-k from probabilities
plus Gaussian noise of scale --noise (EngineActor.debug_routing_noise; the gate weights stay
the true probabilities), the same in both modes. --noise 0 measures r3's plain cost.

Reported per mode (means over seeds): the off-policy diagnostics of the loss (k3 KL between
trainer and rollout, the share of tokens with |log ratio| > ln 2: what a routing mismatch
does to the ratios), r3's own figures (agreement, on-policy log-prob mismatch with the
engine's experts and with the trainer's own, bytes per sample), the final reward, the updates
to --target, and the loop's seconds per update (evaluations out). Ratios: r3 / off.

    python benchmarks/routing_replay.py --json [--seeds 2] [--noise 0.002] [--steps 300]
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from _common import TimedRun, curve_without_evals, init_ray, load_checked  # noqa: I001
from _smoke import parse_with_smoke  # noqa: E402

import ray

CONFIG = "cluster_configs/qwen3_moe.toml"
DIAGNOSTICS = ("kl_k3_trainer_rollout", "logratio_over_ln2_fraction", "ess_ratio")
ROUTING = ("agreement", "logprob_mismatch_replay", "logprob_mismatch_own",
           "replay_bytes_per_sample")


def run_mode(mode: str, seed: int, args) -> dict:
    cfg, report = load_checked(CONFIG, [
        f"run.name=r3-{mode}-s{seed}", f"run.seed={seed}", f"model.init_seed={seed}",
        f"run.max_steps={args.steps}", f"train.routing_replay={json.dumps(mode)}",
        f"run.output_dir={args.out}", "run.audit_fraction=0", "wandb.mode=disabled",
        *args.set])
    calls = [("debug_routing_noise", (args.noise,))] if args.noise else []
    result = ray.get(TimedRun.remote().run.remote(cfg, report.plan, calls))
    s = result["summary"]
    curve, _ = curve_without_evals(result)
    c, r = s["corrections"], s["routing"]
    updates = next((step for step, _t, reward in curve if reward >= args.target), None)
    return {"final_reward": curve[-1][2] if curve else None,
            "updates_to_target": updates,
            "seconds_per_update": curve[-1][1] / max(1, s["steps"]) if curve else None,
            **{k: c[k]["mean"] for k in DIAGNOSTICS if k in c},
            **({k: r[k] for k in ROUTING} if mode == "r3" else {})}


def mean(rows: list[dict], key: str):
    values = [row[key] for row in rows if row.get(key) is not None]
    return float(f"{sum(values) / len(values):.4g}") if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--noise", type=float, default=0.002,
                        help="routing noise on every engine (0: r3's plain cost)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out reward")
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], help="override, every run")
    args = parse_with_smoke(parser, seeds=1, steps=6)
    args.out = args.out or tempfile.mkdtemp(prefix="rl-async-r3-")
    init_ray(num_cpus=2)
    runs: dict[str, list[dict]] = {"r3": [], "off": []}
    for seed in range(args.seeds):
        for mode in (("r3", "off") if seed % 2 == 0 else ("off", "r3")):
            runs[mode].append(run_mode(mode, seed, args))
    keys = sorted({k for rows in runs.values() for row in rows for k in row})
    means = {mode: {k: mean(rows, k) for k in keys} for mode, rows in runs.items()}
    r3, off = means["r3"], means["off"]
    out = {"config": CONFIG, "noise": args.noise, "seeds": args.seeds, "steps": args.steps,
           "r3": r3, "off": off, "runs": runs,
           "r3_over_off": {k: (round(r3[k] / off[k], 3) if r3.get(k) and off.get(k) else None)
                           for k in ("seconds_per_update", "kl_k3_trainer_rollout",
                                     "logratio_over_ln2_fraction", "updates_to_target")}}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
