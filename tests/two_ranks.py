"""Two spawned processes that form a real gloo group, for tests of collective timeouts."""

from __future__ import annotations

import multiprocessing
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(target, *args) -> str:
    """Run `target(rank, port, *args, results, release)` for ranks 0 and 1 and return the
    first outcome a rank reports; then release the silent peer and reap both processes."""
    ctx = multiprocessing.get_context("spawn")
    results, release = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results, release))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        outcome = results.get(timeout=120)
        release.put("done")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return outcome
