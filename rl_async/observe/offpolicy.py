"""The run's off-policy health, collection by collection, for the summary.

The trainer reports per-step diagnostics as `train/*` metrics (rl_async/algo/loss_metrics.py;
W&B gets each step's). This keeps their mean over the run, their worst value, and the last,
so a summary shows how far the data drifted from the trainer and how much the correction had
to do about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# metric -> summary name; "worst" is the max for all of these except the ESS (its min).
DIAGNOSTICS = {
    "train/kl_k3_trainer_rollout": "kl_k3_trainer_rollout",
    "train/logprob_kl": "kl_k3_rollout_trainer",
    "train/logratio_over_ln2_fraction": "logratio_over_ln2_fraction",
    "train/logratio_m2": "logratio_m2",
    "train/logratio_m2_kept": "logratio_m2_kept",
    "train/masked_fraction": "masked_fraction",
    "train/masked_fraction_adv_pos": "masked_fraction_adv_pos",
    "train/masked_fraction_adv_neg": "masked_fraction_adv_neg",
    "train/ppo_clip_fraction": "clip_fraction",
    "train/tis_ess_ratio": "ess_ratio",
}
LOWER_IS_WORSE = ("ess_ratio",)


@dataclass
class OffPolicyStats:
    policy_loss: str = "ppo_tis"
    is_mask: str = "none"
    collections: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    worst: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def observe(self, metrics: dict[str, float]) -> None:
        """One collection's metrics (averaged over its optimizer steps by the trainer)."""
        seen = {DIAGNOSTICS[k]: float(v) for k, v in metrics.items() if k in DIAGNOSTICS}
        if not seen:
            return
        self.collections += 1
        for name, v in seen.items():
            self.sums[name] = self.sums.get(name, 0.0) + v
            pick = min if name in LOWER_IS_WORSE else max
            self.worst[name] = pick(self.worst.get(name, v), v)
            self.last[name] = v

    def to_dict(self) -> dict[str, Any]:
        n = max(self.collections, 1)
        out: dict[str, Any] = {"policy_loss": self.policy_loss, "is_mask": self.is_mask,
                               "collections": self.collections}
        for name in DIAGNOSTICS.values():
            if name in self.sums:
                out[name] = {"mean": self.sums[name] / n, "worst": self.worst[name],
                             "last": self.last[name]}
        return out
