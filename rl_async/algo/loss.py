"""Policy losses with off-policy corrections (SPEC §8; the menu in rl_async/algo/corrections.py).

Three log-probs per response token:

- `b` behaviour: recorded by the engine when it sampled the token, never recomputed;
- `a` anchor: the trainer's log-prob of the token under the weights from before this
  collection's first optimizer step ("trainer scoring"; decoupled PPO's proximal policy);
- `θ` current: the trainer's log-prob under the weights being optimised.

The default, `ppo_tis` (SPEC §8):

```
w   = clamp(exp(a − b), tis_clip_low, tis_clip)       # TIS weight, detached
r   = exp(θ − a)                                       # PPO ratio
L_t = − w · min(r·A, clip(r, 1 − eps_clip, 1 + eps_clip_high) · A)
L   = Σ_t mask·L_t / Σ_t mask                          # token mean over response tokens
```

The other losses (each docstring cites its paper and writes its formula):
`decoupled_ppo`, `gspo`, `cispo`, `m2po`. `train.is_mask` replaces or masks `w`.

The loss is split in two layers so data-parallel trainers can report exact step metrics:
`policy_terms` returns per-token losses plus additive sums and maxima (which reduce across
micro-batches and ranks by plain addition / max; rl_async/algo/loss_metrics.py), and
`metrics_from_stats` turns reduced sums into the `train/*` metrics. The trainer divides the
summed per-token losses by `step_units` of the whole optimizer step (tokens; sequences for
GSPO). `policy_loss` is both in one call, for one batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_async.algo.corrections import Corrections, behaviour_weight, m2po_keep, sequence_sums
from rl_async.algo.loss_metrics import (MAX_STATS, SUM_STATS, gap_stats, metrics_from_stats,
                                        ratio_quantile)

__all__ = ["MAX_STATS", "SUM_STATS", "PolicyTerms", "metrics_from_stats", "policy_loss",
           "policy_terms", "ratio_quantile", "step_units"]
DEFAULT = Corrections()


@dataclass
class PolicyTerms:
    """Per-token loss (with grad) and detached statistics of one batch."""

    token_loss_BT: Tensor          # L_t, zero where mask is zero; carries the gradient
    ratios_N: Tensor               # detached ratios of the loss at the unmasked tokens
    sums: dict[str, Tensor]        # SUM_STATS as 0-dim float64 tensors
    maxes: dict[str, Tensor]       # MAX_STATS as 0-dim float64 tensors


@dataclass
class _Batch:
    """One batch's tensors in the compute dtype, zeroed off the mask (no inf/nan leaks)."""

    theta: Tensor
    anchor: Tensor
    behavior: Tensor
    adv: Tensor
    mask: Tensor
    weight: Tensor      # detached behaviour weight w (0 where a mask rejects)
    accepted: Tensor    # tokens the mask accepted

    def where(self, values: Tensor) -> Tensor:
        return torch.where(self.mask, values, torch.zeros_like(values))


def step_units(trained_tokens: Iterable[int], corrections: Corrections = DEFAULT) -> float:
    """The loss's denominator for an optimizer step given each sample's trained tokens:
    the token count (token mean), or the number of non-empty samples (GSPO)."""
    counts = list(trained_tokens)
    if corrections.sequence_mean:
        return float(sum(1 for n in counts if n > 0))
    return float(sum(counts))


