"""The relay (publication.relay = "chain"): an engine forwards what it receives to the next
engine while it receives the rest, so trainer rank 0 sends each publication once, not once
per engine.

    trainer rank 0 --piece--> engine a --piece--> engine b --piece--> engine c
                   (channel)           (link a->b)          (link b->c)

A link is a two-rank process group hosted by the forwarding engine (rank 0, like the
trainer's channels: rl_async/state/collective.py). Buckets travel in pieces of
`chunk_bytes` so the chain is a pipeline: with P pieces and N engines, a publication takes
about (P + N - 1) piece times instead of N x P from rank 0 alone (`pieces`, in
rl_async/state/weights.py: the sender cuts them the same way). Each piece is
forwarded asynchronously right after it lands; the receive of the next piece goes on
meanwhile.

A follower that fails does not fail its forwarder: `Forwarder` records the error and stops
sending. An engine whose upstream fails reports it instead of raising (the fleet then sends
to it, and to the rest of the chain, directly from rank 0).
"""

from __future__ import annotations

import asyncio
import time

import torch
import torch.distributed as dist

from rl_async.state import collective
from rl_async.state.weights import pieces  # noqa: F401 -- how a relay cuts a bucket


class Forwarder:
    """The pieces an engine forwards on its link to the next engine (none when `link` is
    None): sent asynchronously in order, each waited for within the link's timeout."""

    def __init__(self, link: str | None):
        self.link = link
        self.group = collective.get_group(link) if link else None
        self.backend, self.timeout_s = (collective.group_backend(link) if link
                                        else ("gloo", 0.0))
        self.works: list = []
        self.error: str | None = None

    def send(self, piece: torch.Tensor) -> None:
        if self.group is None or self.error is not None:
            return
        try:
            self.works.append(dist.broadcast(piece, group=self.group, group_src=0,
                                             async_op=True))
        except Exception as exc:  # noqa: BLE001 -- the follower's problem, reported
            self.error = f"forwarding on {self.link}: {type(exc).__name__}: {exc}"

    async def finish(self) -> str | None:
        """Wait for every forwarded piece; the follower's failure, if any (it is reported,
        never raised: this engine's own staging is not affected)."""
        for k, work in enumerate(self.works):
            if self.error is not None:
                break
            try:
                await asyncio.to_thread(collective.wait, work, time.monotonic()
                                        + self.timeout_s, f"relay link {self.link} piece "
                                        f"{k + 1}/{len(self.works)}", self.backend)
            except Exception as exc:  # noqa: BLE001 -- as in send()
                self.error = f"forwarding on {self.link}: {type(exc).__name__}: {exc}"
        return self.error
