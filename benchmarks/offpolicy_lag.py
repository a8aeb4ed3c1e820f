"""Safe lag: how each policy loss trains on data of a forced age, on the counting task.

For every loss (`train.policy_loss`) and lag L, one fully async run of the long-tailed
counting task (as benchmarks/time_to_reward.py: `cluster_configs/dev.toml` made async, the
count overrides, an evaluation every --every updates with a drain) whose data is forced to
be about L versions old when trained: the trainer leaves L - 1 collections in the buffer
behind the one it takes (`async.hold_back_collections`, a deeper buffer with generation at
the training pace), the engines get every update (lag 1 is the plain async run). The lag
bound sits well above (2L + 4) so nothing is discarded for age. Reported per cell: the
staleness actually delivered (mean, max, in flight / in queue means), updates and loop
seconds (evaluations out) to the target reward, the final reward, and the run's off-policy
diagnostics (k3 KL(trainer || rollout), share of tokens with |log r| > ln 2, masked share).

Why publication.every_updates alone does not make data old (measured with --explain): each
mid-run evaluation publishes the current weights first (it must evaluate them), so the
engines never trail the trainer by more than the evaluation interval, and the producer
budget plus one buffered collection add at most about two versions of queueing. With an
evaluation every 7 updates, cadences of 16 and 64 both delivered data at most 11 versions old.

    python benchmarks/offpolicy_lag.py --json [--lags 1,4,16,64]
        [--losses ppo_tis,cispo,gspo,m2po,decoupled_ppo] [--explain] [--health]
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from _common import curve_without_evals, finite, init_ray, load_checked, TimedRun  # noqa: I001
from _smoke import parse_with_smoke  # noqa: E402

import ray

from rl_async.observe.compare import time_to

CONFIG = "cluster_configs/dev.toml"
# The counting task, sized so the whole grid fits about 30 minutes on 2 cores.
COUNT = ["task.count_tokens=16", "rollout.max_response_len=16", "rollout.rollout_batch_size=16",
         "train.global_batch_size=256", "train.micro_batch_size=256",
         "sglang.max_running_requests=128", "async.async_max_concurrent_samples=256",
         "async.fully_async=true", "async.rollout_submission_granularity=sample",
         "eval.drain=true", "wandb.mode=disabled"]
LOSSES = ("ppo_tis", "cispo", "gspo", "m2po", "decoupled_ppo")
# GSPO's paper range (3e-4, 4e-4) clips nearly every sequence of a 2-16 token answer once the
# policy moves (its ratio is a per-token mean): the benchmark uses a range that lets it learn.
LOSS_SETTINGS = {"gspo": ["train.gspo_eps_low=0.05", "train.gspo_eps_high=0.05"]}


def lag_overrides(lag: int) -> list[str]:
    """Data about `lag` versions old: lag - 1 collections held back, room for them, and a
    bound that never binds."""
    hold = max(0, lag - 1)
    return [f"async.hold_back_collections={hold}",
            f"async.async_data_buffer_capacity_factor={hold + 1}",
            f"async.max_weight_staleness={2 * lag + 4}"]


def run_cell(name: str, extra: list[str], args, keep_summary: bool = False) -> dict:
    overrides = [f"run.name={name}", f"run.seed={args.seed}", f"model.init_seed={args.seed}",
                 f"run.max_steps={args.steps}", f"train.lr={args.lr}",
                 f"eval.every_steps={args.every}", f"run.output_dir={args.out}/runs",
                 *COUNT, *extra, *args.set]
    cfg, report = load_checked(CONFIG, overrides)
    result = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    s = result["summary"]
    curve, _ = curve_without_evals(result)
    updates = next((step for step, _t, r in curve if r >= args.target), None)
    seconds = time_to(curve, args.target)
    st, c = s["staleness"], s["corrections"]
    return {"delivered_mean": round(st["mean_delivered"], 2), "delivered_max": st["max_delivered"],
            "inflight_mean": round(st["inflight_mean"], 2),
            "queue_mean": round(st["queue_mean"], 2),
            "updates_to_target": updates,
            "seconds_to_target": finite(seconds if seconds is not None else float("inf")),
            "final_reward": curve[-1][2] if curve else None,
            "loop_seconds": curve[-1][1] if curve else None,
            "discarded_groups": s["ledger"]["discarded_groups"],
            **{k: round(c[k]["mean"], 4) for k in ("kl_k3_trainer_rollout",
                                                    "logratio_over_ln2_fraction",
                                                    "masked_fraction", "ess_ratio") if k in c},
            **({"summary": s} if keep_summary else {})}


def explain(args) -> dict:
    """publication.every_updates with evaluations every --every updates (they publish) and
    with none mid-run: the delivered staleness of each."""
    out = {}
    for every_pub in (16, 64):
        for evals in (args.every, 0):
            extra = [f"publication.every_updates={every_pub}",
                     f"async.max_weight_staleness={2 * every_pub}",
                     f"eval.every_steps={evals}", "train.policy_loss=ppo_tis"]
            cell = run_cell(f"explain-pub{every_pub}-eval{evals}",
                            extra + [f"run.max_steps={args.explain_steps}"], args)
            out[f"pub{every_pub}_eval_every{evals or 'none'}"] = {
                k: cell[k] for k in ("delivered_mean", "delivered_max", "inflight_mean",
                                     "queue_mean")}
    return out


def health(args) -> dict:
    """Lag about 64 made by the engines (publication every 128 updates, no mid-run
    evaluation, which would publish): --health-loss fixed, and the same with
    async.health_control = true, which publishes sooner (then lowers the producer budget)
    while the diagnostics are past their thresholds."""
    base = ["publication.every_updates=128", "async.max_weight_staleness=160",
            "eval.every_steps=0", f'train.policy_loss="{args.health_loss}"',
            *LOSS_SETTINGS.get(args.health_loss, [])]
    out = {}
    for name, extra in (("fixed", []), ("health_control", ["async.health_control=true"])):
        cell = run_cell(f"health-{name}", base + extra, args, keep_summary=True)
        summary = cell.pop("summary")
        h = summary["health"]
        cell["decisions"] = len(h.get("events", []))
        cell["actions"] = sorted({e["action"] for e in h.get("events", [])})
        out[name] = cell
    return out


def goals(cells: dict, default_loss: str) -> dict:
    def ratio(loss: str, lag: int) -> float | None:
        base = cells.get(loss, {}).get("1", {}).get("updates_to_target")
        here = cells.get(loss, {}).get(str(lag), {}).get("updates_to_target")
        return round(here / base, 2) if base and here else None
    lag64 = {loss: ratio(loss, 64) for loss in cells}
    reached = [v for v in lag64.values() if v is not None]
    return {"default_loss": default_loss,
            "default_lag16_updates_ratio": ratio(default_loss, 16),
            "lag16_goal_met": (ratio(default_loss, 16) or 99) <= 1.5,
            "lag64_updates_ratio": lag64,
            "lag64_goal_met": bool(reached) and min(reached) <= 2.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--lags", default="1,4,16,64")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=200, help="run.max_steps of every cell")
    parser.add_argument("--every", type=int, default=8, help="eval.every_steps")
    parser.add_argument("--lr", type=float, default=8e-5)
    parser.add_argument("--target", type=float, default=0.8, help="held-out reward")
    parser.add_argument("--default-loss", default="ppo_tis",
                        help="the loss whose lag-16 ratio the goal is judged on")
    parser.add_argument("--explain", action="store_true", help="also run the publication "
                        "cadence check (4 more runs)")
    parser.add_argument("--explain-steps", type=int, default=100,
                        help="run.max_steps of the --explain runs")
    parser.add_argument("--health", action="store_true", help="also run the lag-64 case made "
                        "by the engines, fixed and with async.health_control (2 more runs)")
    parser.add_argument("--health-loss", default="ppo_tis")
    parser.add_argument("--only-extra", action="store_true",
                        help="skip the grid: only --explain / --health")
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], help="override, every cell")
    args = parse_with_smoke(parser, lags="1,2", losses="ppo_tis,m2po", steps=4, every=2)
    args.out = args.out or tempfile.mkdtemp(prefix="rl-async-lag-")
    init_ray(num_cpus=2)
    started = time.monotonic()
    cells: dict[str, dict] = {}
    for loss in ([] if args.only_extra else args.losses.split(",")):
        cells[loss] = {}
        for lag in (int(x) for x in args.lags.split(",")):
            extra = [f'train.policy_loss="{loss}"', *LOSS_SETTINGS.get(loss, []),
                     *lag_overrides(lag)]
            cells[loss][str(lag)] = run_cell(f"{loss}-lag{lag}", extra, args)
    result = {"target_reward": args.target, "steps": args.steps, "lr": args.lr,
              "cells": cells, "goals": goals(cells, args.default_loss)}
    if args.explain:
        result["explain"] = explain(args)
    if args.health:
        result["health"] = health(args)
    result["benchmark_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