def _check_args(logprobs: Tensor, anchor: Tensor, behavior: Tensor, advantages: Tensor,
                mask: Tensor, eps_clip: float, eps_clip_high: float, tis_clip: float,
                tis_clip_low: float) -> Tensor:
    """Validate shapes and clip settings; return advantages broadcast to [B, T]."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}: expected [batch, tokens]")
    for name, t in (("anchor_logprobs", anchor), ("behavior_logprobs", behavior), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has "
                             f"{tuple(logprobs.shape)}: they must match ([batch, tokens])")
    original_shape = tuple(advantages.shape)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if (advantages.dim() != 2 or advantages.shape[0] != logprobs.shape[0]
            or advantages.shape[1] not in (1, logprobs.shape[1])):
        raise ValueError(f"advantages has shape {original_shape}: expected [batch] or "
                         f"[batch, tokens] = {tuple(logprobs.shape)}")
    if not (0.0 <= eps_clip < 1.0) or eps_clip_high < 0.0:
        raise ValueError(f"eps_clip = {eps_clip}, eps_clip_high = {eps_clip_high}: need "
                         f"0 <= eps_clip < 1 and eps_clip_high >= 0")
    if not (0.0 <= tis_clip_low <= tis_clip):
        raise ValueError(f"tis_clip_low = {tis_clip_low}, tis_clip = {tis_clip}: need "
                         f"0 <= tis_clip_low <= tis_clip")
    return advantages.expand_as(logprobs)


def _clipped_surrogate(x: _Batch, ratio: Tensor, low: float, high: float
                       ) -> tuple[Tensor, Tensor]:
    """−min(ratio·A, clip(ratio, low, high)·A) and where the clipped term binds."""
    unclipped = -x.adv * ratio
    clipped = -x.adv * ratio.clamp(low, high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped) & x.mask


def _ppo(x: _Batch, eps_clip: float, eps_clip_high: float):
    """PPO-clip on r = exp(θ − a), times w. `ppo_tis` (SPEC §8) and `decoupled_ppo`, AReaL
    (Fu et al. 2025, arXiv 2505.24298, eq. 5): J = E[π_prox/π_behav · min(u·A, clip(u,
    1 − ε, 1 + ε)·A)], u = π_θ/π_prox; AReaL's weight is untruncated (corrections.py)."""
    ratio = torch.exp(x.where(x.theta - x.anchor))
    pg, clipped = _clipped_surrogate(x, ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    return x.weight * pg, ratio, clipped, x.weight, x.accepted


def _gspo(x: _Batch, corr: Corrections):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7): s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|)
    = exp(mean_t(θ − a)); J = 1/G Σ_i min(s_i·A_i, clip(s_i, 1 − ε_l, 1 + ε_h)·A_i). Written
    as GSPO-token (eq. 13): s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] has s_i's value and
    gradient, so each token carries its share; dividing by |y_i| here and by the number of
    sequences in the trainer gives the paper's sequence mean. Each token's loss is then
    multiplied by w, as verl applies its rollout weights to GSPO."""
    total_B1, count_B1 = sequence_sums(x.theta.detach() - x.anchor, x.mask)
    log_s_B1 = total_B1 / count_B1.clamp(min=1.0)
    ratio = torch.exp(x.where(x.theta - x.theta.detach() + log_s_B1))
    pg, clipped = _clipped_surrogate(x, ratio, 1.0 - corr.gspo_eps_low, 1.0 + corr.gspo_eps_high)
    return x.weight * pg / count_B1.clamp(min=1.0), ratio, clipped, x.weight, x.accepted


def _cispo(x: _Batch, corr: Corrections):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): J = 1/Σ|o_i| Σ_i Σ_t sg(r̂_i,t)·Â_i,t·
    log π_θ(o_i,t), r̂ = clip(r, low, high), with r = π_θ/π_behav against the policy that
    sampled the data (ScaleRL, arXiv 2510.13786: rollout-anchored, truncated above at 4).
    The weight is a coefficient: every token keeps its gradient, none is clipped away."""
    ratio = torch.exp(x.where(x.theta.detach() - x.behavior))
    low, high = corr.cispo_ratio_low, corr.cispo_ratio_high
    coeff = ratio.clamp(low, high) * x.weight          # x.weight: the mask's 0/1 acceptance
    loss = -coeff * x.adv * x.where(x.theta)
    return loss, ratio, ((ratio < low) | (ratio > high)) & x.mask, coeff, x.accepted


def _m2po(x: _Batch, corr: Corrections, log_rho: Tensor):
    """M2PO (Zheng et al. 2025, arXiv 2510.01161; AReaL docs/en/algorithms/m2po.md):
    J = 1/Σ_i|o_i| Σ_i Σ_t M_i,t·π_θ/π_behav·A_i,t, M ∈ {0, 1} the second-moment mask of
    corrections.m2po_keep. No clip: the mask bounds E[(log r)²] instead; masked tokens stay
    in the denominator (the original Σ|o_i|)."""
    keep = m2po_keep(log_rho, x.mask, corr.m2po_tau)
    gate = x.weight * keep
    ratio = torch.exp(torch.where(keep, x.theta - x.behavior, torch.zeros_like(x.theta)))
    stats_ratio = torch.exp(x.where(x.theta.detach() - x.behavior))
    return (-gate * ratio * x.adv, stats_ratio, torch.zeros_like(x.mask), gate * ratio.detach(),
            x.accepted & keep)


