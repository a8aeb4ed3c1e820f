"""The synthetic trainer: `train.backend = "synthetic"`, the trainer side of dry runs.

It spends `TrainerTiming.collection_seconds(samples)` per collection (the whole trainer
group's time; each data-parallel rank gets its shard and waits the group's time), returns the
usual `train/*` metric keys, with the ones that depend only on the data (response tokens,
stale-token fraction) computed from it and the model-dependent ones neutral, and publishes a
payload of `publish_bytes` in buckets of `bucket_bytes`. No bytes move: a bucket's broadcast
takes `TransferTiming.bucket_seconds(bytes)` on each side (see rl_async.engine.synthetic).
"""

from __future__ import annotations

from rl_async.engine.synthetic import payload_checksum
from rl_async.engine.timing import TrainerTiming, TransferTiming, bucket_sizes
from rl_async.base.types import Group

NEUTRAL_METRICS = {"train/loss": 0.0, "train/ppo_clip_fraction": 0.0,
                   "train/tis_clip_fraction": 0.0, "train/tis_ess_ratio": 1.0,
                   "train/ratio_p99": 1.0, "train/ratio_max": 1.0,
                   "train/logprob_mismatch": 0.0, "train/logprob_kl": 0.0,
                   "train/entropy": 0.0, "train/grad_norm": 0.0, "train/lr": 0.0}


class SyntheticTrainer:
    def __init__(self, timing: TrainerTiming, transfer: TransferTiming, publish_bytes: int,
                 optimizer_steps_per_collection: int, data_parallel_size: int = 1):
        self.timing, self.transfer = timing, transfer
        self.publish_bytes = publish_bytes
        self.steps_per_collection = optimizer_steps_per_collection
        self.dp = data_parallel_size
        self.step = 0

    def collection_seconds(self, shard: list[Group]) -> float:
        """Time of the whole collection, from this rank's shard (all shards are equal)."""
        return self.timing.collection_seconds(sum(g.size for g in shard) * self.dp)

    def metrics(self, shard: list[Group], policy_version: int, seconds: float
                ) -> dict[str, float]:
        self.step += self.steps_per_collection
        versions = [v for g in shard for s in g.samples for v in s.token_versions]
        stale = sum(1 for v in versions if v < policy_version)
        return {**NEUTRAL_METRICS,
                "train/optimizer_steps": float(self.steps_per_collection),
                "train/response_tokens": float(sum(g.response_tokens for g in shard) * self.dp),
                "train/stale_token_fraction": stale / len(versions) if versions else 0.0,
                "train/step": float(self.step),
                "train/anchor_scoring_seconds": 0.0,
                "train/collection_seconds": seconds}

    def publication_metas(self, bucket_bytes: int) -> list[tuple]:
        """(names, dtypes, shapes, bytes) per bucket, as the real trainer's snapshot returns."""
        return [([f"synthetic.bucket{i}"], ["uint8"], [[n]], n)
                for i, n in enumerate(bucket_sizes(self.publish_bytes, bucket_bytes))]

    def checksum(self, bucket_bytes: int) -> str:
        metas = self.publication_metas(bucket_bytes)
        return payload_checksum([n for m in metas for n in m[0]], sum(m[3] for m in metas))
