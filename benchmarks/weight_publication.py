"""Weight publication through the product's path vs a raw torch.distributed broadcast of the
same bytes between the same processes.

A real fleet (RayFleet.start: two embedded CPU engine actors, one trainer worker, one
publication channel per engine, version 0 published) holds an fp32 Llama of > 50 MB. Then,
with the fleet idle, alternately:
  publication: the controller's Publisher state machine over the fleet: snapshot (trainer
               rank 0 copies the weights into its buckets, fingerprints them), transfer
               (each engine receives into its staging buffers and verifies every bucket's
               fingerprint and the model digest, packing its linears as their bytes land:
               `load` is what is left after the last byte; the last piece's linears are
               packed after the switch, `late_pack_seconds`, not part of the wall time),
               drain, commit (each engine switches between two steps: `pause`), resume;
  raw:         a broadcast of a preallocated flat uint8 tensor of the same total size from
               trainer rank 0 on each engine's publication channel, all at once (the
               transport the product uses: one channel per engine), run inside the same
               trainer and engine actor processes (Ray's `__ray_call__`).
Each side is timed from the caller (one asyncio loop in a helper actor), median of --reps.

    python benchmarks/weight_publication.py --json
prints one JSON line {"publication_seconds", "raw_broadcast_seconds", "ratio", "bytes",
"snapshot_seconds", "transfer_seconds", "transfer_ratio", "load_seconds", "pause_seconds",
"pause_fraction" (pause / transfer), "late_pack_seconds" (the packing of the last linears,
after the switch: they run on the stock kernel meanwhile), ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _common import init_ray, load_checked, started_fleet  # noqa: I001  (sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

import ray


def _raw_prepare(actor, nbytes: int) -> None:
    import torch

    actor._bench_raw = torch.ones(nbytes, dtype=torch.uint8)  # touched: no page faults later


def _raw_broadcast(actor) -> float:
    """Trainer rank 0: the bytes to every engine's channel at once; an engine: receive them."""
    import torch

    from rl_async.state import collective
    if hasattr(actor, "sender"):
        names = actor.sender.channels()
    else:
        names = actor.engine.weight_update_groups()
    start = time.perf_counter()
    works = [torch.distributed.broadcast(actor._bench_raw, group=collective.get_group(n),
                                         group_src=0, async_op=True) for n in names]
    for work in works:
        work.wait()
    return time.perf_counter() - start


def _raw_release(actor) -> None:
    del actor._bench_raw


def _late_pack(actor) -> float | None:
    """An engine: the seconds the packing a commit left under way took (the linears whose
    bytes came last: rl_async/engine/embedded_weights.py), None while it is still going."""
    task = getattr(actor.engine, "_late_task", None)
    if task is not None and not task.done():
        return None
    return actor.engine.stats.get("late_pack_seconds", 0.0)


async def _packed(engines) -> float:
    """Wait for every engine's late packing, so it is not timed as part of the raw
    broadcast that follows; the longest one's seconds."""
    while True:
        done = await asyncio.gather(*(e.__ray_call__.remote(_late_pack) for e in engines))
        if None not in done:
            return max(done, default=0.0)
        await asyncio.sleep(0.002)


def _cpu(actor) -> float:
    """CPU seconds of the actor's process so far, every thread (the channel threads too)."""
    return time.process_time()


async def _cpu_of(ranks) -> float:
    return sum(await asyncio.gather(*(r.__ray_call__.remote(_cpu) for r in ranks)))


# Publisher figures reported beside the whole (rl_async/loop/publish.py)
PARTS = ("snapshot_seconds", "transfer_seconds", "receive_seconds", "load_seconds",
         "drain_seconds", "commit_seconds", "pause_seconds")


