"""Off-policy corrections: which policy loss, and how the behaviour gap is weighted or masked.

Three log-probs per response token (SPEC §8): behaviour `b` (the engine's, at sampling),
anchor `a` (the trainer's pre-update weights; the *proximal* policy of decoupled PPO) and
current `θ`. `ρ_t = exp(a_t − b_t)` is the behaviour ratio: the gap that staleness and
engine/trainer mismatch open between the data and the trainer.

`train.policy_loss` picks the objective (rl_async/algo/loss.py):

| loss            | ratio           | behaviour weight `w` (detached)        | aggregation          |
|-----------------|-----------------|----------------------------------------|----------------------|
| `ppo_tis`       | exp(θ − a)      | clamp(ρ, tis_clip_low, tis_clip) (TIS) | token mean           |
| `decoupled_ppo` | exp(θ − a)      | ρ, untruncated (AReaL)                 | token mean           |
| `gspo`          | seq. geo. mean  | as ppo_tis                             | sequence mean        |
| `cispo`         | exp(θ − b)      | none: the ratio is against `b` already | token mean           |
| `m2po`          | exp(θ − b)      | none: the ratio is against `b` already | token mean, all tok. |

`train.is_mask` acts on `ρ` (Liu, Li et al. 2025, "When Speed Kills Stability",
richardli.xyz/rl-collapse; verl docs/algo/rollout_corr_math.md §3.3-3.5):

| mask        | accepts                                 | weight of an accepted token       |
|-------------|-----------------------------------------|-----------------------------------|
| `none`      | every token                             | the loss's `w`                    |
| `token_mis` | tokens with low <= ρ_t <= high          | ρ_t (masked IS: mask, not clamp)  |
| `seq_mis`   | sequences with low <= Π_t ρ_t <= high   | Π_t ρ_t (sequence masked IS)      |
| `icepop`    | tokens with α <= ρ_t <= β               | ρ_t (IcePop, Ring-1T 2510.18855)  |
| `geo_rs`    | sequences with low <= (Π ρ_t)^(1/T) <= high | the loss's `w` (Geo-RS[-Token-TIS]) |

With `cispo` and `m2po`, whose ratio already runs to the behaviour policy, a mask only
accepts or rejects (its 0/1 part); their weights are their own. Rejected tokens stay in the
denominator (they contribute zero), as AReaL does, so a mask never inflates the kept ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

POLICY_LOSSES = ("ppo_tis", "cispo", "gspo", "m2po", "decoupled_ppo")
IS_MASKS = ("none", "token_mis", "seq_mis", "icepop", "geo_rs")
# Losses whose ratio is exp(θ − b): the behaviour gap is inside the ratio itself.
BEHAVIOUR_RATIO_LOSSES = ("cispo", "m2po")
# Masks whose accepted tokens are weighted by the raw ratio (masked IS), not the loss's w.
MASKED_IS = ("token_mis", "seq_mis", "icepop")
# Each mask's (low, high) when train.is_mask_low / is_mask_high are omitted.
MASK_DEFAULTS = {
    "none": (0.0, math.inf),
    "token_mis": (0.0, 2.0),      # Liu, Li et al.: MIS with C = 2 (the TIS cap's value)
    "seq_mis": (0.0, 2.0),        # same C on the sequence ratio
    "icepop": (0.5, 5.0),         # IcePop's [α, β]
    "geo_rs": (0.999, 1.001),     # verl RolloutCorrectionConfig.decoupled_geo_rs()
}


@dataclass(frozen=True)
class Corrections:
    """The `train.*` keys that choose the loss and the mask; validated here, where they live.

    Thresholds: `gspo_eps_*` are GSPO's sequence clip range (paper §5.1: 3e-4, 4e-4);
    `cispo_ratio_*` bound CISPO's stop-gradient weight (one-sided (0, 4) as in ScaleRL and
    Tinker); `m2po_tau` is M2PO's second-moment budget (paper: 0.04)."""

    policy_loss: str = "ppo_tis"
    is_mask: str = "none"
    is_mask_low: float | None = None
    is_mask_high: float | None = None
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    cispo_ratio_low: float = 0.0
    cispo_ratio_high: float = 4.0
    m2po_tau: float = 0.04
    bounds: tuple[float, float] = field(init=False)

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"train.policy_loss = {self.policy_loss!r}: use one of "
                             f"{', '.join(POLICY_LOSSES)}")
        if self.is_mask not in IS_MASKS:
            raise ValueError(f"train.is_mask = {self.is_mask!r}: use one of {', '.join(IS_MASKS)}")
        low, high = MASK_DEFAULTS[self.is_mask]
        low = low if self.is_mask_low is None else float(self.is_mask_low)
        high = high if self.is_mask_high is None else float(self.is_mask_high)
        if not (0.0 <= low <= high):
            raise ValueError(f"train.is_mask_low = {low}, train.is_mask_high = {high} (is_mask "
                             f"= {self.is_mask!r}): need 0 <= is_mask_low <= is_mask_high")
        object.__setattr__(self, "bounds", (low, high))
        if not (0.0 <= self.gspo_eps_low < 1.0 and self.gspo_eps_high >= 0.0):
            raise ValueError(f"train.gspo_eps_low = {self.gspo_eps_low}, gspo_eps_high = "
                             f"{self.gspo_eps_high}: need 0 <= gspo_eps_low < 1, gspo_eps_high >= 0")
        if not (0.0 <= self.cispo_ratio_low <= self.cispo_ratio_high):
            raise ValueError(f"train.cispo_ratio_low = {self.cispo_ratio_low}, cispo_ratio_high "
                             f"= {self.cispo_ratio_high}: need 0 <= low <= high")
        if not self.m2po_tau > 0:
            raise ValueError(f"train.m2po_tau = {self.m2po_tau}: must be > 0 (0.04 in the paper)")

    @property
    def sequence_mean(self) -> bool:
        """GSPO averages per sequence (each sequence's token mean, then the mean over
        sequences); every other loss is a token mean over the step."""
        return self.policy_loss == "gspo"


