"""Synthetic trainer worker: the TrainerWorker interface over rl_async.train.synthetic.

Used with `train.backend = "synthetic"` (dry runs, orchestration benchmarks). No torch, no
process group: ranks only wait the simulated time, and rank 0 "broadcasts" each bucket in the
time the transfer would take, while the synthetic engines receive it in the same time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray

from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.engine.timing import TrainerTiming, TransferTiming
from rl_async.train.synthetic import SyntheticTrainer
from rl_async.base.types import Group


def transfer_timing(cfg: RunConfig) -> TransferTiming:
    s = cfg.synthetic
    return TransferTiming(s.weight_sync_bytes_per_s, s.bucket_latency_s, s.group_init_s)


@ray.remote
class SyntheticTrainerWorker:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        t = cfg.train
        # A megatron-shaped run keeps its data-parallel layout: TP x PP ranks share a shard.
        self.model_parallel = t.tensor_parallel * t.pipeline_parallel \
            if world % (t.tensor_parallel * t.pipeline_parallel) == 0 else 1
        self.scale = cfg.synthetic.time_scale
        self.trainer = SyntheticTrainer(
            TrainerTiming(cfg.synthetic.train_seconds_per_sample), transfer_timing(cfg),
            cfg.synthetic.publish_bytes, plan.optimizer_steps_per_collection,
            world // self.model_parallel)
        self._metas: list[tuple] = []
        self._channels: set[str] = set()

    def address(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    def setup(self, master_addr: str, master_port: int) -> int:
        return os.getpid()

    def data_parallel_rank(self) -> tuple[int, int]:
        return self.rank // self.model_parallel, self.world // self.model_parallel

    def train(self, groups: list[Group], version: int) -> dict[str, float]:
        seconds = self.trainer.collection_seconds(groups)
        time.sleep(seconds * self.scale)
        return self.trainer.metrics(groups, version, seconds * self.scale)

    def reports_metrics(self) -> bool:
        return self.rank == 0

    # ---- publication: the sender's interface (rl_async/state/sender.py), in simulated time
    def open_channel(self, name: str, timeout_s: float) -> tuple[str, int]:
        return "127.0.0.1", 0

    def join_channels(self, names: list[str], world_size: int) -> dict[str, str]:
        time.sleep(self.trainer.transfer.group_init_s * self.scale)  # concurrently, like the sender's
        self._channels.update(names)
        return {}

    def close_channels(self, names: list[str]) -> None:
        self._channels.difference_update(names)

    def channels(self) -> list[str]:
        return sorted(self._channels)

    def prepare_publication(self, bucket_bytes: int, flat: bool, checks: bool = False):
        self._metas = self.trainer.publication_metas(bucket_bytes)
        metas = self._metas if self.rank == 0 else []
        return (metas, [], "") if checks else metas  # no bytes: nothing to fingerprint

    def send_publication(self, names: list[str], which: str, timeout_s: float,
                         total_s: float | None = None) -> tuple[int, dict[str, str]]:
        """Every bucket to every channel, concurrently: as long as one channel's transfer."""
        unknown = [n for n in names if n not in self._channels]
        if unknown:
            raise KeyError(f"channels {unknown} are not joined (joined: {self.channels()})")
        for meta in self._metas:
            time.sleep(self.trainer.transfer.bucket_seconds(meta[3]) * self.scale)
        return sum(m[3] for m in self._metas), {}

    def commit_publication(self, version: int | None = None) -> None:
        pass

    def save_checkpoint(self, directory: str, extra: dict) -> str | None:
        """Rank 0 writes what a checkpoint would carry besides the weights (ledger, version)."""
        if self.rank != 0:
            return None
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "synthetic_trainer.json").write_text(json.dumps(
            {"step": self.trainer.step, "extra": extra}, default=str))
        return str(path)

    def load_checkpoint(self, directory: str) -> dict:
        state = json.loads((Path(directory) / "synthetic_trainer.json").read_text())
        self.trainer.step = int(state["step"])
        return state["extra"]

    def export_hf(self, directory: str) -> str | None:
        """A dry run has no weights: the export is a note saying so."""
        if self.rank != 0:
            return None
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "SYNTHETIC.txt").write_text(
            "dry run (train.backend = synthetic): no model weights to export\n")
        return directory

    def snapshot_checksum(self, which: str = "published") -> str:
        return self.weights_checksum()

    def weights_checksum(self) -> str:
        return self.trainer.checksum(self.cfg.publication.bucket_bytes)
