"""TP ranks past 0 of the fake SGLang server (tests/fake_sglang_server.py): one helper process
each, as SGLang runs one scheduler process per TP rank. Every rank joins each weight-update
group as `rank_offset + tp_rank` and receives every broadcast from group rank 0
(python/sglang/srt/model_executor/model_runner_components/weight_updater.py:
init_weights_update_group, receive_weights_from_distributed), so a publication channel of an
engine with `--tp-size N` has world 1 + N, as on the real server.
"""

from __future__ import annotations

import asyncio
import multiprocessing

import torch
import torch.distributed as dist

from rl_async.state import collective
from rl_async.state.models import resolve_dtype
from rl_async.state.weights import weights_checksum

REPLY_TIMEOUT_S = 600  # a helper answers within a receive's own deadline


def receive_tensors(group, dtypes: list[str], shapes: list[list[int]]) -> list[torch.Tensor]:
    """One broadcast per tensor, in `names` order, from group rank 0."""
    tensors = [torch.empty(shape, dtype=resolve_dtype(dtype))
               for dtype, shape in zip(dtypes, shapes)]
    for t in tensors:
        dist.broadcast(t, group=group, group_src=0)
    return tensors


def _rank(conn, tp_rank: int) -> None:
    torch.set_num_threads(1)
    held: dict[str, torch.Tensor] = {}  # what this rank received, by name
    while True:
        op, *args = conn.recv()
        try:
            if op == "stop":
                return
            if op == "join":
                url, world, offset, name, backend = args
                collective.init_custom_process_group(backend, url, world, offset + tp_rank,
                                                     name)
                out = None
            elif op == "receive":
                name, names, dtypes, shapes = args
                held.update(zip(names, receive_tensors(collective.get_group(name), dtypes,
                                                       shapes)))
                out = None
            elif op == "destroy":
                collective.destroy_group(args[0])
                out = None
            else:  # checksum
                out = weights_checksum(held.items())
            conn.send(("ok", out))
        except Exception as exc:  # noqa: BLE001 -- raised in the server, with the rank
            conn.send(("error", f"TP rank {tp_rank}: {type(exc).__name__}: {exc}"))


class TPRanks:
    """TP ranks 1..tp-1 (none with tp = 1)."""

    def __init__(self, tp: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(1, tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank, args=(child, r), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    async def _all(self, *command) -> list:
        def call(conn):
            conn.send(command)
            if not conn.poll(REPLY_TIMEOUT_S):
                raise TimeoutError(f"a TP rank did not answer {command[0]}")
            status, out = conn.recv()
            if status != "ok":
                raise RuntimeError(out)
            return out

        return await asyncio.gather(*(asyncio.to_thread(call, c) for c in self.conns))

    async def join(self, url: str, body: dict) -> None:
        await self._all("join", url, body["world_size"], body["rank_offset"],
                        body["group_name"], body["backend"])

    async def receive(self, name: str, names: list[str], dtypes: list[str],
                      shapes: list[list[int]]) -> None:
        await self._all("receive", name, names, dtypes, shapes)

    def destroy(self, name: str) -> None:
        asyncio.ensure_future(self._all("destroy", name))

    async def checksums(self) -> list[str]:
        return await self._all("checksum")

    async def stop(self) -> None:
        for conn in self.conns:
            conn.send(("stop",))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
