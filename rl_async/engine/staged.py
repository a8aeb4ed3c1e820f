"""What a staged publication holds on the embedded engine until its commit, and the checks
each bucket goes through as its pieces land (rl_async/engine/embedded_weights.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from rl_async.engine.base import EngineError
from rl_async.state.weights import Fingerprint, unflatten_bucket


@dataclass
class StagedWeights:
    """One staged publication: what commit_weights installs."""
    version: int
    digest: str
    buckets: list[tuple[tuple[str, ...], int, list]] = field(default_factory=list)
    packed: dict = field(default_factory=dict)  # oneDNN-packed linears of the new weights
    # the packing of the linears whose bytes came last, still under way (see commit_weights)
    late: asyncio.Future | None = None


class BucketCheck:
    """One staged bucket's checks, run on the engine's checking thread as its pieces land:
    its tensors named and shaped like the model's (before any byte arrives), its
    fingerprint row by row, each linear packed once its bytes are all in, and at the end
    the fingerprint against the trainer's. A bucket that fails any of them is never
    committed (its packed copies are dropped with the staging)."""

    def __init__(self, engine, staged: StagedWeights, i: int, count: int, flat: torch.Tensor,
                 meta: tuple, want: str):
        self.engine, self.staged, self.i, self.want = engine, staged, i, want
        self.where = f"bucket {i + 1}/{count}"
        self.fingerprint = Fingerprint(flat)
        self.error: str | None = None
        self.named: list = []
        try:
            engine._check_names(meta[0], meta[2])
            self.named = unflatten_bucket(flat, *meta)
        except EngineError as exc:
            self.error = f"{self.where}: {exc}"
        base = flat.data_ptr()
        self.ends = [t.data_ptr() - base + t.numel() * t.element_size() for _, t in self.named]
        self.packed = 0  # tensors of `named` packed so far

    def landed(self, upto: int, pack: bool = True) -> None:
        """Bytes [0, upto) of the bucket are in: fingerprint them, and pack (`pack`) the
        linears they complete."""
        self.fingerprint.advance(upto)
        if pack:
            self.staged.packed.update(self.pack_rest(upto))

    def pack_rest(self, upto: int | None = None) -> dict:
        """Pack the linears complete in bytes [0, upto) (all by default) not packed yet."""
        done = self.packed
        while self.packed < len(self.named) and (upto is None or self.ends[self.packed] <= upto):
            self.packed += 1
        linears = self.engine._linears
        if linears is None or self.error is not None or self.packed == done:
            return {}
        params = self.engine._params
        return linears.pack([(params[n], t) for n, t in self.named[done:self.packed]])

    def finish(self) -> tuple[str | None, str]:
        """(error or None, the bucket's fingerprint), once every piece landed."""
        got = self.fingerprint.hexdigest()
        if self.error is None and got != self.want:
            self.error = (f"{self.where}: fingerprint {got[:12]} is not the trainer's "
                          f"{self.want[:12]} (corrupted in transit)")
        if self.error is None:
            self.staged.buckets[self.i][2].extend(self.named)
        return self.error, got
