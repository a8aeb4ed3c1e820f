"""Plain data passed between every component: samples, groups, collections.

A *group* is the unit that travels through the system: the `n_samples_per_prompt` responses
to one prompt, generated, rewarded and delivered to training together. Everything here is a
picklable dataclass (groups cross Ray actor boundaries) and holds no tensors.

Per-token bookkeeping that the rest of the system relies on:

- `token_versions[i]` is the policy version of the weights that sampled response token i.
  Age and staleness are computed from these and nothing else (SPEC §5).
- `behavior_logprobs[i]` is the engine's log-prob of response token i at sampling time. It is
  the TIS denominator and is never recomputed (LESSONS: ROLL#242).
- `loss_mask[i]` (multi-turn trajectories, SPEC §12): 1 for a token the policy sampled, 0 for
  one the environment or the chat template added (a tool result, a user turn). Masked tokens
  are context only: version -1, log-prob 0, never trained, never counted in a sample's age.
  Empty = every response token was sampled (single-turn).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoutedExperts:
    """The top-k expert ids an engine's routers chose, for positions 0 .. positions - 1 of
    prompt + response (every token the engine fed: all but the last response token), every
    MoE layer: a C-order [positions, layers, k] array of unsigned ints, as bytes (1 byte per
    id up to 256 experts, else 2). The trainer replays them (routing replay, "R3") so that it
    scores the function the engine sampled from. Bytes, not lists: 48 layers x 8 experts
    per token as Python ints would cost ~100x the memory in every queue."""

    data: bytes
    positions: int
    layers: int
    k: int
    itemsize: int = 1  # 1 (uint8) or 2 (uint16)

    def __post_init__(self) -> None:
        if self.itemsize not in (1, 2):
            raise ValueError(f"RoutedExperts.itemsize = {self.itemsize}: 1 or 2 bytes per id")
        want = self.positions * self.layers * self.k * self.itemsize
        if len(self.data) != want:
            raise ValueError(f"RoutedExperts: {len(self.data)} bytes for {self.positions} "
                             f"positions x {self.layers} layers x top-{self.k} "
                             f"x {self.itemsize} B = {want}")

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def rows(self) -> list[list[list[int]]]:
        """As nested lists [positions][layers][k] (recordings, tests)."""
        size, n = self.itemsize, self.layers * self.k
        ids = [int.from_bytes(self.data[i:i + size], "little")
               for i in range(0, len(self.data), size)]
        return [[ids[p * n + j * self.k: p * n + (j + 1) * self.k] for j in range(self.layers)]
                for p in range(self.positions)]

    @staticmethod
    def from_rows(rows: list[list[list[int]]]) -> RoutedExperts:
        """From nested lists [positions][layers][k] (every position the same shape)."""
        layers = len(rows[0]) if rows else 0
        k = len(rows[0][0]) if layers else 0
        flat = [e for position in rows for layer in position for e in layer]
        if any(len(p) != layers or any(len(layer) != k for layer in p) for p in rows):
            raise ValueError(f"routed experts: positions of different shapes; every position "
                             f"needs {layers} layers x top-{k}")
        if any(e < 0 for e in flat):
            raise ValueError("routed experts: a negative expert id")
        size = 1 if max(flat, default=0) < 256 else 2
        data = b"".join(e.to_bytes(size, "little") for e in flat)
        return RoutedExperts(data, len(rows), layers, k, size)


@dataclass
class Sample:
    """One response to one prompt."""

    prompt_id: str
    response_ids: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    reward: float | None = None
    prompt_ids: list[int] = field(default_factory=list)
    # "stop" (stop token), "length" (max_new_tokens), "abort" (engine aborted it).
    finish_reason: str = ""
    # Free-form task data (e.g. the expected answer) carried from the prompt source to reward.
    metadata: dict[str, Any] = field(default_factory=dict)
    # The sampling seed this attempt was generated with (rl_async.algo.seeding); None = the
    # engine's own stream (arrival order).
    seed: int | None = None
    # Multi-turn trajectories: per response token, 1 = sampled (trained), 0 = added by the
    # environment or the template (context only); empty = all sampled. `turns` counts the
    # assistant turns (0 for a single-turn sample).
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    # Mixture-of-experts models (train.routing_replay): the experts the engine's routers
    # chose at every position it fed through the model (RoutedExperts); None = not recorded.
    routed_experts: RoutedExperts | None = None

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    def oldest_version(self) -> int | None:
        """Oldest policy version among this sample's sampled tokens (masked tokens carry
        -1 and no version); None when none was recorded."""
        versions = [v for v in self.token_versions if v >= 0]
        return min(versions) if versions else None

    def fresh_copy(self) -> Sample:
        """The same prompt with nothing of a previous attempt (tokens, log-probs, versions)."""
        return Sample(
            prompt_id=self.prompt_id,
            prompt_ids=list(self.prompt_ids),
            metadata=dict(self.metadata),
        )


@dataclass
class Group:
    """The `n_samples_per_prompt` responses to one prompt: the unit of buffering and training.

    `group_id` names the prompt (stable across retries); `attempt` counts regenerations from
    the original prompt; `cursor` is the prompt's position in the source (set by the ledger;
    -1 = not issued by one). (cursor, attempt) orders a collection canonically and, with the
    run seed and a sample's index, seeds its sampling. `arrival_seq` is assigned by the
    completed buffer on insertion.
    """

    group_id: str
    samples: list[Sample]
    attempt: int = 0
    cursor: int = -1
    arrival_seq: int = -1
    # Filled in when the group is delivered: its age at dequeue (None = unknown).
    age_at_delivery: int | None = None
    # The trainer's version when the group entered the completed buffer: the age it had
    # then came from generation (in flight), the rest from waiting (in queue).
    version_at_insert: int | None = None

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def response_tokens(self) -> int:
        return sum(s.response_len for s in self.samples)

    def oldest_version(self) -> int | None:
        """min of every recorded token version over all responses (SPEC §5); None = unknown."""
        versions = [v for v in (s.oldest_version() for s in self.samples) if v is not None]
        return min(versions) if versions else None

    def summed_oldest_versions(self) -> int:
        """Sum over samples of each sample's oldest version (eviction tie-break, SPEC §6).

        A smaller sum means larger summed staleness. Samples without versions add nothing.
        """
        return sum(v for v in (s.oldest_version() for s in self.samples) if v is not None)

    def newest_version(self) -> int | None:
        """max of every recorded token version; None = unknown."""
        versions = [max(s.token_versions) for s in self.samples if s.token_versions]
        return max(versions) if versions else None

    def age(self, current_version: int) -> int | None:
        """`current_version - oldest token version`; None when the age is unknown.

        A token version newer than `current_version` is an error (SPEC §5): it means the
        caller passed a stale version, and every staleness decision would be wrong.
        """
        oldest = self.oldest_version()
        if oldest is None:
            return None
        newest = max(max(s.token_versions) for s in self.samples if s.token_versions)
        if newest > current_version:
            raise ValueError(
                f"group {self.group_id!r} has a token of policy version {newest}, newer than "
                f"the current version {current_version}: the version passed to the buffer "
                f"must be the controller's latest"
            )
        return current_version - oldest

    def fresh_attempt(self) -> Group:
        """A new attempt at the same ORIGINAL prompts, with nothing of this attempt kept."""
        return Group(
            group_id=self.group_id,
            samples=[s.fresh_copy() for s in self.samples],
            attempt=self.attempt + 1,
            cursor=self.cursor,
        )

    def replace(self, **changes: Any) -> Group:
        return dataclasses.replace(self, **changes)
