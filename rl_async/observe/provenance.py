"""The run summary's `provenance` (SPEC §13): the provenance audit's per-collection figures
(`provenance/*`, rl_async/train/audit.py) summed over the run."""

from __future__ import annotations

COUNTS = ("audited_tokens", "mismatches", "unverifiable_tokens")


class ProvenanceTotals:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {**{k: 0 for k in COUNTS}, "max_abs_diff": 0.0}

    def observe(self, metrics: dict[str, float]) -> None:
        for key in COUNTS:
            self.totals[key] += int(metrics.get(f"provenance/{key}", 0))
        self.totals["max_abs_diff"] = max(self.totals["max_abs_diff"],
                                          float(metrics.get("provenance/max_abs_diff", 0.0)))

    def summary(self) -> dict:
        """{"audited_tokens", "mismatches", "max_abs_diff", "unverifiable_tokens"}: all 0
        when the audit is off (run.audit_fraction = 0)."""
        return dict(self.totals)
