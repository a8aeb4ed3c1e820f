"""Trainer worker actor: one data-parallel rank of the trainer group.

Rank 0 is also the publisher: one channel (process group) per engine incarnation, over which
it broadcasts the snapshot's buckets (gloo on CPU, NCCL on GPU; rl_async/state/sender.py).
"""

from __future__ import annotations

import os
import time

import ray
import torch

from rl_async.plan.capacity import CapacityPlan
from rl_async.plan.config import RunConfig
from rl_async.base.allocator import apply_for, rss_bytes
from rl_async.loop.threads import initial_split
from rl_async.state.models import resolve_dtype
from rl_async.state.hf_export import export_hf
from rl_async.base.types import Group
from rl_async.state.sender import PublicationSender
from rl_async.train.determinism import configure as configure_determinism
from rl_async.state.weights import weights_checksum

def build_megatron_trainer(cfg: RunConfig, plan: CapacityPlan):
    """megatron-core trainer: each rank loads its TP/PP slices of the HF weights (a local
    safetensors checkpoint, read lazily; or a config-built random model) into a sharded
    GPTModel; torch.distributed must be initialised."""
    from rl_async.plan.moe import replay_for
    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    hf_config, weights = hf_weights_from_run(cfg)
    try:
        return MegatronTrainer(hf_config, weights, trainer_config_from_run(
            cfg, plan.global_batch_size, replay_for(cfg, cfg.train.routing_replay)))
    finally:
        if hasattr(weights, "close"):
            weights.close()


def build_trainer(cfg: RunConfig, plan: CapacityPlan, rank: int, world: int):
    configure_determinism(cfg.run.deterministic, cfg.model.init_seed)
    t = cfg.train
    if t.backend == "megatron":
        return build_megatron_trainer(cfg, plan)
    from rl_async.algo.corrections import corrections_from
    from rl_async.plan.moe import replay_for
    from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

    return TorchTrainer(TorchTrainerConfig(
        hf_config=cfg.model.hf_config, model_path=cfg.model.path, seed=cfg.model.init_seed,
        lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule, total_steps=t.lr_schedule_steps or cfg.run.max_steps, min_lr_ratio=t.min_lr_ratio,
        global_batch_size=plan.global_batch_size, micro_batch_size=t.micro_batch_size,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch, share_prompts=t.share_prompts,
        max_nonfinite_updates=t.max_nonfinite_updates,
        eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high, tis_clip=t.tis_clip,
        tis_clip_low=t.tis_clip_low, use_tis=t.use_tis, corrections=corrections_from(t),
        use_rollout_logprobs=t.use_rollout_logprobs, advantage_estimator=t.advantage,
        temperature=cfg.rollout.temperature,
        routing_replay=replay_for(cfg, cfg.train.routing_replay),
        device="cuda" if cfg.cluster.trainer_gpus else "cpu"), rank, world)


