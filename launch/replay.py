"""`rl-async replay RUN_DIR`: re-train a run from its recorded collections and check that the
weights come out bit-identical.

The run must have been made with `run.record_rollouts = true`. Replay builds a fresh trainer
group with the run's own config and layout (same ranks, same data-parallel shards), feeds it
every recorded collection in trained.jsonl order at the policy version it was trained at and
with the torch threads it was trained with (the thread balancer, or a resume with another
cluster.trainer_cpus, changes them mid-run), exports the policy and compares it, byte for
byte, with the export of the run's latest checkpoint. No engine, producer or reward runs: the recorded groups ARE the data.
This is what makes an async run at lag >= 1 (where timing decided which version sampled each
group) reproducible after the fact, and it tells a trainer-side nondeterminism apart from a
generation-side one.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any


def replay(run_dir: str, out: str | None = None) -> dict[str, Any]:
    from launch.run import _init_ray
    from rl_async.state import checkpoints as ckpts
    from rl_async.state import rollouts
    from rl_async.plan.checks import validate
    from rl_async.plan.config import RunConfig

    run = Path(run_dir)
    checkpoint = ckpts.find_checkpoint("", "", run)  # the latest complete one in RUN_DIR
    meta = ckpts.load_meta(checkpoint)
    cfg = RunConfig.model_validate(meta["config"])
    entries = [e for e in rollouts.version_assignment(run) if e["step"] <= meta["step"]]
    if not entries or entries[-1]["step"] != meta["step"]:
        raise rollouts.ReplayError(f"{run}/trained.jsonl does not reach the checkpoint's step "
                                   f"{meta['step']}; nothing to compare against")
    for e in entries:  # every recording exists before any actor starts
        rollouts.require_recorded(run, e["step"])
    started = _init_ray(cfg)
    try:
        return asyncio.run(_replay(cfg, validate(cfg).plan, run, entries, checkpoint, out))
    finally:
        if started:
            import ray

            ray.shutdown()


async def _replay(cfg, plan, run: Path, entries: list[dict], checkpoint: Path,
                  out: str | None) -> dict[str, Any]:
    from actors.fleet import RayFleet
    from rl_async.state import rollouts
    out_dir = Path(out or tempfile.mkdtemp(prefix="rl-async-replay-"))
    fleet = RayFleet(cfg, plan, run_dir=str(out_dir))
    fleet.prefix = f"{cfg.run.name}-replay"
    try:
        fleet.place_trainers()
        await fleet.setup_trainers()
        threads = []  # what each collection was replayed with, as the trainer reports it
        for e in entries:
            version, groups = rollouts.read_collection(run, e["step"])
            if e.get("trainer_threads"):  # recorded by runs on CPU trainers
                await fleet.set_trainer_threads(int(e["trainer_threads"]))
            metrics = await fleet.train(groups, version)
            threads.append(int(metrics["trainer/threads"]) if "trainer/threads" in metrics
                           else None)
        export = await fleet.export(str(out_dir / "hf"))
    finally:
        await fleet.shutdown()
    result = rollouts.compare_exports(export, checkpoint / "hf")
    return {"run_dir": str(run), "steps": entries[-1]["step"], "collections": len(entries),
            "trainer_threads": threads, "replay_export": export,
            "run_export": str(checkpoint / "hf"), **result}
