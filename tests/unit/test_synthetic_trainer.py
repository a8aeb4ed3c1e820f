"""The synthetic trainer (pure core) and the controller's orchestration metrics."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.loop.progress import orchestration_metrics
from rl_async.engine.synthetic import SyntheticEngine, SyntheticEngineConfig
from rl_async.engine.timing import TrainerTiming, TransferTiming
from rl_async.train.synthetic import SyntheticTrainer
from rl_async.base.types import Group, Sample


def group(versions: list[int]) -> Group:
    return Group("g", [Sample("p", response_ids=[1] * len(versions), token_versions=versions)])


def test_collection_time_metrics_and_publication_payload():
    t = SyntheticTrainer(TrainerTiming(0.5), TransferTiming(), publish_bytes=10,
                         optimizer_steps_per_collection=2, data_parallel_size=4)
    shard = [group([0, 1, 2]), group([2, 2])]
    assert t.collection_seconds(shard) == pytest.approx(0.5 * 2 * 4)  # whole group's time
    m = t.metrics(shard, policy_version=2, seconds=4.0)
    assert m["train/stale_token_fraction"] == pytest.approx(2 / 5)
    assert m["train/step"] == 2 and m["train/optimizer_steps"] == 2
    assert m["train/response_tokens"] == 5 * 4
    assert {"train/loss", "train/tis_ess_ratio", "train/grad_norm"} <= set(m)
    metas = t.publication_metas(bucket_bytes=4)
    assert [meta[3] for meta in metas] == [4, 4, 2]


def test_engine_holds_the_synthetic_trainers_weights_after_a_publication():
    t = SyntheticTrainer(TrainerTiming(), TransferTiming(), 10, 1)

    async def main():
        e = SyntheticEngine(SyntheticEngineConfig(time_scale=0.0))
        await e.init_weights_update_group("h", 0, 1, 2, "pub", "gloo")
        metas = t.publication_metas(4)
        for i, (names, dtypes, shapes, _) in enumerate(metas):
            await e.update_weights_from_distributed(names, dtypes, shapes, "pub",
                                                    3 if i == len(metas) - 1 else None)
        return await e.weights_checksum(), await e.get_weight_version()

    checksum, version = asyncio.run(main())
    assert checksum == t.checksum(4) and version == 3


def test_orchestration_metrics_are_the_loops_own_time():
    m = orchestration_metrics(step_s=10.0, wait_s=6.0, train_s=2.0, publish_s=1.0, updates=2)
    assert m["perf/orchestration_seconds_per_step"] == pytest.approx(0.5)
    assert m["perf/orchestration_fraction"] == pytest.approx(0.1)
    assert m["perf/step_seconds"] == pytest.approx(5.0)
