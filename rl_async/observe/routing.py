"""The run's routing replay (MoE models), collection by collection, for the summary.

The torch trainer reports `train/routing_*` per collection (rl_async/train/routing.py); this
keeps the run's totals and means: summary `routing` = {"moe", "replay", "replayed_tokens",
"unreplayed_tokens", "replay_bytes_per_sample", "agreement", "logprob_mismatch_replay",
"logprob_mismatch_own"}
(means over the collections that measured them; None where none did).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEANS = ("agreement", "logprob_mismatch_replay", "logprob_mismatch_own")


@dataclass
class RoutingStats:
    moe: bool = False
    replay: bool = False
    replayed_tokens: float = 0.0
    unreplayed_tokens: float = 0.0
    replayed_samples: float = 0.0
    replay_bytes: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def observe(self, metrics: dict[str, float]) -> None:
        self.replayed_tokens += metrics.get("train/routing_replayed_tokens", 0.0)
        self.unreplayed_tokens += metrics.get("train/routing_unreplayed_tokens", 0.0)
        self.replayed_samples += metrics.get("train/routing_replayed_samples", 0.0)
        self.replay_bytes += metrics.get("train/routing_replay_bytes", 0.0)
        for name in MEANS:
            value = metrics.get(f"train/routing_{name}")
            if value is not None:
                self.sums[name] = self.sums.get(name, 0.0) + float(value)
                self.counts[name] = self.counts.get(name, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {"moe": self.moe, "replay": self.replay,
                "replayed_tokens": int(self.replayed_tokens),
                "unreplayed_tokens": int(self.unreplayed_tokens),
                "replay_bytes_per_sample": (self.replay_bytes / self.replayed_samples
                                            if self.replayed_samples else None),
                **{n: (self.sums[n] / self.counts[n] if self.counts.get(n) else None)
                   for n in MEANS}}
