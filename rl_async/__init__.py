"""rl-async's pure core: never imports Ray (the actors in `actors/` wrap it).

Rooms, ground floor first; a room imports only rooms on lower floors (tests/unit/
test_layout.py keeps the order):

    base      types, clock, asyncio helpers, the process allocator setting
    algo      loss, advantages, tasks, rewards, judging, evaluation, seeding
    observe   metrics, queue metrics, calibration, compare
    plan      config, loading, capacity plan, checks, dry run
    state     models, weights codec, collective groups, checkpoints, exports, rollouts
    engine    engine interface, embedded torch engine, SGLang client, synthetic engine
    train     torch (DDP), megatron-core and synthetic trainers
    loop      controller, producer, buffer, ledger, publication, faults
    sim       the simulator

The names users and acceptance checks import (SPEC §11) are exported here, lazily, so that
importing a light module (the config, for the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompletedBuffer": "rl_async.loop.buffer",
    "Group": "rl_async.base.types",
    "Sample": "rl_async.base.types",
    "policy_loss": "rl_async.algo.loss",
    "PromptLedger": "rl_async.loop.ledger",
    "RunConfig": "rl_async.plan.config",
    "load_config": "rl_async.plan.load",
    "plan_capacity": "rl_async.plan.capacity",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_async' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
