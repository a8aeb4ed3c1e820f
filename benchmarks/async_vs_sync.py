"""Synchronous vs fully asynchronous training: same config, same optimizer steps, one cluster.

Both runs use cluster_configs/local.toml's actors on one local Ray cluster of 2 CPUs: one
embedded engine actor (engine_cpus = 1, torch_threads = 1) generates, one trainer worker
(trainer_cpus = 1) trains. The synchronous run sets `async.fully_async = false` (lag 0):
generate a collection, train, publish, repeat. The asynchronous run keeps local.toml's fully
async settings (lag 2): the next collection is generated while the trainer trains.

The benchmark model is larger than the demo's and responses are longer, so that one
collection's generation and training take comparable time (otherwise there is nothing to
overlap); both are printed. vocab_size = 512 makes the stop token rare (p ~ 1/512 per
step), so responses run to max_response_len all through the run and the work per collection
stays constant while the policy learns the task's first token.

What is timed: the controller's training loop in steady state, from the end of the first
collection (its metrics row) to the end of the last one, i.e. max_steps - 1 collections, each
= wait for a collection + train + publish. This leaves out actor start-up, the initial and
final evaluations, the shutdown drain and the first collection (the async pipeline's fill,
which cannot overlap anything). `loop_*` also counts the first collection (initial eval row
-> last collection row); `wall_*` is the summary's wall_seconds (evals and drain included).

--pairs N runs N sync/async pairs, alternating which mode runs first, and reports the median
of the per-pair ratios (each pair measured back to back, so machine noise hits both).

    python benchmarks/async_vs_sync.py --json [--pairs 3]
prints one JSON line {"sync_seconds", "async_seconds", "speedup", "pair_speedups", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from _common import TimedRun, init_ray, load_checked  # noqa: I001  (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray


def overrides(args, mode: str) -> list[str]:
    common = [
        f"run.name=bench-{mode}", f"run.max_steps={args.steps}", "wandb.mode=disabled",
        "cluster.cpu_engines=1", "cluster.trainer_workers=1", "cluster.engine_cpus=1",
        "cluster.trainer_cpus=1", "engine.torch_threads=1",
        f"model.hf_config.vocab_size={args.vocab}", f"model.hf_config.hidden_size={args.hidden}",
        f"model.hf_config.intermediate_size={2 * args.hidden}",
        f"model.hf_config.num_hidden_layers={args.layers}",
        f"model.hf_config.max_position_embeddings={max(64, 2 * args.response_len)}",
        f"rollout.max_response_len={args.response_len}",
        f"engine.max_total_tokens={args.max_running * (8 + args.response_len)}",
        f"sglang.max_running_requests={args.max_running}",
        f"task.num_eval_prompts={args.eval_prompts}",
        f"rollout.rollout_batch_size={args.groups}",
        f"train.global_batch_size={args.groups * 16}",  # one optimizer step per collection
        f"train.micro_batch_size={min(args.groups * 16, 128)}",
    ]
    if mode == "sync":
        common += ["async.fully_async=false", "async.max_weight_staleness=0"]
    return common + list(args.set)


def measure(rows: list, summary: dict) -> dict:
    """Seconds of the loop and per-collection means of its phases, from stamped rows."""
    evals = [t for t, _, m in rows if "eval/reward" in m]
    coll = [(t, m) for t, _, m in rows if "train/collection_seconds" in m]
    if len(coll) < 2:
        raise SystemExit(f"only {len(coll)} collection(s) logged: use --steps >= 2")

    def mean(key: str, skip_first: bool = True) -> float:
        vals = [m.get(key, 0.0) for _, m in coll[1 if skip_first else 0:]]
        return round(statistics.fmean(vals), 4)

    return {
        "steady_seconds": coll[-1][0] - coll[0][0], "loop_seconds": coll[-1][0] - evals[0],
        "wall_seconds": summary["wall_seconds"], "collections": len(coll),
        "trainer_wait_s": mean("train/trainer_wait_seconds"),
        "train_s": mean("train/collection_seconds"),
        "publication_s": mean("publish/publication_seconds"),
        "drain_s": mean("publish/drain_seconds"),
        "transfer_s": mean("publish/transfer_seconds"),
        "first_collection_wait_s": round(coll[0][1]["train/trainer_wait_seconds"], 3),
        "eval_initial": summary["eval"]["initial_reward"],
        "eval_final": summary["eval"]["final_reward"],
        "max_staleness": summary["staleness"]["max_delivered"],
        "mean_staleness": round(summary["staleness"]["mean_delivered"], 3),
        "unaccounted": summary["ledger"].get("unaccounted"),
    }


def run_one(args, mode: str) -> dict:
    cfg, report = load_checked("cluster_configs/local.toml", overrides(args, mode))
    out = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    res = measure(out["rows"], out["summary"])
    res["steps"] = out["summary"]["steps"]
    res["start_seconds"] = round(out["start_seconds"], 2)
    res["lag"] = report.plan.max_weight_staleness
    if not args.json:
        print(f"[{mode}] {json.dumps(res)}", file=sys.stderr, flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--groups", type=int, default=16,
                        help="groups of 16 samples per collection (rollout_batch_size)")
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3,
                        help="sync/async pairs, alternating which runs first")
    parser.add_argument("--only", choices=("sync", "async"),
                        help="run one mode only and print its measures (for investigation)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra run-file override for both runs")
    args = parse_with_smoke(parser, steps=2, response_len=4, hidden=32, vocab=64, groups=2,
                            max_running=8, eval_prompts=4, pairs=1)
    init_ray(num_cpus=2)
    try:
        if args.only:
            print(json.dumps(run_one(args, args.only)), flush=True)
            return
        pairs = []
        for k in range(args.pairs):
            order = ("sync", "async") if k % 2 == 0 else ("async", "sync")
            pairs.append({mode: run_one(args, mode) for mode in order})
    finally:
        ray.shutdown()

    def median_ratio(key: str) -> float:
        return round(statistics.median(p["sync"][key] / p["async"][key] for p in pairs), 3)

    line = {"sync_seconds": round(statistics.median(p["sync"]["steady_seconds"]
                                                    for p in pairs), 3),
            "async_seconds": round(statistics.median(p["async"]["steady_seconds"]
                                                     for p in pairs), 3),
            "speedup": median_ratio("steady_seconds"),
            "pair_speedups": [round(p["sync"]["steady_seconds"] / p["async"]["steady_seconds"],
                                    3) for p in pairs],
            "loop_speedup": median_ratio("loop_seconds"),
            "wall_speedup": median_ratio("wall_seconds"),
            "steps": args.steps, "pairs": args.pairs,
            "timed_collections": pairs[0]["sync"]["collections"] - 1,
            "sync": pairs[-1]["sync"], "async": pairs[-1]["async"]}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
