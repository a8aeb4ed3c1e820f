"""The run summary the controller returns at the end (the driver prints and saves it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rl_async.base import clock

if TYPE_CHECKING:
    from rl_async.loop.controller import Controller


async def run_summary(ctl: Controller) -> dict[str, Any]:
    p = ctl.progress
    wall = clock.now() - ctl.started
    return {
        "run": {"name": ctl.cfg.run.name, "seed": ctl.cfg.run.seed,
                "mode": "async" if ctl.cfg.fully_async else "sync",
                "max_weight_staleness": ctl.plan.max_weight_staleness},
        "steps": p.step, "policy_version": ctl.version, "wall_seconds": wall,
        "eval": {"initial_reward": p.initial_eval, "final_reward": p.final_eval,
                 **{k: v for k, v in p.eval_last.items() if k != "reward"},
                 "initial": p.eval_first, "curve": p.eval_curve},
        "ledger": await ctl.fleet.ledger(),
        "faults": {**await ctl.fleet.faults(), "nonfinite_updates": p.nonfinite_updates},
        "rollout": {**await ctl.fleet.rollout(), "length_ks": p.length_ks},
        "publication": ctl.publisher.summary(),
        "provenance": ctl.provenance.summary(),
        "export_dir": (f"{ctl.checkpoint_dir}/hf" if ctl.checkpoint_dir else None),
        "staleness": {"max_delivered": p.max_staleness,
                      "mean_delivered": p.staleness_sum / max(1, p.staleness_groups),
                      "max_weight_staleness": ctl.plan.max_weight_staleness,
                      **ctl.staleness.to_dict(), "bound": ctl.plan.staleness_bound},
        "throughput": {"useful_tokens_per_s": p.useful_tokens / max(wall, 1e-9),
                       "trained_samples": p.trained_samples,
                       "trainer_wait_fraction": p.trainer_wait_seconds / max(wall, 1e-9)},
        "corrections": ctl.offpolicy.to_dict(),
        "routing": ctl.routing.to_dict(),
        "health": ctl.health.to_dict() if ctl.health else {"enabled": False},
        "threads": ctl.threads.summary() if ctl.threads is not None else None,
        "calibration": ctl.calibration.to_dict(
            wall, ctl.plan.engines, ctl.plan.max_running_requests,
            ctl.cfg.rollout.max_response_len, ctl.plan.producer_samples),
    }
