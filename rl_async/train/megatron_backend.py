"""megatron-core trainer backend: the SPEC §8 loss on a TP/PP/DP GPTModel (megatron-core 0.16.1).

One collection, on every rank (each data-parallel rank passes its own shard of groups; the
TP and PP ranks of one DP replica pass the same groups):

```
groups -> advantages -> items -> micro-batches
   -> score every token with the pre-update weights (anchor, forward only; skipped when
      use_rollout_logprobs: anchor = behaviour log-probs)
   -> per optimizer step of global_batch_size / DP local samples:
        lr = torch_trainer.lr_at(step)  (the same schedule as the torch backend)
        forward_backward_func (megatron schedule, PP-aware) -> DDP grad reduce
        -> get_megatron_optimizer step (clip, Adam; distributed optimizer by default)
   -> metrics (reduced over DP; computed on the last pipeline stage)
```

MoE models with routing replay (`train.routing_replay`): every forward step forces its
micro-batch's recorded experts (rl_async/train/megatron_replay.py); of the torch trainer's
routing metrics, the counts (replayed / unreplayed tokens, bytes) and the agreement are
reported, the log-prob mismatch (an extra forward) not yet.

Only the last pipeline stage computes log-probs, so only its ranks have real metrics (the
others return zeros): `reports_metrics` names the one rank (last stage, DP rank 0, TP rank
0) whose return value the fleet logs.

Same method names as the torch trainer: `train_collection`, `named_tensors_for_publication`,
`save_checkpoint`, `load_checkpoint`. Meant for GPUs: megatron-core's RNG tracker,
optimizer and schedules assume CUDA. The CPU tests run the whole path (non-distributed
optimizer) under the test-only shims in tests/unit/megatron_cpu_shims.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl_async.algo.advantages import DEFAULT_ESTIMATOR, group_advantages
from rl_async.algo.corrections import Corrections, corrections_from
from rl_async.algo.loss import (MAX_STATS, SUM_STATS, metrics_from_stats, policy_terms,
                                ratio_quantile, step_units)
from rl_async.train import megatron_checkpoint, megatron_export, megatron_replay
from rl_async.train import megatron_model as mm
from rl_async.train.guard import NonFiniteGuard
from rl_async.train.batching import PackedBatch, TrainItem, item_from_sample, micro_batches, pack
from rl_async.train.megatron_load import HFCheckpoint
from rl_async.train.routing import on_policy_rows
from rl_async.train.schedule import lr_at
from rl_async.base.types import Group

# Sums this backend adds to rl_async.algo.loss.SUM_STATS (the torch backend's names).
EXTRA_SUMS = ("versioned_tokens", "stale_tokens", "entropy_sum")


@dataclass
class MegatronTrainerConfig:
    parallel: mm.MegatronParallelConfig = field(default_factory=mm.MegatronParallelConfig)
    global_batch_size: int = 8          # samples per optimizer step, over all DP ranks
    micro_batch_size: int = 1           # samples per forward/backward
    max_tokens_per_microbatch: int | None = None  # a padded-token budget instead
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    temperature: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_tis: bool = True
    # train.policy_loss / train.is_mask and their thresholds (rl_async/algo/corrections.py)
    corrections: Corrections = field(default_factory=Corrections)
    use_rollout_logprobs: bool = False  # anchor = behaviour log-probs (no trainer scoring)
    advantage_estimator: str = DEFAULT_ESTIMATOR
    # The torch backend's schedule (torch_trainer.lr_at reads these four names).
    lr_schedule: str = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    compute_entropy: bool = True
    max_nonfinite_updates: int = 3  # skipped non-finite updates in a row before the run stops

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule = {self.lr_schedule!r}: use 'constant' or 'cosine'")
        if self.lr_schedule == "cosine" and self.total_steps < 1:
            raise ValueError("train.lr_schedule = 'cosine' needs total_steps >= 1 (run.max_steps)")


class MegatronTrainer:
    """One rank of a megatron-core trainer; torch.distributed must already be initialised."""

    def __init__(self, hf_config: Any, hf_weights: dict[str, Tensor] | HFCheckpoint,
                 cfg: MegatronTrainerConfig):
        """`hf_weights`: a full HF state dict (small / config-built models), or a lazy
        safetensors checkpoint from which each rank reads only its TP/PP slices."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg, self.hf_config = cfg, hf_config
        pcfg = cfg.parallel
        mm.initialize_parallel(pcfg)
        self.dp_size = pcfg.data_parallel_size(dist.get_world_size())
        if cfg.global_batch_size % (self.dp_size * cfg.micro_batch_size):
            raise ValueError(
                f"train.global_batch_size={cfg.global_batch_size} must be a multiple of "
                f"data_parallel_size × micro_batch_size = {self.dp_size * cfg.micro_batch_size}"
            )
        module = mm.build_gpt_model(hf_config, pcfg)
        if isinstance(hf_weights, HFCheckpoint):
            mm.load_hf_checkpoint(module, hf_weights, hf_config, pcfg)
        else:
            mm.load_hf_weights(module, hf_weights, hf_config, pcfg)
        # MoE, train.routing_replay: every scoring forward forces the engine's experts
        self.routing = megatron_replay.for_trainer(module, hf_config, pcfg)
        self._measure_version: int | None = None
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer
        )
        self.model = DistributedDataParallel(config=module.config, ddp_config=ddp_cfg, module=module)
        dtype = pcfg.dtype
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
            ),
            [self.model],
        )
        # The schedule reduces DP gradients and scales the loss only through these hooks
        # (megatron's own training loop sets them the same way).
        from megatron.core.distributed import finalize_model_grads

        tcfg = module.config
        tcfg.finalize_model_grads_func = finalize_model_grads
        tcfg.no_sync_func = self.model.no_sync
        tcfg.grad_scale_func = self.optimizer.scale_loss
        self.step = 0
        self.policy_version = 0
        self.guard = NonFiniteGuard(cfg.max_nonfinite_updates)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # ------------------------------------------------------------------ training

    @property
    def reports_metrics(self) -> bool:
        """True on the one rank whose metrics are the run's: the last pipeline stage (the
        only one that computes log-probs), data-parallel rank 0 (metrics are reduced over
        DP), tensor-parallel rank 0 (TP ranks agree)."""
        from megatron.core import parallel_state

        return (parallel_state.is_pipeline_last_stage()
                and parallel_state.get_data_parallel_rank() == 0
                and parallel_state.get_tensor_model_parallel_rank() == 0)

    def train_collection(self, groups: Sequence[Group], policy_version: int) -> dict[str, float]:
        """Anchor-score, then run optimizer steps over this rank's groups; returns `train/*`
        metrics (real on the last pipeline stage only: see `reports_metrics`)."""
        items = self._items(groups)
        local_step = self.cfg.global_batch_size // self.dp_size
        if not items or len(items) % local_step:
            raise ValueError(
                f"{len(items)} samples on this rank is not a positive multiple of "
                f"global_batch_size / data_parallel_size = {local_step}: size "
                f"rollout_batch_size × n_samples_per_prompt to whole optimizer steps"
            )
        if self.cfg.use_rollout_logprobs:
            for it in items:
                it.anchor_logprobs = list(it.behavior_logprobs)
        else:
            self.model.eval()
            self._score_anchors(items)
        self.model.train()
        per_step = []
        for s in range(0, len(items), local_step):
            # routing agreement: the first step's forwards run the pre-update weights
            self._measure_version = policy_version if not per_step else None
            per_step.append(self._optimizer_step(items[s:s + local_step], policy_version))
        self._measure_version = None
        out = {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
        out["train/response_tokens"] = sum(m["train/response_tokens"] for m in per_step)
        out["train/nonfinite_updates"] = sum(m["train/nonfinite_updates"] for m in per_step)
        out["train/optimizer_steps"] = float(len(per_step))
        out["train/step"] = float(self.step)
        out["train/lr"] = per_step[-1]["train/lr"]  # as the torch backend: the latest lr
        if self.routing is not None:
            from megatron.core import parallel_state

            out.update(megatron_replay.replay_counts(
                items, parallel_state.get_data_parallel_group()))
            out.update(megatron_replay.agreement(self.routing))
        self.policy_version = policy_version
        return out

    def _items(self, groups: Sequence[Group]) -> list[TrainItem]:
        advantages = group_advantages(groups, self.cfg.advantage_estimator)
        return [
            item_from_sample(s, adv, f"group {g.group_id!r} sample {i}")
            for g, advs in zip(groups, advantages)
            for i, (s, adv) in enumerate(zip(g.samples, advs))
        ]

    def _micro_batches(self, items: list[TrainItem]) -> list[PackedBatch]:
        routing = self.routing and (self.routing.moe_layers, self.routing.top_k)
        return [pack(mb, self.device, routing_layers=routing or None) for mb in micro_batches(
            items, self.cfg.micro_batch_size, self.cfg.max_tokens_per_microbatch)]

    def _run_schedule(self, batches: list[PackedBatch], loss_func: Any, forward_only: bool) -> list[Any]:
        """megatron's forward/backward schedule (pipelined when PP > 1) over `batches`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[Tensor, Any]:
            batch = next(data_iterator)
            if self.routing is not None:
                measure = (None if self._measure_version is None else
                           on_policy_rows(batch, self._measure_version))
                self.routing.force(batch.routing_BLMK, measure)
            return mm.forward_logits(model, batch.input_ids_BL), partial(loss_func, batch)

        # Shapes vary per micro-batch (variable_seq_lengths: PP stages exchange them).
        seq_len = max(b.input_ids_BL.shape[1] for b in batches)
        rows = max(b.input_ids_BL.shape[0] for b in batches)
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[self.model],
                num_microbatches=len(batches), seq_length=seq_len,
                micro_batch_size=rows, forward_only=forward_only,
            )
        finally:
            if self.routing is not None:
                self.routing.force(None)

    def _logprobs(self, batch: PackedBatch, output: Tensor,
                  with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        return mm.token_logprobs(output, batch.targets_BT, batch.start, self.cfg.temperature,
                                 self.hf_config.vocab_size, with_entropy)

    @torch.no_grad()
    def _score_anchors(self, items: list[TrainItem]) -> None:
        """Trainer scoring: pre-update log-probs of every response token (the PPO anchor)."""
        batches = self._micro_batches(items)

        def loss_func(batch: PackedBatch, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            lp, _ = self._logprobs(batch, output)
            return lp.sum() * 0, {"anchor": lp.detach().float().cpu()}

        results = self._run_schedule(batches, loss_func, forward_only=True)
        # Only the last pipeline stage computes log-probs, and only it needs the anchors.
        first = 0
        for batch, res in zip(batches, results):
            for row, (lo, hi) in enumerate(batch.spans):
                items[first + row].anchor_logprobs = res["anchor"][row, lo:hi].tolist()
            first += len(batch.spans)

    def _optimizer_step(self, items: list[TrainItem], policy_version: int) -> dict[str, float]:
        from megatron.core import parallel_state

        cfg = self.cfg
        batches = self._micro_batches(items)
        # the loss's denominator: the step's tokens (sequences for GSPO), over all DP ranks
        units = torch.tensor(step_units((it.trained_tokens for it in items), cfg.corrections),
                             device=self.device)
        dp_group = parallel_state.get_data_parallel_group()
        dist.all_reduce(units, group=dp_group)
        # The schedule divides each micro-batch loss by their count and DDP averages over DP:
        # undo both so the gradient is that of the token mean over the whole step.
        scale = len(batches) * self.dp_size / max(float(units), 1.0)
        sums = {k: 0.0 for k in (*SUM_STATS, *EXTRA_SUMS)}
        maxes = {k: 0.0 for k in MAX_STATS}
        ratios: list[Tensor] = []

        def loss_func(batch: PackedBatch, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            logprobs_BT, entropy_BT = self._logprobs(batch, output, cfg.compute_entropy)
            terms = policy_terms(
                logprobs_BT, batch.anchor_BT, batch.behavior_BT,
                batch.advantages_BT, batch.mask_BT, cfg.eps_clip, cfg.eps_clip_high,
                cfg.tis_clip, cfg.tis_clip_low, cfg.use_tis, cfg.corrections,
            )
            for k, v in terms.sums.items():
                sums[k] += float(v)
            for k, v in terms.maxes.items():
                maxes[k] = max(maxes[k], float(v))
            ratios.append(terms.ratios_N.cpu())
            known = batch.mask_BT & (batch.versions_BT >= 0)
            sums["versioned_tokens"] += float(known.sum())
            sums["stale_tokens"] += float((known & (batch.versions_BT < policy_version)).sum())
            if entropy_BT is not None:
                sums["entropy_sum"] += float(entropy_BT[batch.mask_BT].double().sum())
            loss = terms.token_loss_BT.sum() * scale
            return loss, {"loss": loss.detach()}

        lr = lr_at(cfg, self.step)  # the torch backend's schedule, a function of the step
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(batches, loss_func, forward_only=False)
        # The gradient norm before the update (every rank gets the same all-reduced value):
        # a non-finite one skips the update (rl_async/train/guard.py); step() recomputes it.
        self.optimizer.prepare_grads()
        norm = self.optimizer.get_grad_norm()
        took = self.guard.take(float(norm) if norm is not None else float("nan"))
        ok, grad_norm = False, norm
        if took:
            ok, grad_norm, _ = self.optimizer.step()
            # megatron may skip the update itself (a grad scaler's found_inf): then nothing
            # moved, as when the guard skips, and the step and schedule stay where they were
            took = bool(ok)
            self.step += int(took)
        else:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        maxes["ratio_p99"] = ratio_quantile(torch.cat(ratios)) if ratios else 0.0
        out = self._step_metrics(sums, maxes, ok, grad_norm, dp_group)
        self.guard.record(self.step, out["train/loss"], out["train/grad_norm"], took)
        out["train/nonfinite_updates"] = 0.0 if took else 1.0
        out["train/lr"] = lr
        return out

    def _step_metrics(self, sums: dict[str, float], maxes: dict[str, float], ok: bool,
                      grad_norm: float | None, dp_group: Any) -> dict[str, float]:
        """Reduce additive stats over DP (sum) and maxima (max; p99 too, as the torch backend:
        each rank's p99 of its tokens, max over ranks)."""
        keys, max_keys = list(sums), list(maxes)
        packed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(packed, group=dp_group)
        mx = torch.tensor([maxes[k] for k in max_keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=dp_group)
        red = dict(zip(keys, packed.tolist()))
        red_max = dict(zip(max_keys, mx.tolist()))
        out = metrics_from_stats(red, red_max, red_max["ratio_p99"])
        n = max(red["tokens"], 1.0)
        out["train/entropy"] = red["entropy_sum"] / n
        out["train/stale_token_fraction"] = (red["stale_tokens"] / red["versioned_tokens"]
                                             if red["versioned_tokens"] else 0.0)
        out["train/response_tokens"] = red["tokens"]
        out["train/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["train/update_skipped"] = 0.0 if ok else 1.0
        return out

    # ------------------------------------------------------------------ publication, checkpoints

    def named_tensors_for_publication(self) -> Iterator[tuple[str, Tensor]]:
        """Hugging Face-named full tensors on global rank 0, one layer at a time, on the
        device (rl_async/train/megatron_export.py); every rank of data-parallel replica 0
        must consume the iterator (its ranks take part in gathering), the others get none."""
        return megatron_export.stream_hf_tensors(self.model.module, self.hf_config,
                                                 self.cfg.parallel)

    def save_checkpoint(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Per-rank model, optimizer (and its parameter state), step, version, RNG states
        (rl_async/train/megatron_checkpoint.py); restore needs the same TP/PP/DP layout."""
        return megatron_checkpoint.save(self, directory, extra or {})

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        return megatron_checkpoint.load(self, directory)

    def layout(self) -> dict[str, int]:
        p = self.cfg.parallel
        out = {"world": dist.get_world_size(), "tp": p.tensor_parallel_size,
               "pp": p.pipeline_parallel_size}
        if p.expert_parallel_size > 1:  # checkpoints from before EP have no "ep" and are EP 1
            out["ep"] = p.expert_parallel_size
        return out


# ---------------------------------------------------------------------- from a run config


def trainer_config_from_run(cfg: Any, global_batch_size: int,
                            routing_replay: bool = False) -> MegatronTrainerConfig:
    """The trainer config for `cfg` (a RunConfig): the same `train.*` keys as the torch
    backend, so both backends train identically on the same batch. `routing_replay`:
    train.routing_replay resolved for the model (rl_async.plan.moe.replay_for, as the
    caller passes it to the torch trainer)."""
    t = cfg.train
    parallel = mm.MegatronParallelConfig(
        tensor_parallel_size=t.tensor_parallel, pipeline_parallel_size=t.pipeline_parallel,
        expert_parallel_size=t.expert_parallel, moe_load_balancing=t.moe_load_balancing,
        params_dtype=cfg.model.dtype if cfg.model.dtype != "float16" else "bfloat16",
        seed=cfg.model.init_seed, recompute=t.recompute,
        transformer_impl=mm.resolve_transformer_impl(t.transformer_impl),
        routing_replay=routing_replay)
    return MegatronTrainerConfig(
        parallel=parallel, global_batch_size=global_batch_size,
        micro_batch_size=t.micro_batch_size,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch, lr=t.lr,
        weight_decay=t.weight_decay,
        clip_grad=t.grad_clip, temperature=cfg.rollout.temperature, eps_clip=t.eps_clip,
        eps_clip_high=t.eps_clip_high, tis_clip=t.tis_clip, tis_clip_low=t.tis_clip_low,
        use_tis=t.use_tis, corrections=corrections_from(t),
        use_rollout_logprobs=t.use_rollout_logprobs,
        max_nonfinite_updates=t.max_nonfinite_updates,
        advantage_estimator=t.advantage, lr_schedule=t.lr_schedule,
        total_steps=t.lr_schedule_steps or cfg.run.max_steps, min_lr_ratio=t.min_lr_ratio)


def hf_weights_from_run(cfg: Any) -> tuple[Any, dict[str, Tensor] | HFCheckpoint]:
    """(HF config, weights) for `cfg.model`. A checkpoint directory is read lazily, each rank
    taking only its slices; a config-built random model (tests, demos) is built whole, with
    the engines' builder and seed, so trainer and engines start identical."""
    m = cfg.model
    if m.path is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(m.path, local_files_only=True), HFCheckpoint(m.path)
    from rl_async.state.models import build_causal_lm

    hf = build_causal_lm(m.hf_config, None, m.init_seed, "float32")
    return hf.config, dict(hf.state_dict())
