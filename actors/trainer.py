"""Trainer worker actor: one data-parallel rank of the trainer group.

Rank 0 is also the publisher: it joins the weight-publication collective group with every
engine and broadcasts the flattened buckets (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import os
import socket

import ray
import torch

from rl_async.state import collective
from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.state.models import resolve_dtype
from rl_async.state.hf_export import export_hf
from rl_async.base.types import Group
from rl_async.state.weights import (bucket_named_tensors, dtype_name, flatten_bucket,
                              weights_checksum)

PUBLICATION_GROUP = "rl_async_publication"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_megatron_trainer(cfg: RunConfig, plan: CapacityPlan):
    """megatron-core trainer: each rank loads its TP/PP slices of the HF weights (a local
    safetensors checkpoint, read lazily; or a config-built random model) into a sharded
    GPTModel; torch.distributed must be initialised."""
    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    hf_config, weights = hf_weights_from_run(cfg)
    try:
        return MegatronTrainer(hf_config, weights,
                               trainer_config_from_run(cfg, plan.global_batch_size))
    finally:
        if hasattr(weights, "close"):
            weights.close()


def build_trainer(cfg: RunConfig, plan: CapacityPlan, rank: int, world: int):
    t = cfg.train
    if t.backend == "megatron":
        return build_megatron_trainer(cfg, plan)
    from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

    return TorchTrainer(TorchTrainerConfig(
        hf_config=cfg.model.hf_config, model_path=cfg.model.path, seed=cfg.model.init_seed,
        lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule, total_steps=cfg.run.max_steps, min_lr_ratio=t.min_lr_ratio,
        global_batch_size=plan.global_batch_size, micro_batch_size=t.micro_batch_size,
        eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high, tis_clip=t.tis_clip,
        tis_clip_low=t.tis_clip_low, use_tis=t.use_tis,
        use_rollout_logprobs=t.use_rollout_logprobs, advantage_estimator=t.advantage,
        temperature=cfg.rollout.temperature,
        device="cuda" if cfg.cluster.trainer_gpus else "cpu"), rank, world)


@ray.remote
class TrainerWorker:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, rank: int, world: int):
        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        if not cfg.cluster.trainer_gpus:
            torch.set_num_threads(max(1, int(cfg.cluster.trainer_cpus)))
        self.trainer = None
        self._buckets: list = []
        self._flat: list[torch.Tensor] = []  # publication buffers, reused

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        megatron = self.cfg.train.backend == "megatron"
        if self.world > 1 or megatron:
            from rl_async.train.distributed import init_distributed

            if self.cfg.cluster.trainer_gpus:
                torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves one GPU visible
            init_distributed(master_addr, master_port, self.rank, self.world)
        self.trainer = build_trainer(self.cfg, self.plan, self.rank, self.world)
        return os.getpid()

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) in the data-parallel group: which shard of a collection this rank
        trains on. TP/PP ranks of one megatron replica share a shard."""
        if self.cfg.train.backend == "megatron":
            from megatron.core import parallel_state

            return (parallel_state.get_data_parallel_rank(),
                    parallel_state.get_data_parallel_world_size())
        return self.rank, self.world

    def reports_metrics(self) -> bool:
        """Whether this rank's train metrics are the run's (megatron: last pipeline stage,
        DP rank 0, TP rank 0, the only one with real log-prob metrics; torch DDP: rank 0)."""
        if self.cfg.train.backend == "megatron":
            return self.trainer.reports_metrics
        return self.rank == 0

    def train(self, groups: list[Group], version: int) -> dict[str, float]:
        return self.trainer.train_collection(groups, version)

    # ---- publication (rank 0) --------------------------------------------------------------
    def init_publication_group(self, master_addr: str, master_port: int, world_size: int,
                               backend: str, timeout_s: float | None = None,
                               group_name: str = PUBLICATION_GROUP) -> None:
        """Join (or, after an engine restart, re-form under a new name) the publication
        group as its source, rank 0."""
        collective.init_custom_process_group(backend, f"tcp://{master_addr}:{master_port}",
                                             world_size, 0, group_name, timeout_s)
        self._pub_group = group_name

    def prepare_publication(self, bucket_bytes: int, flat: bool) -> list[tuple]:
        """Snapshot the weights into buckets; returns each bucket's (names, dtypes, shapes,
        bytes). `flat`: one flattened tensor per bucket (embedded engines); otherwise one
        broadcast per tensor, in order (SGLang's per-tensor receive loop)."""
        # megatron gathers TP/PP shards collectively: every rank calls this, rank 0 sends.
        named = self.trainer.named_tensors_for_publication()
        self._buckets = []
        if self.rank != 0:
            return []
        # fp32 master weights train; engines serve model.dtype, so that is what travels
        # (bf16 halves the bytes) and what the engines' checksum is compared with.
        dtype = resolve_dtype(self.cfg.model.dtype)
        live = {n: t.data_ptr() for n, t in named}
        named = [(n, t.to(dtype)) for n, t in named]  # a copy only where the dtype differs
        self._snapshot_checksum = (weights_checksum(named)
                                   if self.cfg.publication.verify_checksum else None)
        metas = []
        for i, bucket in enumerate(bucket_named_tensors(named, bucket_bytes)):
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if flat:  # the snapshot is this one copy, into a buffer kept across publications
                if i >= len(self._flat) or self._flat[i].numel() != nbytes:
                    self._flat[i:i + 1] = [torch.empty(nbytes, dtype=torch.uint8,
                                                       device=bucket[0][1].device)]
                flat_t, names, dtypes, shapes = flatten_bucket(bucket, out=self._flat[i])
                self._buckets.append(flat_t)
            else:
                names, dtypes, shapes = ([n for n, _ in bucket],
                                         [dtype_name(t.dtype) for _, t in bucket],
                                         [list(t.shape) for _, t in bucket])
                # the snapshot: copy what is still a view of the live weights
                self._buckets.append([t.clone() if t.data_ptr() == live[n] else t
                                      for n, t in bucket])
            metas.append((names, dtypes, shapes, nbytes))
        return metas

    def broadcast_bucket(self, index: int) -> None:
        group = collective.get_group(getattr(self, "_pub_group", PUBLICATION_GROUP))
        payload = self._buckets[index]
        for tensor in payload if isinstance(payload, list) else [payload]:
            torch.distributed.broadcast(tensor, group=group, group_src=0)

    # ---- checkpoints and checks ------------------------------------------------------------
    def save_checkpoint(self, directory: str, extra: dict) -> str | None:
        return self.trainer.save_checkpoint(directory, extra)

    def load_checkpoint(self, directory: str) -> dict:
        """Resume: model, optimizer, step, policy version and RNG states (every rank)."""
        return self.trainer.load_checkpoint(directory)

    def export_hf(self, directory: str) -> str | None:
        """Write the policy as a Hugging Face directory (rl_async.state.hf_export). Every megatron
        rank takes part in gathering the shards; rank 0 writes."""
        named = self.trainer.named_tensors_for_publication()
        if self.rank != 0:
            return None
        m = self.cfg.model
        return str(export_hf(named, directory, hf_config=m.hf_config, path=m.path,
                             dtype=m.dtype))

    def weights_checksum(self) -> str:
        """The live weights, in the engines' dtype."""
        dtype = resolve_dtype(self.cfg.model.dtype)
        return weights_checksum((n, t.to(dtype))
                                for n, t in self.trainer.named_tensors_for_publication())

    def snapshot_checksum(self) -> str:
        """The last publication snapshot's checksum (publication.verify_checksum): what the
        engines must hold, even when training has moved on while the snapshot was sent."""
        if getattr(self, "_snapshot_checksum", None) is None:
            raise RuntimeError("snapshot_checksum: no snapshot taken with "
                               "publication.verify_checksum = true")
        return self._snapshot_checksum

    def named_weights(self) -> list:
        return [(n, t.detach().cpu().clone()) for n, t in self.trainer.named_tensors_for_publication()]
