"""PPO + truncated importance sampling (TIS) policy loss (SPEC §8).

Three log-probs per response token:

- `b` behaviour: recorded by the engine when it sampled the token, never recomputed;
- `a` anchor: the trainer's log-prob of the token under the weights from before this
  collection's first optimizer step ("trainer scoring");
- `θ` current: the trainer's log-prob under the weights being optimised.

```
w   = clamp(exp(a − b), tis_clip_low, tis_clip)       # TIS weight, detached
r   = exp(θ − a)                                       # PPO ratio
L_t = − w · min(r·A, clip(r, 1 − eps_clip, 1 + eps_clip_high) · A)
L   = Σ_t mask·L_t / Σ_t mask                          # token mean over response tokens
```

The loss is split in two layers so data-parallel trainers can report exact step metrics:
`policy_terms` returns per-token losses plus additive sums and maxima (which reduce across
micro-batches and ranks by plain addition / max), and `metrics_from_stats` turns reduced
sums into the `train/*` metrics. `policy_loss` is both in one call, for one batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

# Additive statistics (reduce by sum over micro-batches and ranks).
SUM_STATS = (
    "tokens",            # N: unmasked response tokens
    "loss_sum",          # Σ L_t
    "ppo_clipped",       # tokens where the clipped PPO term is the binding one
    "tis_clipped",       # tokens where exp(a − b) fell outside [tis_clip_low, tis_clip]
    "tis_w_sum",         # Σ w
    "tis_w_sq_sum",      # Σ w²
    "abs_mismatch_sum",  # Σ |a − b|
    "kl_sum",            # Σ k3(a, b), see below
)
# Statistics that reduce by max.
MAX_STATS = ("ratio_max",)


@dataclass
class PolicyTerms:
    """Per-token loss (with grad) and detached statistics of one batch."""

    token_loss_BT: Tensor          # L_t, zero where mask is zero; carries the gradient
    ratios_N: Tensor               # detached PPO ratios r at the unmasked tokens
    sums: dict[str, Tensor]        # SUM_STATS as 0-dim float64 tensors
    maxes: dict[str, Tensor]       # MAX_STATS as 0-dim float64 tensors


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


def policy_terms(logprobs: Tensor, anchor_logprobs: Tensor, behavior_logprobs: Tensor,
                 advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                 eps_clip_high: float = 0.2, tis_clip: float = 2.0, tis_clip_low: float = 0.0,
                 use_tis: bool = True) -> PolicyTerms:
    """Per-token PPO + TIS loss and the additive statistics behind the metrics."""
    adv_BT = _check_args(logprobs, anchor_logprobs, behavior_logprobs, advantages, mask,
                         eps_clip, eps_clip_high, tis_clip, tis_clip_low)
    mask_BT = mask.to(torch.bool)
    compute_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    theta_BT = logprobs.to(compute_dtype)
    # Masked positions may hold anything (padding, -inf): zero their differences so no
    # inf/nan leaks into the sums through 0 · inf.
    zero = torch.zeros((), dtype=compute_dtype, device=logprobs.device)
    anchor_BT = anchor_logprobs.detach().to(compute_dtype)
    log_ratio_BT = torch.where(mask_BT, theta_BT - anchor_BT, zero)
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = torch.where(mask_BT, adv_BT.detach().to(compute_dtype), zero)

    # Importance-weight statistics in float64: exp(a − b) can be large before clamping.
    ab_BT = torch.where(mask_BT, (anchor_logprobs.detach().double()
                                  - behavior_logprobs.detach().double()), 0.0)
    raw_w_BT = torch.exp(ab_BT)
    if use_tis:
        w_BT = raw_w_BT.clamp(min=tis_clip_low, max=tis_clip)
        tis_clipped_BT = (raw_w_BT > tis_clip) | (raw_w_BT < tis_clip_low)
    else:
        w_BT = torch.ones_like(raw_w_BT)
        tis_clipped_BT = torch.zeros_like(mask_BT)

    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)  # −min(r·A, clip(r)·A)
    token_loss_BT = torch.where(mask_BT, w_BT.to(compute_dtype) * pg_BT, zero)

    maskd = mask_BT.double()
    with torch.no_grad():
        ratios_N = ratio_BT.detach()[mask_BT].double()
        sums = {
            "tokens": maskd.sum(),
            "loss_sum": token_loss_BT.detach().double().sum(),
            "ppo_clipped": ((clipped_BT > unclipped_BT) & mask_BT).double().sum(),
            "tis_clipped": (tis_clipped_BT & mask_BT).double().sum(),
            "tis_w_sum": (w_BT * maskd).sum(),
            "tis_w_sq_sum": (w_BT * w_BT * maskd).sum(),
            "abs_mismatch_sum": ab_BT.abs().sum(),
            # k3 estimator of KL(behaviour ‖ anchor) from tokens sampled by the behaviour
            # policy: ρ − 1 − log ρ with ρ = exp(a − b). Unbiased and never negative.
            "kl_sum": ((raw_w_BT - 1.0 - ab_BT) * maskd).sum(),
        }
        ratio_max = ratios_N.max() if ratios_N.numel() else torch.zeros((), dtype=torch.float64)
        maxes = {"ratio_max": ratio_max}
    return PolicyTerms(token_loss_BT, ratios_N, sums, maxes)


def ratio_quantile(ratios_N: Tensor, q: float = 0.99) -> float:
    """The q-quantile of the PPO ratios (0.0 when there are none)."""
    if ratios_N.numel() == 0:
        return 0.0
    return float(torch.quantile(ratios_N.double().cpu(), q))


def metrics_from_stats(sums: Mapping[str, float], maxes: Mapping[str, float],
                       ratio_p99: float) -> dict[str, float]:
    """`train/*` metrics from (reduced) sums and maxima. All zeros when there are no tokens."""
    n = float(sums["tokens"])
    if n <= 0:
        return {"train/loss": 0.0, "train/ppo_clip_fraction": 0.0,
                "train/tis_clip_fraction": 0.0, "train/tis_ess_ratio": 0.0,
                "train/ratio_p99": 0.0, "train/ratio_max": 0.0,
                "train/logprob_mismatch": 0.0, "train/logprob_kl": 0.0}
    w_sum, w_sq = float(sums["tis_w_sum"]), float(sums["tis_w_sq_sum"])
    return {
        "train/loss": float(sums["loss_sum"]) / n,
        "train/ppo_clip_fraction": float(sums["ppo_clipped"]) / n,
        "train/tis_clip_fraction": float(sums["tis_clipped"]) / n,
        # (Σw)² / (N·Σw²): 1 when all weights are equal, → 1/N when one token dominates.
        "train/tis_ess_ratio": (w_sum * w_sum) / (n * w_sq) if w_sq > 0 else 0.0,
        "train/ratio_p99": float(ratio_p99),
        "train/ratio_max": float(maxes["ratio_max"]),
        "train/logprob_mismatch": float(sums["abs_mismatch_sum"]) / n,
        "train/logprob_kl": float(sums["kl_sum"]) / n,
    }


def policy_loss(logprobs: Tensor, anchor_logprobs: Tensor, behavior_logprobs: Tensor,
                advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                eps_clip_high: float = 0.2, tis_clip: float = 2.0, tis_clip_low: float = 0.0,
                use_tis: bool = True) -> tuple[Tensor, dict[str, float]]:
    """SPEC §8 loss on [batch, tokens] tensors: (token-mean loss, `train/*` metrics).

    `advantages` is [batch, tokens] or [batch] (broadcast over the tokens). `mask` is 1 at
    response tokens and 0 at prompt and padding. `anchor_logprobs` and `behavior_logprobs`
    are treated as constants. Metrics are plain floats:

    - `train/ppo_clip_fraction`: tokens where the clipped PPO term is the binding one;
    - `train/tis_clip_fraction`: tokens whose exp(a − b) lies outside [tis_clip_low, tis_clip];
    - `train/tis_ess_ratio`: (Σw)² / (N·Σw²) over the N unmasked tokens;
    - `train/ratio_p99`, `train/ratio_max`: tails of the PPO ratio r;
    - `train/logprob_mismatch`: mean |a − b|;
    - `train/logprob_kl`: mean k3 estimate of KL(behaviour ‖ anchor), exp(a−b) − 1 − (a−b).

    With no unmasked token the loss is 0 (still connected to `logprobs`) and metrics are 0.
    """
    terms = policy_terms(logprobs, anchor_logprobs, behavior_logprobs, advantages, mask,
                         eps_clip, eps_clip_high, tis_clip, tis_clip_low, use_tis)
    n_tokens = float(terms.sums["tokens"])
    loss = terms.token_loss_BT.sum() / max(n_tokens, 1.0)
    metrics = metrics_from_stats({k: float(v) for k, v in terms.sums.items()},
                                 {k: float(v) for k, v in terms.maxes.items()},
                                 ratio_quantile(terms.ratios_N))
    return loss, metrics