@ray.remote(num_cpus=0)
class PublicationBench:
    async def run(self, cfg, plan, reps: int) -> dict:
        fleet, publisher = await started_fleet(cfg, plan)
        try:
            ranks = [fleet.trainers[0], *fleet.engines]
            pub, raw, inner, parts, cpu_pub, cpu_raw = [], [], [], [], [], []
            nbytes = 0
            for rep in range(reps):
                c0 = await _cpu_of(ranks)
                t0 = time.perf_counter()
                result = await publisher.publish(rep + 1, fleet)
                pub.append(time.perf_counter() - t0)
                late = await _packed(fleet.engines)
                cpu_pub.append(await _cpu_of(ranks) - c0)  # the late packing's work too
                nbytes = result.bytes
                metrics = result.metrics()
                parts.append({k: metrics[f"publish/{k}"] for k in PARTS})
                parts[-1]["late_pack_seconds"] = late
                await asyncio.gather(*(r.__ray_call__.remote(_raw_prepare, nbytes) for r in ranks))
                c0 = await _cpu_of(ranks)
                t0 = time.perf_counter()
                times = await asyncio.gather(*(r.__ray_call__.remote(_raw_broadcast)
                                               for r in ranks))
                raw.append(time.perf_counter() - t0)
                cpu_raw.append(await _cpu_of(ranks) - c0)
                inner.append(max(times))
                await asyncio.gather(*(r.__ray_call__.remote(_raw_release) for r in ranks))
            # the timed publications really moved the weights (the trainer is idle: its
            # live weights are the last published ones)
            want = await fleet.trainers[0].weights_checksum.remote()
            got = await asyncio.gather(*(e.weights_checksum.remote() for e in fleet.engines))
            assert got == [want] * len(got), "an engine does not hold the published weights"
        finally:
            await fleet.shutdown()
        return {"publication": pub, "raw": raw, "raw_inner": inner, "bytes": nbytes,
                "cpu_publication": cpu_pub, "cpu_raw": cpu_raw,
                "buckets": -(-nbytes // cfg.publication.bucket_bytes),
                **{k: [p[k] for p in parts] for k in (*PARTS, "late_pack_seconds")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parse_with_smoke(parser, reps=1, hidden=64, layers=1, vocab=256)
    overrides = [
        "run.name=bench-publication", "wandb.mode=disabled", "cluster.cpu_engines=2",
        "cluster.trainer_workers=1", "cluster.engine_cpus=1", "cluster.trainer_cpus=1",
        "engine.torch_threads=1", "model.dtype=float32",
        "run.audit_fraction=0",  # the audit keeps snapshots: its own cost, not publication's
        f"model.hf_config.vocab_size={args.vocab}", f"model.hf_config.hidden_size={args.hidden}",
        f"model.hf_config.intermediate_size={2 * args.hidden}",
        f"model.hf_config.num_hidden_layers={args.layers}",
        f"model.hf_config.num_attention_heads={args.hidden // 64}",
        f"model.hf_config.num_key_value_heads={args.hidden // 64}",
        *args.set]
    cfg, report = load_checked("cluster_configs/local.toml", overrides)
    init_ray(num_cpus=3)  # logical: two engine bundles + one trainer bundle
    try:
        out = ray.get(PublicationBench.remote().run.remote(cfg, report.plan, args.reps))
    finally:
        ray.shutdown()
    med = {k: statistics.median(out[k]) for k in ("publication", "raw", "raw_inner",
                                                  "cpu_publication", "cpu_raw", *PARTS,
                                                  "late_pack_seconds")}
    line = {"publication_seconds": round(med["publication"], 4),
            "raw_broadcast_seconds": round(med["raw"], 4),
            "ratio": round(med["publication"] / med["raw"], 3),
            "bytes": out["bytes"], "megabytes": round(out["bytes"] / 2**20, 1),
            **{k: round(med[k], 4) for k in (*PARTS, "late_pack_seconds")},
            "transfer_ratio": round(med["transfer_seconds"] / med["raw"], 3),
            "pause_fraction": round(med["pause_seconds"] / med["transfer_seconds"], 4),
            "raw_in_process_seconds": round(med["raw_inner"], 4),
            # CPU seconds of the trainer and engine processes: what the work costs, which
            # other load on the machine does not change (the wall ratio it does)
            "cpu_seconds": round(med["cpu_publication"], 4),
            "raw_cpu_seconds": round(med["cpu_raw"], 4),
            "cpu_ratio": round(med["cpu_publication"] / med["cpu_raw"], 3),
            "buckets": out["buckets"], "engines": 2, "reps": args.reps,
            "samples": {k: [round(x, 4) for x in out[k]]
                        for k in ("publication", "raw", "transfer_seconds")}}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
