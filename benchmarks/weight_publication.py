"""Weight publication through the product's path vs a raw torch.distributed broadcast of the
same bytes between the same processes.

A real fleet (RayFleet.start: two embedded CPU engine actors, one trainer worker, the
publication gloo group, version 0 published) holds an fp32 Llama of > 50 MB. Then, with the
fleet idle, alternately:
  publication: the controller's Publisher state machine over the fleet (stop submissions,
               drain, RayFleet.transfer: snapshot + flatten buckets on trainer rank 0,
               broadcast each bucket, engines unflatten and load, set the version; resume);
               `transfer_seconds` is RayFleet.transfer alone;
  raw:         a broadcast of a preallocated flat uint8 tensor of the same total size from
               trainer rank 0 on each engine's publication channel, all at once (the
               transport the product uses: one channel per engine), run inside the same
               trainer and engine actor processes (Ray's `__ray_call__`).
Each side is timed from the caller (one asyncio loop in a helper actor), median of --reps.

    python benchmarks/weight_publication.py --json
prints one JSON line {"publication_seconds", "raw_broadcast_seconds", "ratio", "bytes", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _common import init_ray, load_checked  # noqa: I001  (sets sys.path first)
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


@ray.remote(num_cpus=0)
class PublicationBench:
    async def run(self, cfg, plan, reps: int) -> dict:
        from actors.fleet import RayFleet
        from rl_async.loop.publish import Publisher

        fleet = RayFleet(cfg, plan)
        try:
            await fleet.start()  # includes the version-0 publication (a warm-up)
            ranks = [fleet.trainers[0], *fleet.engines]
            publisher = Publisher(cfg.refresh.mode, cfg.publication.drain_timeout_s,
                                  cfg.publication.timeout_s)
            pub, transfer, raw, inner = [], [], [], []
            nbytes = 0
            for rep in range(reps):
                t0 = time.perf_counter()
                result = await publisher.publish(2 * rep + 1, fleet)
                pub.append(time.perf_counter() - t0)
                nbytes = result.bytes
                t0 = time.perf_counter()
                await fleet.transfer(2 * rep + 2)
                transfer.append(time.perf_counter() - t0)
                await asyncio.gather(*(r.__ray_call__.remote(_raw_prepare, nbytes) for r in ranks))
                t0 = time.perf_counter()
                times = await asyncio.gather(*(r.__ray_call__.remote(_raw_broadcast)
                                               for r in ranks))
                raw.append(time.perf_counter() - t0)
                inner.append(max(times))
                await asyncio.gather(*(r.__ray_call__.remote(_raw_release) for r in ranks))
            # the timed publications really moved the weights (the trainer is idle: its
            # live weights are the last published ones)
            want = await fleet.trainers[0].weights_checksum.remote()
            got = await asyncio.gather(*(e.weights_checksum.remote() for e in fleet.engines))
            assert got == [want] * len(got), "an engine does not hold the published weights"
        finally:
            await fleet.shutdown()
        return {"publication": pub, "transfer": transfer, "raw": raw, "raw_inner": inner,
                "bytes": nbytes, "buckets": -(-nbytes // cfg.publication.bucket_bytes)}


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
    med = {k: statistics.median(out[k]) for k in ("publication", "transfer", "raw", "raw_inner")}
    line = {"publication_seconds": round(med["publication"], 4),
            "raw_broadcast_seconds": round(med["raw"], 4),
            "ratio": round(med["publication"] / med["raw"], 3),
            "bytes": out["bytes"], "megabytes": round(out["bytes"] / 2**20, 1),
            "transfer_seconds": round(med["transfer"], 4),
            "transfer_ratio": round(med["transfer"] / med["raw"], 3),
            "raw_in_process_seconds": round(med["raw_inner"], 4),
            "buckets": out["buckets"], "engines": 2, "reps": args.reps,
            "samples": {k: [round(x, 4) for x in out[k]]
                        for k in ("publication", "transfer", "raw")}}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
