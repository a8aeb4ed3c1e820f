"""megatron-core trainer backend: the SPEC §8 loss on a TP/PP/DP GPTModel (megatron-core 0.16.1).

One collection, on every rank (each data-parallel rank passes its own shard of groups; the
TP and PP ranks of one DP replica pass the same groups):

```
groups -> advantages -> items -> micro-batches
   -> score every token with the pre-update weights (anchor, forward only)
   -> per optimizer step of global_batch_size / DP local samples:
        forward_backward_func (megatron schedule, PP-aware) -> DDP grad reduce
        -> get_megatron_optimizer step (clip, Adam; distributed optimizer by default)
   -> metrics (reduced over DP; computed on the last pipeline stage)
```

Same method names as the torch trainer: `train_collection`, `named_tensors_for_publication`,
`save_checkpoint`, `load_checkpoint`. Needs a GPU for the optimizer path (megatron's DDP
buffers and RNG tracker are CUDA-only); the model parts run on CPU only under test shims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl_async.advantages import DEFAULT_ESTIMATOR, group_advantages
from rl_async.loss import MAX_STATS, SUM_STATS, metrics_from_stats, policy_terms, ratio_quantile
from rl_async.train import megatron_model as mm
from rl_async.train.batching import PackedBatch, TrainItem, item_from_sample, pack
from rl_async.train.checkpoint import load_state, save_state
from rl_async.types import Group


@dataclass
class MegatronTrainerConfig:
    parallel: mm.MegatronParallelConfig = field(default_factory=mm.MegatronParallelConfig)
    global_batch_size: int = 8          # samples per optimizer step, over all DP ranks
    micro_batch_size: int = 1           # samples per forward/backward
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
    advantage_estimator: str = DEFAULT_ESTIMATOR

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0")


class MegatronTrainer:
    """One rank of a megatron-core trainer; torch.distributed must already be initialised."""

    def __init__(self, hf_config: Any, hf_state: dict[str, Tensor], cfg: MegatronTrainerConfig):
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
        mm.load_hf_weights(module, hf_state, hf_config, pcfg)
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
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # ------------------------------------------------------------------ training

    def train_collection(self, groups: Sequence[Group], policy_version: int) -> dict[str, float]:
        """Anchor-score, then run optimizer steps over this rank's groups; returns `train/*` metrics."""
        items = self._items(groups)
        local_step = self.cfg.global_batch_size // self.dp_size
        if not items or len(items) % local_step:
            raise ValueError(
                f"{len(items)} samples on this rank is not a positive multiple of "
                f"global_batch_size / data_parallel_size = {local_step}: size "
                f"rollout_batch_size × n_samples_per_prompt to whole optimizer steps"
            )
        self.model.eval()
        self._score_anchors(items)
        self.model.train()
        metrics: dict[str, float] = {}
        for s in range(len(items) // local_step):
            step_metrics = self._optimizer_step(items[s * local_step:(s + 1) * local_step], policy_version)
            for k, v in step_metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
        n_steps = len(items) // local_step
        out = {k: v / n_steps for k, v in metrics.items()}
        out["train/optimizer_steps"] = float(n_steps)
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
        mbs = self.cfg.micro_batch_size
        return [pack(items[i:i + mbs], self.device) for i in range(0, len(items), mbs)]

    def _run_schedule(self, batches: list[PackedBatch], loss_func: Any, forward_only: bool) -> list[Any]:
        """megatron's forward/backward schedule (pipelined when PP > 1) over `batches`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, model: Any) -> tuple[Tensor, Any]:
            batch = next(data_iterator)
            return mm.forward_logits(model, batch.input_ids_BL), partial(loss_func, batch)

        seq_len = max(b.input_ids_BL.shape[1] for b in batches)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.model],
            num_microbatches=len(batches), seq_length=seq_len,
            micro_batch_size=self.cfg.micro_batch_size, forward_only=forward_only,
        )

    def _logprobs(self, batch: PackedBatch, output: Tensor) -> Tensor:
        return mm.logprobs_from_logits(
            output, batch.targets_BT, batch.start, self.cfg.temperature, self.hf_config.vocab_size
        )

    @torch.no_grad()
    def _score_anchors(self, items: list[TrainItem]) -> None:
        """Trainer scoring: pre-update log-probs of every response token (the PPO anchor)."""
        mbs = self.cfg.micro_batch_size
        batches = self._micro_batches(items)

        def loss_func(batch: PackedBatch, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            lp = self._logprobs(batch, output)
            return lp.sum() * 0, {"anchor": lp.detach().float().cpu()}

        results = self._run_schedule(batches, loss_func, forward_only=True)
        # Only the last pipeline stage computes log-probs, and only it needs the anchors.
        for b, (batch, res) in enumerate(zip(batches, results)):
            for row, (lo, hi) in enumerate(batch.spans):
                items[b * mbs + row].anchor_logprobs = res["anchor"][row, lo:hi].tolist()

    def _optimizer_step(self, items: list[TrainItem], policy_version: int) -> dict[str, float]:
        from megatron.core import parallel_state

        batches = self._micro_batches(items)
        tokens = torch.tensor(float(sum(it.response_len for it in items)), device=self.device)
        dp_group = parallel_state.get_data_parallel_group()
        dist.all_reduce(tokens, group=dp_group)
        # The schedule divides each micro-batch loss by their count and DDP averages over DP:
        # undo both so the gradient is that of the token mean over the whole step.
        scale = len(batches) * self.dp_size / max(float(tokens), 1.0)
        sums = {k: 0.0 for k in SUM_STATS}
        maxes = {k: 0.0 for k in MAX_STATS}
        ratios: list[Tensor] = []
        stale = [0.0]

        def loss_func(batch: PackedBatch, output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            anchor = batch.anchor_BT if batch.anchor_BT is not None else batch.behavior_BT
            terms = policy_terms(
                self._logprobs(batch, output), anchor, batch.behavior_BT, batch.advantages_BT,
                batch.mask_BT, self.cfg.eps_clip, self.cfg.eps_clip_high, self.cfg.tis_clip,
                self.cfg.tis_clip_low,
            )
            for k, v in terms.sums.items():
                sums[k] += float(v)
            for k, v in terms.maxes.items():
                maxes[k] = max(maxes[k], float(v))
            ratios.append(terms.ratios_N.cpu())
            known = batch.mask_BT & (batch.versions_BT >= 0)
            stale[0] += float((known & (batch.versions_BT < policy_version)).sum())
            loss = terms.token_loss_BT.sum() * scale
            return loss, {"loss": loss.detach()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(batches, loss_func, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        return self._step_metrics(sums, maxes, ratios, stale[0], ok, grad_norm, dp_group)

    def _step_metrics(self, sums: dict[str, float], maxes: dict[str, float], ratios: list[Tensor],
                      stale: float, ok: bool, grad_norm: float | None, dp_group: Any) -> dict[str, float]:
        """Reduce additive stats over DP (sum) and maxima (max); p99 is this rank's."""
        keys = list(SUM_STATS)
        packed = torch.tensor([sums[k] for k in keys] + [stale], dtype=torch.float64, device=self.device)
        dist.all_reduce(packed, group=dp_group)
        mx = torch.tensor([maxes[k] for k in MAX_STATS], dtype=torch.float64, device=self.device)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=dp_group)
        red_sums = dict(zip(keys, packed[:-1].tolist()))
        red_max = dict(zip(MAX_STATS, mx.tolist()))
        p99 = ratio_quantile(torch.cat(ratios)) if ratios else 0.0
        out = metrics_from_stats(red_sums, red_max, p99)
        n = max(red_sums["tokens"], 1.0)
        out["train/stale_token_fraction"] = float(packed[-1]) / n
        out["train/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["train/update_skipped"] = 0.0 if ok else 1.0
        return out

    # ------------------------------------------------------------------ publication, checkpoints

    def named_tensors_for_publication(self) -> list[tuple[str, Tensor]]:
        """Hugging Face-named full tensors (TP shards gathered, PP stages merged), stable order."""
        hf = mm.export_hf_state(self.model.module, self.hf_config, self.cfg.parallel)
        return list(hf.items())

    def _rank_dir(self, directory: str | Path) -> Path:
        return Path(directory) / f"megatron_rank{dist.get_rank():05d}"

    def save_checkpoint(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Per-rank model + optimizer state; restore needs the same world size and TP/PP layout."""
        state: dict[str, Any] = {
            "model": {k: v.detach().cpu() for k, v in mm._tensor_state(self.model.module).items()},
            "optimizer": self.optimizer.state_dict(),
            "step": self.step, "policy_version": self.policy_version, "extra": extra or {},
            "layout": self._layout(),
        }
        if self.cfg.use_distributed_optimizer:
            state["param_state"] = _param_state(self.optimizer)
        return save_state(self._rank_dir(directory), state)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        state = load_state(self._rank_dir(directory), map_location="cpu")
        if state["layout"] != self._layout():
            raise ValueError(f"checkpoint layout {state['layout']} differs from this run's {self._layout()}")
        with torch.no_grad():
            for name, t in mm._tensor_state(self.model.module).items():
                t.copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if "param_state" in state:
            _load_param_state(self.optimizer, state["param_state"])
        self.step, self.policy_version = state["step"], state["policy_version"]
        return state["extra"]

    def _layout(self) -> dict[str, int]:
        p = self.cfg.parallel
        return {"world": dist.get_world_size(), "tp": p.tensor_parallel_size, "pp": p.pipeline_parallel_size}


def _distributed_parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer(s) inside megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _param_state(optimizer: Any) -> list[Any]:
    # This rank's shard of fp32 main params and Adam moments, in bucket order.
    return [opt.get_parameter_state_dp_reshardable() for opt in _distributed_parts(optimizer)]


def _load_param_state(optimizer: Any, states: list[Any]) -> None:
    for opt, st in zip(_distributed_parts(optimizer), states):
        opt.load_parameter_state_from_dp_reshardable(st)
