"""Controller actor: builds the fleet, owns the policy version, runs the training loop
(rl_async.loop.controller.Controller) and logs metrics in one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ray

from actors.fleet import RayFleet, Resume
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.loop.controller import Controller
from rl_async.observe.metrics import MemorySink, MetricsLogger, WandbSink


@ray.remote(num_cpus=0)
class ControllerActor:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, warnings: list[dict],
                 run_dir: str | None = None, resume: Resume | None = None):
        self.cfg, self.plan, self.warnings = cfg, plan, warnings
        self.run_dir, self.resume = run_dir, resume
        self.controller: Controller | None = None
        self.fleet: RayFleet | None = None
        self.memory = MemorySink()
        self.error: str | None = None
        self._stop_requested = False

    def _logger(self) -> MetricsLogger:
        sinks = [self.memory]
        w = self.cfg.wandb
        if w.mode != "disabled":
            config = {**self.cfg.to_dict(), "capacity_plan": self.plan.to_dict(),
                      "capacity_warnings": self.warnings}
            sinks.append(WandbSink(w.mode, w.project, w.entity, self.cfg.run.name, config,
                                   Path(self.cfg.run.output_dir) / self.cfg.run.name))
        from actors.ray_metrics import RayMetricsSink

        sinks.append(RayMetricsSink())
        return MetricsLogger(sinks)

    async def run(self) -> dict:
        logger = self._logger()
        self.fleet = RayFleet(self.cfg, self.plan, self.run_dir, self.resume)
        r = self.resume
        try:
            await self.fleet.start()
            self.controller = Controller(self.cfg, self.plan, self.fleet, logger.log,
                                         start_step=r.step if r else 0,
                                         start_version=r.version if r else 0,
                                         resumed=r.progress if r else None)
            if r is not None:
                self.controller.checkpoint_dir = r.path
            self.controller.stop_requested = self._stop_requested  # asked during start-up
            summary = await self.controller.run()
            summary["failures"] = await self.fleet.bounded(self.fleet.source.failures.remote(),
                                                           "prompt-source.failures")
            summary["run_dir"] = str(self.fleet.run_dir)
            summary["fleet"] = self.fleet.fleet_summary()
            if r is not None:
                summary["resumed_from"] = {"step": r.step, "path": r.path}
            return summary
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.partial = await self._partial_summary()
            raise
        finally:
            logger.close()
            await self.fleet.shutdown()

    async def _partial_summary(self) -> dict:
        """What a failed run can still account for (the ledger, if its actor is alive)."""
        out: dict = {"error": self.error}
        if self.fleet is not None:  # the driver writes <run dir>/summary.json from it
            out["run_dir"] = str(self.fleet.run_dir)
        if self.controller is not None:
            p = self.controller.progress
            out.update(steps=p.step, policy_version=self.controller.version,
                       eval={"initial_reward": p.initial_eval, "final_reward": p.final_eval})
        try:  # bounded: a wedged (not dead) prompt source must not hang the failure report
            out["ledger"] = await self.fleet.bounded(self.fleet.source.counts.remote(),
                                                     "prompt-source.counts")
            out["failures"] = await self.fleet.bounded(self.fleet.source.failures.remote(),
                                                       "prompt-source.failures")
        except Exception as exc:  # the prompt source itself may be what died
            out["ledger"] = f"unavailable: {type(exc).__name__}: {exc}"
        return out

    def failure_summary(self) -> dict | None:
        return getattr(self, "partial", None)

    def progress(self) -> dict:
        if self.controller is None:
            return {"phase": "starting"}
        p = dataclasses.asdict(self.controller.progress)
        p["max_steps"] = self.cfg.run.max_steps
        return p

    def request_stop(self) -> None:
        """Graceful stop (`ray job stop`, Ctrl-C): finish the current collection, drain, eval,
        summary."""
        self._stop_requested = True
        if self.controller is not None:
            self.controller.stop_requested = True

    async def scale(self, engines: int, placement_timeout_s: float | None = None) -> dict:
        """`rl-async scale`: grow or shrink the running fleet to `engines` engines
        (actors/fleet_scale.py); joins finish in the background."""
        if self.fleet is None or self.controller is None:
            raise RuntimeError(f"run {self.cfg.run.name!r} is still starting; scale it once "
                               f"it trains (`rl-async scale` again in a moment)")
        kwargs = {} if placement_timeout_s is None else {"placement_timeout_s":
                                                          placement_timeout_s}
        return await self.fleet.scale(engines, **kwargs)

    def history(self) -> list:
        return list(self.memory.rows)