def corrections_from(train) -> Corrections:
    """The Corrections of a `[train]` section."""
    return Corrections(
        policy_loss=train.policy_loss, is_mask=train.is_mask, is_mask_low=train.is_mask_low,
        is_mask_high=train.is_mask_high, gspo_eps_low=train.gspo_eps_low,
        gspo_eps_high=train.gspo_eps_high, cispo_ratio_low=train.cispo_ratio_low,
        cispo_ratio_high=train.cispo_ratio_high, m2po_tau=train.m2po_tau)


def sequence_sums(values_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row sum of `values` over the mask and the row's token count, both [B, 1]."""
    m = mask_BT.to(values_BT.dtype)
    return (values_BT * m).sum(-1, keepdim=True), m.sum(-1, keepdim=True)


def acceptance(corr: Corrections, log_rho_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The mask's accepted tokens (bool [B, T], False off the response).

    `log_rho_BT` = a − b (float64, zero off the mask). Comparisons run in log space, so a
    long sequence's Π ρ_t never overflows."""
    kind = corr.is_mask
    if kind == "none":
        return mask_BT.clone()
    low, high = corr.bounds
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high < math.inf else math.inf
    if kind in ("token_mis", "icepop"):
        stat_BT = log_rho_BT
    else:
        total_B1, count_B1 = sequence_sums(log_rho_BT, mask_BT)
        stat_B1 = total_B1 if kind == "seq_mis" else total_B1 / count_B1.clamp(min=1.0)
        stat_BT = stat_B1.expand_as(log_rho_BT)
    return mask_BT & (stat_BT >= log_low) & (stat_BT <= log_high)


def behaviour_weight(corr: Corrections, log_rho_BT: Tensor, mask_BT: Tensor, use_tis: bool,
                     tis_clip: float, tis_clip_low: float) -> tuple[Tensor, Tensor]:
    """(w, accepted): the detached float64 weight on each token's loss and the mask's
    acceptance. `w` is zero where rejected; for cispo / m2po it is the 0/1 acceptance only.
    """
    accepted_BT = acceptance(corr, log_rho_BT, mask_BT)
    zero = torch.zeros((), dtype=log_rho_BT.dtype, device=log_rho_BT.device)
    if corr.policy_loss in BEHAVIOUR_RATIO_LOSSES:
        return accepted_BT.to(log_rho_BT.dtype), accepted_BT
    if corr.is_mask in MASKED_IS:
        if corr.is_mask == "seq_mis":
            total_B1, _ = sequence_sums(log_rho_BT, mask_BT)
            log_w_BT = total_B1.expand_as(log_rho_BT)
        else:
            log_w_BT = log_rho_BT
        # exp only where accepted (bounded by the mask's high), so no inf reaches the loss
        return torch.exp(torch.where(accepted_BT, log_w_BT, zero)) * accepted_BT, accepted_BT
    rho_BT = torch.exp(log_rho_BT)
    if corr.policy_loss == "decoupled_ppo":
        w_BT = rho_BT
    elif use_tis:
        w_BT = rho_BT.clamp(min=tis_clip_low, max=tis_clip)
    else:
        w_BT = torch.ones_like(rho_BT)
    return w_BT * accepted_BT, accepted_BT


def m2po_keep(log_rho_BT: Tensor, mask_BT: Tensor, tau: float) -> Tensor:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv
    2510.01161, Algorithm 1; AReaL docs/en/algorithms/m2po.md): drop the tokens of largest
    M2_t = (log ρ_t)² until the mean M2 of those kept is at most τ. Ties at the cut are
    dropped together. Computed over the tokens given (one micro-batch, as AReaL does)."""
    m2_N = (log_rho_BT[mask_BT]) ** 2
    keep_BT = mask_BT.clone()
    n = m2_N.numel()
    if n == 0:
        return keep_BT
    sorted_N, _ = torch.sort(m2_N, descending=True)
    suffix_mean_N = sorted_N.flip(0).cumsum(0).flip(0) / torch.arange(
        n, 0, -1, dtype=sorted_N.dtype, device=sorted_N.device)
    within = torch.nonzero(suffix_mean_N <= tau)
    # k = how many of the largest to drop; none within budget: keep only the smallest one
    k = int(within[0]) if within.numel() else n - 1
    if k == 0:
        return keep_BT
    cut = sorted_N[k - 1]
    return keep_BT & ~((log_rho_BT ** 2) >= cut)
