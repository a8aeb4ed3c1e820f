"""Cost per group of CompletedBuffer put+get at capacities 8, 1,000 and 100,000.

A full buffer is the worst case: every block-mode cycle frees one slot and refills it, and
every evict-mode put ranks and evicts one group. The eviction ranking is heap-based, so the
cost per group should grow at most like log(capacity), not linearly. Prints microseconds per
group and the ratio to capacity 8; asserts nothing about time.

    .venv/bin/python benchmarks/buffer_ops.py [--cycles 20000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time

from _smoke import parse_with_smoke
from rl_async.loop.buffer import CompletedBuffer
from rl_async.base.types import Group, Sample

CAPACITIES = (8, 1_000, 100_000)
VERSION = 50


def make_groups(n: int, prefix: str, rng: random.Random) -> list[Group]:
    """Groups of 4 samples x 8 tokens with random versions (varied eviction ranks)."""
    versions = [int(rng.random() * (VERSION + 1)) for _ in range(4 * n)]
    return [Group(f"{prefix}{i}", [Sample(f"{prefix}{i}", response_ids=[0] * 8,
                                          token_versions=[versions[4 * i + j]] * 8)
                                   for j in range(4)])
            for i in range(n)]


async def cycle_cost(fill: list[Group], overflow: str, order: str, cycles: int) -> float:
    """Microseconds per group of one steady-state cycle on a full buffer of len(fill)."""
    capacity = len(fill)
    rng = random.Random(capacity)
    buf = CompletedBuffer(capacity, max_lag=10 * VERSION, order=order, overflow=overflow)
    buf.set_version(VERSION)
    for g in fill:
        await buf.put(g)
    fresh = make_groups(cycles, "new", rng)
    again = make_groups(cycles, "again", rng)
    gc.collect()
    gc.disable()  # a collection pass over 100k resident groups would swamp the numbers
    start = time.perf_counter()
    if overflow == "block":
        for g in fresh:  # frees one slot, refills it: one get + one put per group
            await buf.get(1, VERSION)
            await buf.put(g)
    else:
        for g in fresh:  # a put into a full buffer ranks and evicts one; then one get + put
            await buf.put(g)
        for g in again:
            await buf.get(1, VERSION)
            await buf.put(g)
        cycles *= 2
    elapsed = time.perf_counter() - start
    gc.enable()
    assert len(buf) == capacity
    return elapsed / cycles * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--capacities", type=int, nargs="+", default=list(CAPACITIES))
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parse_with_smoke(parser, cycles=50, capacities=[8, 100])
    modes = [("block", "fifo"), ("block", "lifo"), ("evict", "fifo"), ("evict", "lifo")]
    caps = args.capacities
    fills = {c: make_groups(c, "fill", random.Random(c)) for c in caps}
    costs = {f"{o}/{r}": [asyncio.run(cycle_cost(fills[c], o, r, args.cycles)) for c in caps]
             for o, r in modes}
    if args.json:
        print(json.dumps({"capacities": caps, "us_per_group": {m: [round(x, 3) for x in v]
                                                               for m, v in costs.items()},
                          f"ratio_{caps[-1]}_to_{caps[0]}": {m: round(v[-1] / v[0], 3)
                                                             for m, v in costs.items()}}))
        return
    print(f"{'mode':<12}" + "".join(f"{f'cap {c:,}':>16}" for c in caps)
          + f"{'ratio last/first':>18}")
    for mode, values in costs.items():
        cells = "".join(f"{f'{us:.2f} us/group':>16}" for us in values)
        print(f"{mode:<12}{cells}{values[-1] / values[0]:>18.2f}")


if __name__ == "__main__":
    main()
