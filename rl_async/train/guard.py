"""Non-finite training stops instead of going on wrong (both trainer backends).

    per optimizer update: gradient norm (after the data-parallel reduction: the same on
    every rank, so every rank decides alike) finite?
        yes -> take the update
        no  -> skip it: gradients dropped, weights, optimizer state and the lr schedule's
               step unchanged; counted (`train/nonfinite_updates`, summary
               `faults.nonfinite_updates`)
    more than `train.max_nonfinite_updates` skipped updates in a row -> NonFiniteTraining,
    naming the step and the quantity (the run stops with it as its error)

A non-finite loss always gives a non-finite gradient norm; a finite loss with an overflowing
backward does too. Weights are checked again wherever they leave the trainer (publication
snapshots and exports: rl_async/state/weights.py `require_finite`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class NonFiniteTraining(RuntimeError):
    """Too many non-finite updates in a row; the message names the step and the quantity."""


@dataclass
class NonFiniteGuard:
    max_in_a_row: int = 3
    in_a_row: int = 0
    skipped: int = 0

    @staticmethod
    def take(grad_norm: float) -> bool:
        return math.isfinite(grad_norm)

    def record(self, step: int, loss: float, grad_norm: float, took: bool) -> None:
        """After an update (taken or skipped); raises past `max_in_a_row` skipped ones."""
        if took:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            value = loss if not math.isfinite(loss) else grad_norm
            raise NonFiniteTraining(
                f"optimizer step {step}: non-finite {what} ({value}) in {self.in_a_row} "
                f"updates in a row, more than train.max_nonfinite_updates = "
                f"{self.max_in_a_row}; each was skipped. Lower train.lr, check the rewards, "
                f"or use float32 (model.dtype)")
