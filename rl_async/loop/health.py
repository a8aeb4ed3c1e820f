"""Close the loop from off-policy health to pacing (`async.health_control = true`).

After every collection the controller hands the trainer's diagnostics (rl_async/algo/
loss_metrics.py) to `HealthControl.observe`. A collection is unhealthy when any crosses its
threshold:

    train/kl_k3_trainer_rollout        > async.health_kl_max
    train/logratio_over_ln2_fraction   > async.health_ln2_fraction_max
    train/tis_ess_ratio                < async.health_ess_min

Unhealthy: first publish sooner (halve the publication interval, down to every update; a
publication that is then due happens at once), then lower the producer budget (halve the
groups it may have in flight, down to a quarter of the configured budget): both make the
next data younger. Healthy for async.health_patience
collections in a row: loosen one step, the producer budget first, back up to the configured
values. Every decision is an event: W&B `health/*` at its step, and the summary's `health`
block lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# W&B code of each action (health/action), beside its name in the summary
ACTIONS = {"publish_sooner": 1, "lower_budget": 2, "raise_budget": -2, "publish_later": -1}


@dataclass
class HealthThresholds:
    kl_max: float = 0.05
    ln2_fraction_max: float = 0.05
    ess_min: float = 0.5
    patience: int = 3

    def breaches(self, m: dict[str, float]) -> list[str]:
        """What crossed its threshold in one collection's metrics (none measured: none)."""
        out = []
        kl = m.get("train/kl_k3_trainer_rollout")
        if kl is not None and kl > self.kl_max:
            out.append(f"kl_k3_trainer_rollout {kl:.4g} > {self.kl_max:g}")
        ln2 = m.get("train/logratio_over_ln2_fraction")
        if ln2 is not None and ln2 > self.ln2_fraction_max:
            out.append(f"logratio_over_ln2_fraction {ln2:.4g} > {self.ln2_fraction_max:g}")
        ess = m.get("train/tis_ess_ratio")
        if ess is not None and 0 < ess < self.ess_min:
            out.append(f"tis_ess_ratio {ess:.4g} < {self.ess_min:g}")
        return out


@dataclass
class HealthControl:
    thresholds: HealthThresholds
    every_updates: int              # the configured publication interval (the loosest)
    budget_groups: int              # the configured producer budget, in groups
    floor_groups: int               # never below a quarter of the budget
    current_every: int = 0
    current_budget: int = 0
    healthy_run: int = 0
    unhealthy: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.current_every = self.current_every or self.every_updates
        self.current_budget = self.current_budget or self.budget_groups

    def observe(self, metrics: dict[str, float], step: int) -> list[dict[str, Any]]:
        """One collection's verdict; the decisions it took (each also kept in `events`)."""
        breaches = self.thresholds.breaches(metrics)
        if breaches:
            self.unhealthy += 1
            self.healthy_run = 0
            return self._tighten(step, "; ".join(breaches))
        self.healthy_run += 1
        if self.healthy_run < self.thresholds.patience:
            return []
        self.healthy_run = 0
        return self._loosen(step)

    def _tighten(self, step: int, reason: str) -> list[dict[str, Any]]:
        if self.current_every > 1:
            self.current_every = max(1, self.current_every // 2)
            return [self._event(step, "publish_sooner", reason, self.current_every)]
        if self.current_budget > self.floor_groups:
            self.current_budget = max(self.floor_groups, self.current_budget // 2)
            return [self._event(step, "lower_budget", reason, self.current_budget)]
        return []  # already as tight as it goes: the events so far say so

    def _loosen(self, step: int) -> list[dict[str, Any]]:
        if self.current_budget < self.budget_groups:
            self.current_budget = min(self.budget_groups, self.current_budget * 2)
            return [self._event(step, "raise_budget", "healthy", self.current_budget)]
        if self.current_every < self.every_updates:
            self.current_every = min(self.every_updates, self.current_every * 2)
            return [self._event(step, "publish_later", "healthy", self.current_every)]
        return []

    def _event(self, step: int, action: str, reason: str, value: int) -> dict[str, Any]:
        event = {"step": step, "action": action, "reason": reason, "value": value}
        self.events.append(event)
        return event

    def metrics(self, decisions: list[dict[str, Any]]) -> dict[str, float]:
        """W&B rows: the settings now, and the last decision's code (0: none this time)."""
        code = ACTIONS[decisions[-1]["action"]] if decisions else 0
        return {"health/publication_every_updates": float(self.current_every),
                "health/producer_budget_groups": float(self.current_budget),
                "health/action": float(code),
                "health/unhealthy_collections": float(self.unhealthy)}

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": True, "unhealthy_collections": self.unhealthy,
                "publication_every_updates": self.current_every,
                "producer_budget_groups": self.current_budget, "events": list(self.events)}


def health_for(cfg, plan) -> HealthControl | None:
    """The run's health control, or None when async.health_control is off."""
    a = cfg.async_
    if not a.health_control:
        return None
    return HealthControl(
        HealthThresholds(a.health_kl_max, a.health_ln2_fraction_max, a.health_ess_min,
                         a.health_patience),
        every_updates=cfg.publication.every_updates, budget_groups=plan.producer_groups,
        floor_groups=max(1, math.ceil(plan.producer_groups / 4)))
