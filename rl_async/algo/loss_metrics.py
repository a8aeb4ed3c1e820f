"""The loss's statistics and the `train/*` metrics built from them (SPEC §8).

Statistics are additive sums (reduce over micro-batches and ranks by plain addition) or
maxima, so data-parallel trainers report exact step metrics. The off-policy diagnostics
describe the behaviour gap `log ρ_t = a_t − b_t` (trainer's pre-update log-prob minus the
engine's), measured on the tokens sampled by the behaviour policy:

- `train/logprob_kl`: k3 estimate of KL(rollout ‖ trainer), E_b[ρ − 1 − log ρ];
- `train/kl_k3_trainer_rollout`: k3-style estimate of KL(trainer ‖ rollout),
  E_b[ρ log ρ − ρ + 1] (unbiased since E_b[ρ] = 1; every term >= 0);
- `train/logratio_over_ln2_fraction`: tokens with |log ρ| > ln 2 (AReaL's R3 metric);
- `train/logratio_m2`, `train/logratio_m2_kept`: E[(log ρ)²] over all tokens and over
  the tokens the correction kept (M2PO's quantity, before and after its mask);
- `train/masked_fraction` and `train/masked_fraction_adv_pos` / `_adv_neg`: tokens a mask
  rejected, overall and among the tokens of positive / negative advantage;
- `train/ppo_clip_fraction`: tokens where the loss's clip binds (the PPO / GSPO clip,
  CISPO's weight bound; M2PO has none);
- `train/tis_ess_ratio`: (Σc)² / (N·Σc²) of the correction weight c each token's gradient
  carries (the TIS weight for ppo_tis).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

# Additive statistics (reduce by sum over micro-batches and ranks).
SUM_STATS = (
    "tokens",            # N: unmasked response tokens
    "sequences",         # rows with at least one response token
    "loss_units",        # the loss's denominator: tokens, or sequences for GSPO
    "loss_sum",          # Σ L_t (before the denominator)
    "ppo_clipped",       # tokens where the loss's clip is the binding term
    "tis_clipped",       # tokens where exp(a − b) fell outside [tis_clip_low, tis_clip]
    "tis_w_sum",         # Σ c (correction weight)
    "tis_w_sq_sum",      # Σ c²
    "abs_mismatch_sum",  # Σ |a − b|
    "kl_sum",            # Σ ρ − 1 − log ρ
    "kl_tr_sum",         # Σ ρ log ρ − ρ + 1
    "over_ln2",          # tokens with |a − b| > ln 2
    "m2_sum",            # Σ (a − b)²
    "m2_kept_sum",       # Σ (a − b)² over kept tokens
    "kept",              # tokens no mask rejected
    "adv_pos", "adv_neg",        # tokens with A > 0, A < 0
    "masked_pos", "masked_neg",  # rejected tokens with A > 0, A < 0
)
# Statistics that reduce by max.
MAX_STATS = ("ratio_max",)
LN2 = math.log(2.0)


def gap_stats(log_rho_BT: Tensor, mask_BT: Tensor, kept_BT: Tensor, adv_BT: Tensor,
              weight_BT: Tensor) -> dict[str, Tensor]:
    """The diagnostics' sums for one batch. `log_rho_BT` (float64) is zero off the mask;
    `kept_BT` the tokens no mask rejected; `weight_BT` each token's correction weight."""
    m = mask_BT.double()
    rho_BT = torch.exp(log_rho_BT)
    m2_BT = log_rho_BT * log_rho_BT
    rejected_BT = mask_BT & ~kept_BT
    c_BT = weight_BT.double() * m
    return {
        "tokens": m.sum(),
        "sequences": (m.sum(-1) > 0).double().sum(),
        "tis_w_sum": c_BT.sum(),
        "tis_w_sq_sum": (c_BT * c_BT).sum(),
        "abs_mismatch_sum": (log_rho_BT.abs() * m).sum(),
        "kl_sum": ((rho_BT - 1.0 - log_rho_BT) * m).sum(),
        "kl_tr_sum": ((rho_BT * log_rho_BT - rho_BT + 1.0) * m).sum(),
        "over_ln2": ((log_rho_BT.abs() > LN2) & mask_BT).double().sum(),
        "m2_sum": (m2_BT * m).sum(),
        "m2_kept_sum": (m2_BT * kept_BT.double()).sum(),
        "kept": kept_BT.double().sum(),
        "adv_pos": ((adv_BT > 0) & mask_BT).double().sum(),
        "adv_neg": ((adv_BT < 0) & mask_BT).double().sum(),
        "masked_pos": ((adv_BT > 0) & rejected_BT).double().sum(),
        "masked_neg": ((adv_BT < 0) & rejected_BT).double().sum(),
    }


def ratio_quantile(ratios_N: Tensor, q: float = 0.99) -> float:
    """The q-quantile of the loss's ratios (0.0 when there are none)."""
    if ratios_N.numel() == 0:
        return 0.0
    return float(torch.quantile(ratios_N.double().cpu(), q))


METRIC_NAMES = (
    "train/loss", "train/ppo_clip_fraction", "train/tis_clip_fraction", "train/tis_ess_ratio",
    "train/ratio_p99", "train/ratio_max", "train/logprob_mismatch", "train/logprob_kl",
    "train/kl_k3_trainer_rollout", "train/logratio_over_ln2_fraction", "train/logratio_m2",
    "train/logratio_m2_kept", "train/masked_fraction", "train/masked_fraction_adv_pos",
    "train/masked_fraction_adv_neg",
)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def metrics_from_stats(sums: Mapping[str, float], maxes: Mapping[str, float],
                       ratio_p99: float) -> dict[str, float]:
    """`train/*` metrics from (reduced) sums and maxima. All zeros when there are no tokens."""
    n = float(sums["tokens"])
    if n <= 0:
        return {k: 0.0 for k in METRIC_NAMES}
    s = {k: float(sums.get(k, 0.0)) for k in SUM_STATS}
    w_sum, w_sq = s["tis_w_sum"], s["tis_w_sq_sum"]
    return {
        "train/loss": _ratio(s["loss_sum"], s["loss_units"]),
        "train/ppo_clip_fraction": s["ppo_clipped"] / n,
        "train/tis_clip_fraction": s["tis_clipped"] / n,
        # (Σc)² / (N·Σc²): 1 when all weights are equal, → 1/N when one token dominates.
        "train/tis_ess_ratio": _ratio(w_sum * w_sum, n * w_sq),
        "train/ratio_p99": float(ratio_p99),
        "train/ratio_max": float(maxes["ratio_max"]),
        "train/logprob_mismatch": s["abs_mismatch_sum"] / n,
        "train/logprob_kl": s["kl_sum"] / n,
        "train/kl_k3_trainer_rollout": s["kl_tr_sum"] / n,
        "train/logratio_over_ln2_fraction": s["over_ln2"] / n,
        "train/logratio_m2": s["m2_sum"] / n,
        "train/logratio_m2_kept": _ratio(s["m2_kept_sum"], s["kept"]),
        "train/masked_fraction": (n - s["kept"]) / n,
        "train/masked_fraction_adv_pos": _ratio(s["masked_pos"], s["adv_pos"]),
        "train/masked_fraction_adv_neg": _ratio(s["masked_neg"], s["adv_neg"]),
    }
