"""Publication time against fleet size: 1, 2, 4 and 8 embedded CPU engines, with the relay
(publication.relay = chain: rank 0 sends once, engines forward) and without it (rank 0 sends
to every engine).

For each mode and size: a real fleet (RayFleet.start: N engine actors sharing the cores,
cluster.engine_cpus = 1/N, one trainer worker), then --reps publications through the
controller's Publisher (snapshot, staged transfer with every check, drain, commit), median
wall time; and the bytes trainer rank 0 sent per publication.

    python benchmarks/publication_scaling.py --json
prints one JSON line {"engines": [1, 2, 4, 8], "chain": {"seconds": [...], "rank0_bytes":
[...], "rank0_cpu": [...], "engine_cpu": [...]}, "off": {...}, "ratio_last_to_1":
{"chain": r, "off": r} (8 engines against 1), "cpu_ratio_last_to_1", "bytes", ...}.
rank0_cpu is trainer rank 0's CPU seconds per publication, engine_cpu the busiest engine's:
the work that bounds the time where each engine has its own cores and link.

What a 2-core machine can and cannot show: every engine, link and the trainer share two
cores and one memory bus, so a chain cannot move bytes faster than rank 0 alone (each byte
is still copied once per engine, only by another process); what it shows is rank 0's bytes
per publication (constant with the chain, N models without) and that the pipeline, its
pieces and its checks work at 8 engines. On a cluster, where each link has its own NIC,
rank 0's egress is what bounds the direct send.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from _common import init_ray, load_checked, started_fleet  # noqa: I001  (sys.path first)
from _smoke import parse_with_smoke  # noqa: E402
from weight_publication import _cpu, _packed  # noqa: E402

import ray


async def _cpu_each(actors) -> list[float]:
    return list(await asyncio.gather(*(a.__ray_call__.remote(_cpu) for a in actors)))


@ray.remote(num_cpus=0)
class ScalingBench:
    async def run(self, cfg, plan, reps: int) -> dict:
        fleet, publisher = await started_fleet(cfg, plan)
        try:
            seconds, sent, nbytes, rank0_cpu, engine_cpu = [], [], 0, [], []
            for rep in range(reps):
                before = await fleet.trainers[0].publication_bytes_sent.remote()
                cpu0 = await _cpu_each([fleet.trainers[0], *fleet.engines])
                t0 = time.perf_counter()
                result = await publisher.publish(rep + 1, fleet)
                seconds.append(time.perf_counter() - t0)
                await _packed(fleet.engines)  # its CPU counted, and not in the next rep
                cpu1 = await _cpu_each([fleet.trainers[0], *fleet.engines])
                rank0_cpu.append(cpu1[0] - cpu0[0])
                engine_cpu.append(max(b - a for a, b in zip(cpu0[1:], cpu1[1:])))
                sent.append(await fleet.trainers[0].publication_bytes_sent.remote() - before)
                nbytes = result.bytes
                assert result.aborted_transfers == 0, result
            want = await fleet.trainers[0].weights_checksum.remote()
            got = await asyncio.gather(*(e.weights_checksum.remote() for e in fleet.engines))
            assert got == [want] * len(got), "an engine does not hold the published weights"
        finally:
            await fleet.shutdown()
        return {"seconds": seconds, "rank0_bytes": sent, "bytes": nbytes,
                "rank0_cpu": rank0_cpu, "engine_cpu": engine_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--engines", default="1,2,4,8")
    parser.add_argument("--modes", default="chain,off")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parse_with_smoke(parser, reps=1, hidden=64, layers=1, vocab=256, engines="1,2",
                            modes="chain")
    sizes = [int(n) for n in args.engines.split(",")]
    modes = args.modes.split(",")
    out: dict = {"engines": sizes}
    init_ray(num_cpus=2)  # logical: the engines share one, the trainer has the other
    try:
        for mode in modes:
            runs = []
            for n in sizes:
                cfg, report = load_checked("cluster_configs/local.toml", [
                    f"run.name=bench-scaling-{mode}-{n}", "wandb.mode=disabled",
                    "run.audit_fraction=0", f"cluster.cpu_engines={n}",
                    f"cluster.engine_cpus={1 / n}", "cluster.trainer_cpus=1",
                    "engine.torch_threads=1", "model.dtype=float32",
                    f"publication.relay={mode}",
                    f"model.hf_config.vocab_size={args.vocab}",
                    f"model.hf_config.hidden_size={args.hidden}",
                    f"model.hf_config.intermediate_size={2 * args.hidden}",
                    f"model.hf_config.num_hidden_layers={args.layers}",
                    f"model.hf_config.num_attention_heads={max(1, args.hidden // 64)}",
                    f"model.hf_config.num_key_value_heads={max(1, args.hidden // 64)}",
                    *args.set])
                runs.append(ray.get(ScalingBench.remote().run.remote(cfg, report.plan,
                                                                      args.reps)))
            out[mode] = {key: [round(statistics.median(r[key]), 4) for r in runs]
                         for key in ("seconds", "rank0_cpu", "engine_cpu")}
            out[mode]["rank0_bytes"] = [int(statistics.median(r["rank0_bytes"])) for r in runs]
            out["bytes"] = runs[0]["bytes"]
    finally:
        ray.shutdown()
    out["ratio_last_to_1"] = {m: round(out[m]["seconds"][-1] / out[m]["seconds"][0], 3)
                              for m in modes}
    # the work that bounds a publication where engines do not share cores: rank 0's, and
    # the busiest engine's (each receives, forwards, checks and packs one model)
    out["cpu_ratio_last_to_1"] = {m: {k: round(out[m][k][-1] / out[m][k][0], 3)
                                      for k in ("rank0_cpu", "engine_cpu")} for m in modes}
    out["megabytes"] = round(out["bytes"] / 2**20, 1)
    out["reps"] = args.reps
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
