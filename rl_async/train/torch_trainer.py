"""The torch trainer backend: a transformers causal LM, AdamW, data parallel through DDP.

One call per collection (this rank's shard of whole groups):

```
train_collection(groups, v)
  advantages per group (registry, rl_async.algo.advantages)
  anchor = score every response token with the PRE-update weights   (skipped when
           use_rollout_logprobs: anchor = behaviour log-probs; and when the collection
           is ONE optimizer step: the weights cannot change before its micro-batches run,
           so the anchor is the training forward's own detached log-probs, exactly, and
           the scoring pass, a third of the step's compute, is not spent)
  for each optimizer step of global_batch_size // world_size samples on this rank:
      zero grads
      for each micro-batch:  (DDP no_sync on all but the last; a group's shared prompt
                              runs once: train/prefix.py)
          θ = log_softmax(logits / temperature)[token]
          loss = Σ token losses · world_size / (step's tokens on ALL ranks; GSPO: sequences)
          backward                       (DDP averages → exact global token mean)
      clip grad norm → AdamW step → step += 1
      metrics reduced over ranks
  return metrics averaged over the collection's steps
```

Behaviour log-probs from the engine are never replaced. Dropout stays off (eval mode) so the
PPO ratio is exactly 1 at the anchor. On GPU the forward runs under bf16 autocast with fp32
master weights and optimizer state.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from rl_async.algo import loss as loss_lib
from rl_async.algo.advantages import get_advantage_fn, group_advantages
from rl_async.algo.corrections import Corrections
from rl_async.state import trainer_state as ckpt
from rl_async.train.batching import (PolicyScorer, TrainItem, item_from_sample,
                                     micro_batches, pack, unpack_rows)
from rl_async.train.guard import NonFiniteGuard
from rl_async.train.routing import TrainerRouting
from rl_async.train.schedule import lr_at  # noqa: F401 -- also megatron's schedule
from rl_async.train.distributed import check_same_on_all_ranks, is_distributed, reduce_stats
from rl_async.state.models import build_causal_lm, resolve_dtype
from rl_async.base.types import Group

# Publication bucket size: large enough for few collectives, small enough to bound the copy.


@dataclass
class TorchTrainerConfig:
    """Everything one trainer rank needs; picklable (it travels to Ray actors)."""

    # Model spec: exactly one of hf_config (with "model_type") or model_path. The engines
    # build the identical initial model from the same spec and seed.
    hf_config: dict[str, Any] | None = None
    model_path: str | None = None
    seed: int = 0
    # Optimizer.
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # <= 0: no clipping (the norm is still reported)
    # "constant", or "cosine" from lr down to lr * min_lr_ratio over total_steps updates.
    lr_schedule: str = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    # Batching: samples per optimizer step over ALL ranks, samples per forward on one rank.
    global_batch_size: int = 8
    micro_batch_size: int = 4
    # Micro-batches by a padded-token budget instead of micro_batch_size rows (None: rows).
    max_tokens_per_microbatch: int | None = None
    # Loss (SPEC §8).
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_tis: bool = True
    corrections: Corrections = field(default_factory=Corrections)  # train.policy_loss, ...
    use_rollout_logprobs: bool = False
    advantage_estimator: str = "group_norm"
    # Sampling temperature the engines used: log-probs are log_softmax(logits / temperature).
    temperature: float = 1.0
    # Runtime.
    device: str = "auto"              # "auto" = cuda when available, else cpu
    bf16: bool = True                 # bf16 autocast; only on GPU
    compute_entropy: bool = True
    # Run each distinct prompt of a micro-batch once, its KV shared by the group's samples
    # (train/prefix.py): the same log-probs and gradients, a fraction of the compute.
    share_prompts: bool = True
    # MoE: force the experts the engine recorded in every scoring forward (train/routing.py).
    routing_replay: bool = False
    # Skipped non-finite updates in a row before the run stops (rl_async/train/guard.py).
    max_nonfinite_updates: int = 3
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if (self.hf_config is None) == (self.model_path is None):
            raise ValueError("TorchTrainerConfig: set exactly one of hf_config or model_path "
                             f"(got hf_config={self.hf_config!r}, model_path={self.model_path!r})")
        for key in ("global_batch_size", "micro_batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"train.{key} = {getattr(self, key)!r}: must be an int >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.lr = {self.lr!r}: must be a positive finite number")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"train.temperature = {self.temperature!r}: must be > 0 (greedy "
                             f"sampling has no log-probs to correct with TIS)")
        if not (0.0 <= self.eps_clip < 1.0 and self.eps_clip_high >= 0.0):
            raise ValueError(f"train.eps_clip = {self.eps_clip}, eps_clip_high = "
                             f"{self.eps_clip_high}: need 0 <= eps_clip < 1, eps_clip_high >= 0")
        if not (0.0 <= self.tis_clip_low <= self.tis_clip):
            raise ValueError(f"train.tis_clip_low = {self.tis_clip_low}, tis_clip = "
                             f"{self.tis_clip}: need 0 <= tis_clip_low <= tis_clip")
        get_advantage_fn(self.advantage_estimator)  # unknown name -> error listing names
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"train.lr_schedule = {self.lr_schedule!r}: use 'constant' or 'cosine'")
        if self.lr_schedule == "cosine" and self.total_steps < 1:
            raise ValueError("train.lr_schedule = 'cosine' needs total_steps >= 1 (run.max_steps)")
        self.betas = tuple(self.betas)  # TOML gives lists


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but CUDA is not available: use 'cpu' or 'auto'")
    return device


class TorchTrainer:
    """One data-parallel rank. With world_size > 1 the default process group must exist
    (`rl_async.train.distributed.init_distributed`)."""

    def __init__(self, config: TorchTrainerConfig, rank: int = 0, world_size: int = 1):
        if not (0 <= rank < world_size):
            raise ValueError(f"rank = {rank}, world_size = {world_size}: need 0 <= rank < "
                             f"world_size")
        if config.global_batch_size % world_size:
            raise ValueError(f"train.global_batch_size = {config.global_batch_size} is not "
                             f"divisible by the {world_size} trainer workers: make it a multiple")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = _resolve_device(config.device)
        self._autocast = config.bf16 and self.device.type == "cuda"
        # The same builder as the engines: same spec + seed -> identical initial weights.
        self.model = build_causal_lm(config.hf_config, config.model_path, config.seed,
                                     "float32", device=str(self.device))
        self._distributed = is_distributed(world_size)
        self._scorer = PolicyScorer(self.model)
        self.routing = TrainerRouting(self.model) if config.routing_replay else None
        self._route = self.routing.shape if self.routing is not None else None
        self._ddp: DistributedDataParallel | None = None
        if self._distributed:
            device_ids = [self.device.index or 0] if self.device.type == "cuda" else None
            # DDP broadcasts rank 0's weights at construction: every rank starts identical.
            self._ddp = DistributedDataParallel(self._scorer, device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, betas=config.betas, eps=config.adam_eps,
            weight_decay=config.weight_decay)
        self.step = 0               # optimizer steps taken so far
        self.guard = NonFiniteGuard(self.config.max_nonfinite_updates)
        self.policy_version = 0     # version of the last collection trained on
        self.per_rank_batch = config.global_batch_size // world_size

    # ------------------------------------------------------------------ scoring
    def _forward_ctx(self):
        if self._autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _score_items(self, items: Sequence[TrainItem]) -> list[list[float]]:
        out: list[list[float]] = []
        for chunk in micro_batches(items, self.config.micro_batch_size,
                                   self.config.max_tokens_per_microbatch):
            batch = pack(chunk, self.device, self.config.pad_token_id, self.config.share_prompts,
                         self._route)
            with self._forward_ctx():
                logprobs_BT, _ = self._scorer(batch, self.config.temperature)
            out.extend(unpack_rows(logprobs_BT, batch))
        return out

    def score(self, groups: Sequence[Group]) -> list[list[float]]:
        """Current-weight log-probs of every response token, one list per sample, in order."""
        for g in groups:
            for i, s in enumerate(g.samples):
                if not s.prompt_ids:
                    raise ValueError(f"group {g.group_id!r} sample {i}: prompt_ids is empty")
        items = [TrainItem(list(s.prompt_ids), list(s.response_ids), [0.0] * s.response_len, [],
                           routed=s.routed_experts)  # scored with the engine's experts
                 for g in groups for s in g.samples]
        return self._score_items(items)

    # ------------------------------------------------------------------ training
    def _prepare(self, groups: Sequence[Group]) -> list[TrainItem]:
        advantages = group_advantages(groups, self.config.advantage_estimator)
        items = [item_from_sample(s, advantages[gi][si], f"group {g.group_id!r} sample {si}")
                 for gi, g in enumerate(groups) for si, s in enumerate(g.samples)]
        if self.config.use_rollout_logprobs:
            for it in items:
                it.anchor_logprobs = list(it.behavior_logprobs)
        elif len(items) <= self.per_rank_batch:
            pass  # one optimizer step: anchor = the training forward, detached (_micro_batch)
        else:
            # The PPO anchor: pre-update weights, scored once before the first step.
            for it, anchor in zip(items, self._score_items(items)):
                it.anchor_logprobs = anchor
        return items

    def _prepare_on_all_ranks(self, groups: Sequence[Group]) -> list[TrainItem]:
        """`_prepare`, but a shard rejected on one rank stops every rank (no DDP hang)."""
        error: ValueError | None = None
        try:
            items = self._prepare(groups)
        except ValueError as e:  # re-raised below, after telling the other ranks
            error, items = e, []
        if self._distributed:
            _, failed = reduce_stats({}, {"failed": float(error is not None)},
                                     self.world_size, self.device)
            if failed["failed"] and error is None:
                raise RuntimeError("another trainer rank rejected its shard of this collection "
                                   "(its error names the sample); this rank stops as well")
        if error is not None:
            raise error
        return items

    def train_collection(self, groups: Sequence[Group], policy_version: int) -> dict[str, float]:
        """Train on this rank's shard of one collection; returns metrics averaged over steps.

        Every rank must call this with shards of the same number of samples (rounded up to
        optimizer steps); a mismatch raises on every rank instead of hanging.
        """
        t0 = time.perf_counter()
        if self.routing is not None:  # measured under the pre-update weights
            self.routing.start_collection()
        items = self._prepare_on_all_ranks(groups)
        scoring_s = time.perf_counter() - t0
        steps = [items[i:i + self.per_rank_batch] for i in range(0, len(items), self.per_rank_batch)]
        check_same_on_all_ranks("optimizer steps per collection", len(steps),
                                self.world_size, self.device)
        self.policy_version = policy_version
        per_step = []
        for step_items in steps:
            per_step.append(self._optimizer_step(step_items, policy_version))
            if self.routing is not None:
                self.routing.after_first_step()
        metrics = self._average(per_step)
        if self.routing is not None:
            metrics.update(self.routing.metrics())
        metrics.update({
            "train/optimizer_steps": float(len(steps)),
            "train/response_tokens": float(sum(m["train/response_tokens"] for m in per_step)),
            "train/nonfinite_updates": sum(m["train/nonfinite_updates"] for m in per_step),
            "train/step": float(self.step),
            "train/lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/anchor_scoring_seconds": scoring_s,
            "train/collection_seconds": time.perf_counter() - t0,
        })
        return metrics

    @staticmethod
    def _average(per_step: list[dict[str, float]]) -> dict[str, float]:
        return {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]
                } if per_step else {}

    def _global_units(self, items: Sequence[TrainItem]) -> float:
        """The loss's denominator over the whole step, all ranks (loss.step_units)."""
        local = loss_lib.step_units((it.trained_tokens for it in items), self.config.corrections)
        sums, _ = reduce_stats({"units": local}, {}, self.world_size, self.device)
        return sums["units"]

    def _micro_batch(self, items: Sequence[TrainItem], scale: float, policy_version: int
                     ) -> tuple[dict[str, float], dict[str, float], Tensor]:
        """Forward + backward of one micro-batch; returns its sums, maxes and ratios."""
        cfg = self.config
        batch = pack(items, self.device, cfg.pad_token_id, cfg.share_prompts, self._route)
        scorer = self._ddp if self._ddp is not None else self._scorer
        with self._forward_ctx():
            if self.routing is None:
                logprobs_BT, entropy_BT = scorer(batch, cfg.temperature, cfg.compute_entropy)
            else:  # replayed, and measured (train/routing.py)
                logprobs_BT, entropy_BT = self.routing.score(
                    scorer, self._scorer, batch, items, cfg.temperature, cfg.compute_entropy,
                    policy_version)
        # No scored anchor: this is the collection's only optimizer step, so the weights
        # are still the pre-update ones and the anchor is this forward, detached (ratio 1).
        anchor_BT = batch.anchor_BT if batch.anchor_BT is not None else logprobs_BT.detach()
        terms = loss_lib.policy_terms(
            logprobs_BT, anchor_BT, batch.behavior_BT, batch.advantages_BT, batch.mask_BT,
            cfg.eps_clip, cfg.eps_clip_high, cfg.tis_clip, cfg.tis_clip_low, cfg.use_tis,
            cfg.corrections)
        (terms.token_loss_BT.sum() * scale).backward()
        sums = {k: float(v) for k, v in terms.sums.items()}
        known_BT = batch.mask_BT & (batch.versions_BT >= 0)
        sums["versioned_tokens"] = float(known_BT.sum())
        sums["stale_tokens"] = float((known_BT & (batch.versions_BT < policy_version)).sum())
        sums["entropy_sum"] = (float(entropy_BT[batch.mask_BT].double().sum())
                               if entropy_BT is not None else 0.0)
        return sums, {k: float(v) for k, v in terms.maxes.items()}, terms.ratios_N

    def _optimizer_step(self, items: Sequence[TrainItem], policy_version: int
                        ) -> dict[str, float]:
        cfg = self.config
        global_units = self._global_units(items)
        # DDP averages gradients over ranks; scaling by world_size / global tokens turns the
        # average into the exact token mean over the whole step on every rank.
        scale = self.world_size / max(global_units, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(items, cfg.micro_batch_size, cfg.max_tokens_per_microbatch)
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        ratios = []
        for k, mb in enumerate(micro):
            sync = self._ddp is None or k == len(micro) - 1
            ctx = contextlib.nullcontext() if sync else self._ddp.no_sync()
            with ctx:
                mb_sums, mb_maxes, mb_ratios = self._micro_batch(mb, scale, policy_version)
            for key, v in mb_sums.items():
                sums[key] = sums.get(key, 0.0) + v
            for key, v in mb_maxes.items():
                maxes[key] = max(maxes.get(key, 0.0), v)
            ratios.append(mb_ratios)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        lr = lr_at(self.config, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        took = self.guard.take(grad_norm)  # the same on every rank: grads are all-reduced
        if took:
            self.optimizer.step()
            self.step += 1
        else:  # rl_async/train/guard.py: weights, optimizer state and schedule unchanged
            self.optimizer.zero_grad(set_to_none=True)
        # p99 is not additive: each rank's p99 over its step tokens, max over ranks.
        maxes["ratio_p99"] = loss_lib.ratio_quantile(torch.cat(ratios))
        sums, maxes = reduce_stats(sums, maxes, self.world_size, self.device)
        metrics = loss_lib.metrics_from_stats(sums, maxes, maxes["ratio_p99"])
        self.guard.record(self.step, metrics["train/loss"], grad_norm, took)
        n = max(sums["tokens"], 1.0)
        metrics.update({
            "train/nonfinite_updates": 0.0 if took else 1.0,
            "train/entropy": sums["entropy_sum"] / n,
            "train/grad_norm": grad_norm,
            "train/stale_token_fraction": (sums["stale_tokens"] / sums["versioned_tokens"]
                                           if sums["versioned_tokens"] else 0.0),
            "train/response_tokens": sums["tokens"],
        })
        return metrics

    # ------------------------------------------------------------------ publication
    def named_tensors_for_publication(self, dtype: str | torch.dtype | None = None
                                      ) -> list[tuple[str, Tensor]]:
        """(Hugging Face name, detached tensor) in the model's stable parameter order.

        Tied weights appear once, under their first name (e.g. `model.embed_tokens.weight`
        without `lm_head.weight`), as HF/SGLang weight loaders expect. `dtype` casts (copies)
        for engines that serve in another precision; None keeps the fp32 master weights
        (views of the live parameters: copy before the next optimizer step if kept).
        """
        target = resolve_dtype(dtype) if dtype is not None else None
        out = []
        for name, p in self.model.named_parameters():
            t = p.detach()
            out.append((name, t.to(target) if target is not None else t))
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | os.PathLike, extra: dict | None = None
                        ) -> str | None:
        """Rank 0 writes model, optimizer, step and policy version atomically; other ranks
        hold identical state under DDP and write nothing (returns None there)."""
        if self.rank != 0:
            return None
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "policy_version": self.policy_version,
                 "config": asdict(self.config), "extra": dict(extra or {}),
                 "rng": ckpt.rng_state()}
        return str(ckpt.save_state(directory, state))

    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restore what `save_checkpoint` wrote (on every rank); returns its `extra`."""
        state = ckpt.load_state(directory, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.policy_version = int(state["policy_version"])
        if "rng" in state:
            ckpt.set_rng_state(state["rng"])
        return dict(state["extra"])