@ray.remote
class TrainerWorker:
    def __init__(self, cfg: RunConfig, plan: CapacityPlan, rank: int, world: int):
        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        if not cfg.cluster.trainer_gpus:
            torch.set_num_threads(initial_split(cfg).trainer)  # the plan's, one source
        self.allocator = apply_for(cfg, "trainer")
        self._threads = torch.get_num_threads()
        self.trainer = None
        self._store = None  # rank 0: the trainers' rendezvous store (address())
        self._sender: PublicationSender | None = None  # rank 0, on first use
        self._audit = None  # rank 0, run.audit_fraction > 0, on first use

    def address(self) -> tuple[str, int]:
        """Rank 0: host the trainers' rendezvous store (a port bound once and kept; the
        other ranks join it in setup)."""
        from rl_async.train.distributed import host_store

        self._store = host_store()
        return ray.util.get_node_ip_address(), self._store.port

    def setup(self, master_addr: str, master_port: int) -> int:
        megatron = self.cfg.train.backend == "megatron"
        if self.world > 1 or megatron:
            from rl_async.train.distributed import init_distributed, trainer_backend

            if self.cfg.cluster.trainer_gpus:
                torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves one GPU visible
            init_distributed(master_addr, master_port, self.rank, self.world,
                             trainer_backend(self.cfg.cluster.trainer_gpus),
                             store=self._store if self.rank == 0 else None)
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

    def set_threads(self, threads: int) -> None:
        """torch threads from the next collection on (the controller's thread balancer)."""
        self._threads = threads

    def train(self, groups: list[Group], version: int) -> dict[str, float]:
        if not self.cfg.cluster.trainer_gpus and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)  # per calling thread: set where it trains
        metrics = self.trainer.train_collection(groups, version)
        if self.rank == 0 and self.cfg.run.audit_fraction:
            metrics.update(self.audit.audit(groups))  # provenance/* (summary `provenance`)
        # this process's CPU, every thread (publication's sends too): the thread balancer's
        return {**metrics, "trainer/cpu_seconds": time.process_time(),
                "trainer/threads": float(torch.get_num_threads()),
                "trainer/memory_reused": float(self.allocator == "on"),
                "trainer/rss_bytes": rss_bytes()}

    def _hf_tensors(self):
        """The policy's HF-named tensors on rank 0 (an iterable); None elsewhere. megatron
        gathers TP/PP shards collectively, so its other ranks take part here."""
        named = self.trainer.named_tensors_for_publication()
        if self.rank == 0:
            return named
        for _ in named:  # megatron: this rank's gathers and sends happen as it is consumed
            pass
        return None

    # ---- publication (rank 0; rl_async/state/sender.py) -------------------------------------
    @property
    def sender(self) -> PublicationSender:
        if self._sender is None:
            gpu = bool(self.cfg.cluster.trainer_gpus)
            self._sender = PublicationSender("nccl" if gpu else "gloo", "cuda" if gpu else "cpu")
        return self._sender

    def open_channel(self, name: str, timeout_s: float) -> tuple[str, int]:
        """Host channel `name`'s rendezvous; the engine joins at the returned address."""
        return ray.util.get_node_ip_address(), self.sender.open_channel(name, timeout_s)

    def join_channels(self, names: list[str], world_size: int) -> dict[str, str]:
        """Join the channels at once, each on its own thread (one actor thread waits for all:
        a CPU trainer's other thread may be training); {name: error} for those that failed."""
        return self.sender.join_channels(names, world_size)

    def close_channels(self, names: list[str]) -> None:
        for name in names:
            self.sender.close_channel(name)

    def channels(self) -> list[str]:
        return self.sender.channels() if self.rank == 0 else []

    def prepare_publication(self, bucket_bytes: int, flat: bool, checks: bool = False):
        """Stage a snapshot of the weights; returns each bucket's (names, dtypes, shapes,
        bytes). `flat`: one flattened tensor per bucket (embedded engines); otherwise one
        broadcast per tensor, in order (SGLang's per-tensor receive loop). `checks`: return
        (metas, fingerprints, digest), what a staging engine checks before it may commit
        (snapshot_fingerprints), in the same call."""
        named = self._hf_tensors()
        if named is None:
            return ([], [], "") if checks else []
        # fp32 master weights train; engines serve model.dtype, so that is what travels
        # (bf16 halves the bytes) and what the engines' checksum is compared with.
        metas = self.sender.stage(named, resolve_dtype(self.cfg.model.dtype), bucket_bytes,
                                  flat, checksum=self.cfg.publication.verify_checksum)
        return (metas, *self.snapshot_fingerprints("staged")) if checks else metas

    def send_publication(self, names: list[str], which: str, timeout_s: float,
                         total_s: float | None = None, chunk_bytes: int = 0
                         ) -> tuple[int, dict[str, str]]:
        """The staged (or published) snapshot to each named channel, each at its own pace
        (in pieces of `chunk_bytes` to the head of a relay); failed channels are reported
        by name and destroyed (a trainer-side failure raises)."""
        return self.sender.send(names, which, timeout_s, total_s, chunk_bytes)

    def snapshot_fingerprints(self, which: str = "staged") -> tuple[list[str], str]:
        """A snapshot's bucket fingerprints and model digest: what a staging engine checks
        before it may commit (rl_async/engine/embedded_weights.py)."""
        snap = self.sender.snapshot(which)
        return snap.fingerprints, snap.digest

    def publication_bytes_sent(self) -> int:
        """Bytes rank 0 has sent on publication channels so far (every engine counted)."""
        return self.sender.bytes_sent

    def commit_publication(self, version: int | None = None) -> None:
        """The staged snapshot becomes the published one (catch-ups send it); the audit
        keeps a copy as `version`'s weights."""
        self.sender.retain_published = bool(self.cfg.run.audit_fraction)
        self.sender.commit()
        if self.cfg.run.audit_fraction and version is not None:
            snap = self.sender.published
            self.sender.recycle(self.audit.keep(version, snap.buckets, snap.metas))

    @property
    def audit(self):
        """Rank 0's provenance audit (run.audit_fraction; rl_async/train/audit.py)."""
        if self._audit is None:
            from rl_async.train.audit import ProvenanceAudit, audit_tolerance

            cfg = self.cfg
            self._audit = ProvenanceAudit(
                cfg.model.hf_config, cfg.model.dtype, cfg.run.audit_fraction,
                audit_tolerance(cfg), self.plan.max_weight_staleness + 2,
                cfg.rollout.temperature, cfg.run.seed,
                None if cfg.cluster.inference_gpus else cfg.engine.torch_threads,
                path=cfg.model.path, device="cuda" if cfg.cluster.trainer_gpus else "cpu")
        return self._audit

    def snapshot_checksum(self, which: str = "published") -> str:
        """A snapshot's checksum (publication.verify_checksum): what the engines must hold,
        even when training has moved on while the snapshot was sent."""
        digest = self.sender.snapshot(which).checksum
        if digest is None:
            raise RuntimeError("snapshot_checksum: no snapshot taken with "
                               "publication.verify_checksum = true")
        return digest

    # ---- checkpoints and checks ------------------------------------------------------------
    def save_checkpoint(self, directory: str, extra: dict) -> str | None:
        return self.trainer.save_checkpoint(directory, extra)

    def load_checkpoint(self, directory: str) -> dict:
        """Resume: model, optimizer, step, policy version and RNG states (every rank)."""
        return self.trainer.load_checkpoint(directory)

    def export_hf(self, directory: str) -> str | None:
        """Write the policy as a Hugging Face directory (rl_async.state.hf_export). Every megatron
        rank takes part in gathering the shards; rank 0 writes."""
        named = self._hf_tensors()
        if named is None:
            return None
        m = self.cfg.model
        return str(export_hf(named, directory, hf_config=m.hf_config, path=m.path,
                             dtype=m.dtype))

    def weights_checksum(self) -> str:
        """The live weights, in the engines' dtype."""
        dtype = resolve_dtype(self.cfg.model.dtype)
        return weights_checksum((n, t.to(dtype))
                                for n, t in self.trainer.named_tensors_for_publication())

    def named_weights(self) -> list:
        return [(n, t.detach().cpu().clone()) for n, t in self.trainer.named_tensors_for_publication()]
