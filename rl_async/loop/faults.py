"""Who decides what when something fails (DESIGN §9: every fault has an owner).

    transient (connection reset, HTTP 5xx, request timeout, a dead engine)
        -> the sample is aborted; its group is regenerated from the original prompt
    permanent (malformed request, engine-side validation, a reward that keeps failing)
        -> the group fails with the error (ledger `failed_groups`, summary `failures`)
    an engine that is dead or does not answer its probe
        -> out of routing at once, its requests aborted, a replacement started in the same
           placement bundle (EngineRestarts); past `engine.max_restarts` the run stops
    too many failed groups (FailureBudget) or no progress at all (stall deadline)
        -> the run stops with the failing component and its last error quoted

This module is the policy only (no Ray, no clocks of its own): the producer feeds the
failure budget, the fleet's engine supervisor feeds the restart budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rl_async.engine.base import TransientEngineError  # noqa: F401 -- the transient class, by its owner


class RunStopped(RuntimeError):
    """A fault policy stopped the run; the message names the component and quotes its error."""


def quote(error: str, limit: int = 600) -> str:
    """The error text as it was, bounded: the first line kept whole (it names the cause)."""
    error = error.strip()
    if len(error) <= limit:
        return error
    first = error.splitlines()[0]
    return first if len(first) >= limit else f"{first} ... {error[-(limit - len(first)):]}"


@dataclass
class FailureBudget:
    """Stops the run when more than `max_fraction` of the last `window` groups failed.

    Counted as a number of failures among the most recent `window` group outcomes, so a
    run whose every group fails stops after `max_fraction * window` groups, while a few
    prompts that always fail (a bad row, a flaky verifier) never reach it."""

    window: int
    max_fraction: float
    _outcomes: deque = field(default_factory=deque)
    _failed: int = 0
    last_error: str = ""
    last_component: str = ""

    def __post_init__(self) -> None:
        if self.window < 1 or not 0 < self.max_fraction <= 1:
            raise ValueError(f"run.failure_window_groups = {self.window}, "
                             f"run.max_failed_group_fraction = {self.max_fraction}: need a "
                             f"window >= 1 and a fraction in (0, 1]")

    def record(self, failed: bool, component: str = "", error: str = "") -> None:
        """One group outcome; raises RunStopped when the budget is spent."""
        self._outcomes.append(failed)
        self._failed += failed
        if len(self._outcomes) > self.window:
            self._failed -= self._outcomes.popleft()
        if failed:
            self.last_error, self.last_component = error, component
        if self._failed > self.max_fraction * self.window:
            raise RunStopped(
                f"{self._failed} of the last {len(self._outcomes)} groups failed (more than "
                f"run.max_failed_group_fraction = {self.max_fraction} of "
                f"run.failure_window_groups = {self.window}); the last failure: "
                f"{self.last_component or 'group'}: {quote(self.last_error)}")


@dataclass
class EngineRestarts:
    """Restarts of crashed or unresponsive engines, bounded per run by engine.max_restarts."""

    max_restarts: int
    restarts: int = 0
    causes: dict[int, list[str]] = field(default_factory=dict)

    def record(self, engine: int, cause: str) -> None:
        """Count one restart of `engine`; raises RunStopped past the budget."""
        self.causes.setdefault(engine, []).append(quote(cause, 300))
        if self.restarts >= self.max_restarts:
            listed = "; ".join(f"engine-{i}: {' | '.join(c)}" for i, c in self.causes.items())
            raise RunStopped(
                f"engine-{engine} failed and engine.max_restarts = {self.max_restarts} "
                f"restarts are used up; causes: {listed}")
        self.restarts += 1