def policy_terms(logprobs: Tensor, anchor_logprobs: Tensor, behavior_logprobs: Tensor,
                 advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                 eps_clip_high: float = 0.2, tis_clip: float = 2.0, tis_clip_low: float = 0.0,
                 use_tis: bool = True, corrections: Corrections | None = None) -> PolicyTerms:
    """Per-token loss of the configured objective and the additive statistics behind the
    metrics. Sum `token_loss_BT` and divide by `step_units` of the whole step."""
    corr = corrections or DEFAULT
    adv_BT = _check_args(logprobs, anchor_logprobs, behavior_logprobs, advantages, mask,
                         eps_clip, eps_clip_high, tis_clip, tis_clip_low)
    mask_BT = mask.to(torch.bool)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Masked positions may hold anything (padding, -inf): zero them so no inf/nan leaks
    # into the sums through 0 · inf.
    anchor_BT = torch.where(mask_BT, anchor_logprobs.detach().to(dtype), zero)
    behavior_BT = torch.where(mask_BT, behavior_logprobs.detach().to(dtype), zero)
    # The behaviour gap in float64: exp(a − b) can be large before any clamp.
    log_rho_BT = torch.where(mask_BT, anchor_logprobs.detach().double()
                             - behavior_logprobs.detach().double(), 0.0)
    w_BT, accepted_BT = behaviour_weight(corr, log_rho_BT, mask_BT, use_tis, tis_clip,
                                         tis_clip_low)
    x = _Batch(torch.where(mask_BT, logprobs.to(dtype), zero), anchor_BT, behavior_BT,
               torch.where(mask_BT, adv_BT.detach().to(dtype), zero), mask_BT, w_BT.to(dtype),
               accepted_BT)
    kind = corr.policy_loss
    if kind in ("ppo_tis", "decoupled_ppo"):
        out = _ppo(x, eps_clip, eps_clip_high)
    elif kind == "gspo":
        out = _gspo(x, corr)
    elif kind == "cispo":
        out = _cispo(x, corr)
    else:
        out = _m2po(x, corr, log_rho_BT)
    loss_BT, ratio_BT, clipped_BT, weight_BT, kept_BT = out
    token_loss_BT = torch.where(mask_BT, loss_BT, zero)
    return PolicyTerms(token_loss_BT, ratio_BT.detach()[mask_BT].double(),
                       _sums(corr, x, token_loss_BT, clipped_BT, log_rho_BT, kept_BT,
                             weight_BT, use_tis, tis_clip, tis_clip_low),
                       _maxes(ratio_BT.detach()[mask_BT].double()))


def _sums(corr: Corrections, x: _Batch, token_loss_BT: Tensor, clipped_BT: Tensor,
          log_rho_BT: Tensor, kept_BT: Tensor, weight_BT: Tensor, use_tis: bool,
          tis_clip: float, tis_clip_low: float) -> dict[str, Tensor]:
    with torch.no_grad():
        sums = gap_stats(log_rho_BT, x.mask, kept_BT, x.adv, weight_BT.detach())
        truncates = (use_tis and corr.policy_loss in ("ppo_tis", "gspo")
                     and corr.is_mask in ("none", "geo_rs"))
        rho_BT = torch.exp(log_rho_BT)
        tis_clipped = ((rho_BT > tis_clip) | (rho_BT < tis_clip_low)) & x.mask
        sums.update({
            "loss_units": sums["sequences"] if corr.sequence_mean else sums["tokens"],
            "loss_sum": token_loss_BT.detach().double().sum(),
            "ppo_clipped": clipped_BT.double().sum(),
            "tis_clipped": tis_clipped.double().sum() if truncates else torch.zeros(
                (), dtype=torch.float64, device=log_rho_BT.device),
        })
    assert set(sums) == set(SUM_STATS), sorted(set(SUM_STATS) ^ set(sums))
    return sums


def _maxes(ratios_N: Tensor) -> dict[str, Tensor]:
    top = ratios_N.max() if ratios_N.numel() else torch.zeros((), dtype=torch.float64)
    return {"ratio_max": top}


def policy_loss(logprobs: Tensor, anchor_logprobs: Tensor, behavior_logprobs: Tensor,
                advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                eps_clip_high: float = 0.2, tis_clip: float = 2.0, tis_clip_low: float = 0.0,
                use_tis: bool = True, corrections: Corrections | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """One batch's loss (the configured objective over its own tokens or sequences) and its
    `train/*` metrics (rl_async/algo/loss_metrics.py).

    `advantages` is [batch, tokens] or [batch] (broadcast over the tokens). `mask` is 1 at
    response tokens and 0 at prompt and padding. `anchor_logprobs` and `behavior_logprobs`
    are treated as constants. With no unmasked token the loss is 0 (still connected to
    `logprobs`) and metrics are 0.
    """
    corr = corrections or DEFAULT
    terms = policy_terms(logprobs, anchor_logprobs, behavior_logprobs, advantages, mask,
                         eps_clip, eps_clip_high, tis_clip, tis_clip_low, use_tis, corr)
    units = float(terms.sums["loss_units"])
    loss = terms.token_loss_BT.sum() / max(units, 1.0)
    metrics = metrics_from_stats({k: float(v) for k, v in terms.sums.items()},
                                 {k: float(v) for k, v in terms.maxes.items()},
                                 ratio_quantile(terms.ratios_N))
    return loss, metrics
