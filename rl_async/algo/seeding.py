"""Per-request sampling seeds: a sample's randomness is a function of what it is, never of when
it arrived.

A training sample is named by (run seed, prompt cursor, attempt, sample index); an evaluation
sample by (run seed, held-out prompt index, sample index) in its own stream. The seed is a hash
of that name, so the same prompt attempt draws the same tokens whatever the engine, the batch
it shares or the order requests reached it (with batch-invariant decoding: run.deterministic).
A regenerated attempt (aborted, discarded, evicted) draws fresh randomness: attempt is part of
the name.

31 bits: every backend takes it (torch.Generator, SGLang's `sampling_seed`); a collision only
makes two unrelated requests share a random stream, which is still deterministic.
"""

from __future__ import annotations

import hashlib
import struct

SEED_BITS = 31
_TRAIN, _EVAL, _TURN = 0, 1, 2


def _hash(*parts: int) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def sample_seed(run_seed: int, cursor: int, attempt: int, index: int) -> int:
    """The sampling seed of sample `index` of the `attempt`-th attempt at prompt `cursor`."""
    if cursor < 0:
        raise ValueError(f"sample_seed: cursor = {cursor}: the group was not issued by the "
                         f"prompt ledger (Group.cursor is set when a prompt is issued)")
    return _hash(_TRAIN, run_seed, cursor, attempt, index)


def eval_seed(run_seed: int, prompt_index: int, index: int) -> int:
    """The seed of sampled eval response `index` to held-out prompt `prompt_index`: the same at
    every evaluation, so successive evals compare policies on common random numbers."""
    return _hash(_EVAL, run_seed, prompt_index, index)


def turn_seed(seed: int, turn: int) -> int:
    """The seed of assistant turn `turn` of a multi-turn trajectory sampled with `seed`: turn 0
    uses the sample's own seed, later turns their own streams (a fixed seed per turn would
    replay the same random numbers at every turn)."""
    return seed if turn == 0 else _hash(_TURN, seed, turn)
