"""The relay side of RayFleet (publication.relay = "chain", staging engines): trainer rank 0
sends a publication once, to the first engine of a chain, and each engine forwards it to
the next while it receives (rl_async/engine/relay.py).

    links      one two-rank group per consecutive pair of the chain (engine indices in
               order), per pair of incarnations: the forwarding engine hosts it. A link
               that cannot be formed breaks the chain there: the engine after it starts a
               new segment, fed by rank 0 directly.
    transfer   rank 0 sends on the channel of each segment's first engine, in pieces
               (`relay_chunk_bytes`); every engine receives from its upstream (rank 0's
               channel or a link) and forwards on its link.
    fallback   an engine whose upstream failed (it died, hung, or its own upstream did)
               reports it; once the pass is over those engines get a direct send from rank
               0 over their own channels, the old way. An engine that failed itself is
               lost, as always.

Links whose engines changed (a replacement) are destroyed on the engines still up.
"""

from __future__ import annotations

import asyncio
import math

from rl_async.state.weights import FINGERPRINT_ROW_BYTES

# Staged publications travel in pieces. Along a chain they make it a pipeline: it moves a
# publication in about (pieces + engines - 1) piece times, so with 4 pieces per engine the
# fill costs a quarter of the transfer at most. At every engine, one chained or not, piece
# k+1 is received while piece k is fingerprinted and its linears packed, so at least 8.
PIECES_PER_ENGINE = 4
MIN_PIECES = 8
MIN_PIECE_BYTES = 1 << 18  # below this a piece's per-call cost outweighs the pipelining


def relay_chunk_bytes(total_bytes: int, engines: int) -> int:
    """The piece size of a staged publication of `total_bytes` to `engines` engines: whole
    fingerprint rows, so each piece's rows are summed as it lands."""
    count = max(MIN_PIECES, PIECES_PER_ENGINE * engines)
    size = max(MIN_PIECE_BYTES, math.ceil(total_bytes / count))
    return -(-size // FINGERPRINT_ROW_BYTES) * FINGERPRINT_ROW_BYTES


class FleetRelay:
    def _init_relay(self) -> None:
        # (forwarder, follower) -> (link name, forwarder incarnation, follower incarnation)
        self.links: dict[tuple[int, int], tuple[str, int, int]] = {}
        self._link_generation = 0

    def relays(self) -> bool:
        return self.stages_weights and self.cfg.publication.relay == "chain"

    async def _chain(self, order: list[int]) -> dict[int, str | None]:
        """Links along `order`; returns each engine's upstream link (None: rank 0 feeds
        it). Stale links are destroyed first."""
        wanted = {(a, b): (self.incarnations.get(a, 0), self.incarnations.get(b, 0))
                  for a, b in zip(order, order[1:])}
        stale = [pair for pair, (_, ia, ib) in self.links.items() if wanted.get(pair) != (ia, ib)]
        await self._close_links(stale)
        todo = [pair for pair in wanted if pair not in self.links]
        await asyncio.gather(*(self._form_link(a, b) for a, b in todo))
        upstream: dict[int, str | None] = {order[0]: None} if order else {}
        for a, b in zip(order, order[1:]):
            upstream[b] = self.links[(a, b)][0] if (a, b) in self.links else None
        return upstream

    async def _form_link(self, a: int, b: int) -> None:
        """Link a -> b; a failure leaves the pair unlinked (b is fed directly) and is
        blamed on no one: the transfer that follows finds out who is down."""
        self._link_generation += 1
        ia, ib = self.incarnations.get(a, 0), self.incarnations.get(b, 0)
        name = f"{self.prefix}/relay/engine-{a}n{ia}-engine-{b}n{ib}/g{self._link_generation}"
        timeout_s = self.cfg.publication.channel_timeout_s
        backend = "nccl" if self.cfg.cluster.inference_gpus else "gloo"
        try:
            addr, port = await asyncio.wait_for(
                self.engines[a].open_relay.remote(name, timeout_s), timeout_s)
            await asyncio.wait_for(asyncio.gather(
                self.engines[a].join_relay.remote(name),
                self.engines[b].init_weights_update_group.remote(
                    addr, port, 1, 2, name, backend, timeout_s)), timeout_s + 5)
        except Exception:  # noqa: BLE001 -- the chain breaks here; the transfer tells why
            await self._destroy_link_ends([(a, name), (b, name)])
            return
        self.links[(a, b)] = (name, ia, ib)

    async def _close_links(self, pairs: list[tuple[int, int]]) -> None:
        ends = []
        for a, b in pairs:
            name, ia, ib = self.links.pop((a, b))
            ends += [(i, name) for i, inc in ((a, ia), (b, ib))
                     if i not in self.down and self.incarnations.get(i, 0) == inc]
        await self._destroy_link_ends(ends)

    async def _destroy_link_ends(self, ends: list[tuple[int, str]]) -> None:
        """Best effort: an engine that is gone took its end with it."""
        timeout_s = self.cfg.publication.channel_timeout_s
        await asyncio.gather(*(asyncio.wait_for(
            self.engines[i].destroy_weights_update_group.remote(name), timeout_s)
            for i, name in ends), return_exceptions=True)

    async def _relay_transfer(self, live: list[int], metas: list[tuple], stage, which: str
                              ) -> tuple[int, dict[int, str], dict[int, dict]]:
        """One publication over the chain, then direct sends to the engines whose upstream
        failed. Same result as FleetPublication._transfer."""
        upstream = await self._chain(live)
        links = {a: name for (a, _b), (name, _ia, _ib) in self.links.items() if a in upstream}
        chunk = relay_chunk_bytes(sum(m[3] for m in metas), len(live))

        async def relayed(i: int, channel: str) -> dict:
            return await stage(i, upstream[i] or channel, links.get(i), chunk,
                               upstream[i] is not None)

        heads = [i for i in live if upstream[i] is None]
        sent, failed, results = await self._transfer(live, metas, relayed, which,
                                                     direct=heads, chunk_bytes=chunk)
        retry = [i for i, r in results.items() if r.get("upstream_failed")]
        if retry:  # the fallback: rank 0 sends to each of them on its own channel
            again, failed_again, results_again = await self._transfer(
                retry, metas, lambda i, channel: stage(i, channel, None, chunk, False), which,
                chunk_bytes=chunk)
            failed.update(failed_again)
            results.update(results_again)
            for i in failed_again:
                results.pop(i, None)
            sent += again
        return sent, failed, results
