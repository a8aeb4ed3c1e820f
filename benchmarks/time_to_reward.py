"""Time to reward: sync vs async at several lags, over seeds, on the local demo's actors.

What users care about is how long it takes to reach a reward, not loop speed. For each seed
(`run.seed` = `model.init_seed` = S) this runs one config, `cluster_configs/dev.toml`,
synchronously and fully async at each lag (the same file with `async.fully_async = true`,
sample-granularity backfill and the lag set by --set: nothing else differs), interleaved so
that machine noise spreads over all modes, with the same evaluation schedule
(`eval.every_steps`) in every mode. Evaluations are taken out of both clocks the same way:
every mode drains before an evaluation (`eval.drain = true`: no generation runs beside it,
and the async pipeline pays to refill), and each evaluation's own seconds are subtracted, so
a curve point's time is the training loop's ([step, loop seconds, held-out reward]).

- target reward: 80% of sync's median final reward (--target-fraction),
- per mode: median loop seconds to the first eval at or above the target (a seed that never
  reaches it counts as +inf, so the median is honest), final reward median / min / max,
  updates to the target, evaluation seconds taken out,
- speedup = sync's median time to target / the mode's,
- goal: the best async mode reaches the target >= 1.6x sooner, no async seed ends more than
  0.1 below sync's worst seed, sync needs >= 60 s to the target and evaluations come at most
  1/20 of that apart (so the time is not one eval interval of noise).

--task count (default): the long-tailed counting variant of the built-in task
(`task.count_tokens = 16`: each prompt's response is 2..16 tokens, 8x the shortest, by
prompt; rl_async.algo.successor), 32 prompts x 16 samples per update, 128 engine rows,
lr 4e-5, an evaluation every 7 updates. --task successor: the demo's task as it is
(2-token answers; the target in a few seconds, one or two eval intervals).

    python benchmarks/time_to_reward.py --json [--seeds 4] [--lags 2,4,4:3] [--out DIR]
        [--bounds dequeue,admission]   (each async lag with either staleness bound)
prints one JSON line; summaries go to DIR (default a temp dir) for
`rl-async compare DIR/*.json --plot curves.png` (their eval.curve is the loop clock of the
table; the wall clock, evaluations included, is eval.wall_curve).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from _common import (curve_without_evals, finite, init_ray, load_checked,  # noqa: I001
                     speedup, TimedRun)  # (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray

from rl_async.observe.compare import time_to


# Per task: overrides for every mode, and the default eval interval (updates).
TASKS = {
    "count": (["task.count_tokens=16", "rollout.max_response_len=16", "train.lr=0.00004",
               "rollout.rollout_batch_size=32", "train.global_batch_size=512",
               "train.micro_batch_size=256", "sglang.max_running_requests=128",
               "async.async_max_concurrent_samples=256", "run.max_steps=360"], 7),
    "successor": ([], 10),
}
GOAL_SPEEDUP, GOAL_SYNC_SECONDS, GOAL_EVALS_TO_TARGET = 1.6, 60.0, 20
CONFIG = "cluster_configs/dev.toml"  # every mode: async modes add ASYNC and their lag
ASYNC = ["async.fully_async=true", "async.rollout_submission_granularity=sample"]


def run_one(name: str, seed: int, extra: list[str], args) -> dict:
    """One run; its summary with `loop_curve` (evaluations out) and `eval_seconds` added."""
    overrides = [f"run.name={name}", f"run.seed={seed}", f"model.init_seed={seed}",
                 f"eval.every_steps={args.every}", "eval.drain=true", "wandb.mode=disabled",
                 f"run.output_dir={args.out}/runs", *TASKS[args.task][0], *extra, *args.set]
    if args.steps:
        overrides.append(f"run.max_steps={args.steps}")
    cfg, report = load_checked(CONFIG, overrides)
    result = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    summary = result["summary"]
    summary["loop_curve"], summary["eval_seconds"] = curve_without_evals(result)
    # The file `rl-async compare --plot` reads: its curve on the same clock as the table
    plotted = {**summary, "eval": {**summary["eval"], "curve": summary["loop_curve"],
                                   "wall_curve": summary["eval"]["curve"]}}
    (Path(args.out) / f"{name}.json").write_text(json.dumps(plotted, default=str))
    return summary


def report(runs: dict[str, list[dict]], fraction: float) -> dict:
    finals = {m: [s["loop_curve"][-1][2] for s in ss] for m, ss in runs.items()}
    target = fraction * statistics.median(finals["sync"])
    out: dict = {"target_reward": round(target, 4), "modes": {}}
    for mode, summaries in runs.items():
        ttt = [time_to(s["loop_curve"], target) for s in summaries]
        ttt = [math.inf if t is None else t for t in ttt]
        out["modes"][mode] = {
            # +inf sorts last: when more than half never get there, the median is +inf
            "median_time_to_target_s": statistics.median(ttt),
            "time_to_target_s": ttt,
            "updates_to_target": [_updates_to(s["loop_curve"], target) for s in summaries],
            "eval_seconds_taken_out": [round(s["eval_seconds"], 2) for s in summaries],
            "final_reward_median": statistics.median(finals[mode]),
            "final_reward_min": min(finals[mode]), "final_reward_max": max(finals[mode]),
            "median_loop_s": statistics.median(s["loop_curve"][-1][1] for s in summaries),
            "mean_staleness": statistics.mean(s["staleness"]["mean_delivered"]
                                              for s in summaries),
            "discarded_groups": [s["ledger"]["discarded_groups"] for s in summaries],
            "length_ks": [round(s["rollout"].get("length_ks", 0.0), 4) for s in summaries]}
    sync = out["modes"]["sync"]
    for mode, m in out["modes"].items():
        m["speedup"] = speedup(sync["median_time_to_target_s"], m["median_time_to_target_s"])
    asyncs = {k: v for k, v in out["modes"].items() if k != "sync"}
    best = max(asyncs, key=lambda k: asyncs[k]["speedup"])
    out["best_async"] = best
    out["best_speedup"] = round(asyncs[best]["speedup"], 3)
    out["worst_async_final_minus_worst_sync"] = round(
        min(v["final_reward_min"] for v in asyncs.values()) - sync["final_reward_min"], 4)
    sync_ttt = sync["median_time_to_target_s"]
    out["sync_eval_interval_s"] = round(statistics.median(
        b[1] - a[1] for s in runs["sync"] for a, b in zip(s["loop_curve"],
                                                           s["loop_curve"][1:])), 2)
    out["meets_goal"] = (out["best_speedup"] >= GOAL_SPEEDUP
                         and out["worst_async_final_minus_worst_sync"] >= -0.1
                         and sync_ttt >= GOAL_SYNC_SECONDS
                         and out["sync_eval_interval_s"] <= sync_ttt / GOAL_EVALS_TO_TARGET)
    for m in out["modes"].values():  # JSON has no infinity: never reached -> null
        m["median_time_to_target_s"] = finite(m["median_time_to_target_s"])
        m["time_to_target_s"] = [finite(t) for t in m["time_to_target_s"]]
    return out


def _updates_to(curve: list, target: float) -> int | None:
    return next((step for step, _s, reward in curve if reward >= target), None)


def async_mode(spec: str) -> tuple[str, list[str]]:
    """'4' -> lag 4, publishing after every update; '4:2' -> lag 4, publishing once the
    trainer is 2 updates past the engines (publication.every_updates)."""
    lag, _, every = spec.partition(":")
    overrides = [*ASYNC, f"async.max_weight_staleness={int(lag)}"]
    if not every:
        return f"async_lag{int(lag)}", overrides
    return (f"async_lag{int(lag)}_pub{int(every)}",
            overrides + [f"publication.every_updates={int(every)}"])



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--task", choices=sorted(TASKS), default="count")
    parser.add_argument("--lags", default="2,4", help="async modes: LAG or LAG:EVERY "
                        "(publication.every_updates), comma-separated")
    parser.add_argument("--bounds", default="dequeue", help="async.staleness_bound of each "
                        "async mode, comma-separated: 'dequeue,admission' runs every lag both "
                        "ways (modes named ..._admission)")
    parser.add_argument("--steps", type=int, default=0, help="run.max_steps (0: the files')")
    parser.add_argument("--every", type=int, default=0, help="eval.every_steps, all modes "
                        "(time to target is resolved to one eval interval; 0: the task's)")
    parser.add_argument("--target-fraction", type=float, default=0.8)
    parser.add_argument("--out", default=None, help="where summaries go (default: temp dir)")
    parser.add_argument("--set", action="append", default=[], help="override, all modes")
    args = parse_with_smoke(parser, seeds=1, lags="2", steps=4, every=2)
    args.every = args.every or TASKS[args.task][1]
    args.out = args.out or tempfile.mkdtemp(prefix="rl-async-ttr-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    modes = {}
    for name, overrides in (async_mode(x) for x in args.lags.split(",") if x):
        for bound in args.bounds.split(","):
            suffix = "" if bound == "dequeue" else f"_{bound}"
            modes[name + suffix] = overrides + [f'async.staleness_bound="{bound}"']
    init_ray(num_cpus=2)
    started = time.monotonic()
    runs: dict[str, list[dict]] = {"sync": [], **{mode: [] for mode in modes}}
    for seed in range(args.seeds):
        order = ["sync", *modes]
        if seed % 2:  # alternate who runs first
            order.reverse()
        for mode in order:
            runs[mode].append(run_one(f"{mode.replace('_', '-')}-s{seed}", seed,
                                      modes.get(mode, []), args))
    result = report(runs, args.target_fraction)
    result.update(task=args.task, seeds=args.seeds, summaries_dir=args.out,
                  benchmark_seconds=round(time.monotonic() - started, 1))
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=2,
                                                                        default=str))


if __name__ == "__main__":
    main()
