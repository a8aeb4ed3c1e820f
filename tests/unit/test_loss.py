"""PPO + TIS loss (SPEC §8) against hand-computed values."""

import math

import pytest
import torch

from rl_async.algo.loss import policy_loss

L = math.log


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_ppo_clipping_with_unit_tis_weight_matches_hand_computation():
    # Anchor == behaviour -> w = 1. Ratios 1.5 (A=+1, clipped at 1.2), 0.5 (A=-1, clipped at
    # 0.8), 1.1 (A=+1, inside), and a masked token that must not count.
    anchor = t([[-1.0, -2.0, -0.5, -3.0]])
    theta = (anchor + t([[L(1.5), L(0.5), L(1.1), 5.0]])).requires_grad_(True)
    adv = t([[1.0, -1.0, 1.0, 2.0]])
    mask = t([[1, 1, 1, 0]])
    loss, m = policy_loss(theta, anchor, anchor.clone(), adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1) / 3)
    assert m["train/ppo_clip_fraction"] == pytest.approx(2 / 3)
    assert m["train/tis_clip_fraction"] == 0.0
    assert m["train/tis_ess_ratio"] == pytest.approx(1.0)
    assert m["train/logprob_mismatch"] == 0.0
    assert m["train/logprob_kl"] == pytest.approx(0.0, abs=1e-12)
    assert m["train/ratio_max"] == pytest.approx(1.5)
    assert m["train/loss"] == pytest.approx(loss.item())
    loss.backward()
    # Clipped tokens and the masked token get no gradient; the inside one gets −w·r·A / N.
    assert theta.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1.1 / 3, 0.0])


def test_tis_cap_and_floor_engaged():
    behavior = t([[-1.0, -1.0, -1.0]])
    anchor = behavior + t([[L(3.0), L(0.1), L(1.5)]])   # raw weights 3, 0.1, 1.5
    theta = anchor.clone().requires_grad_(True)          # r = 1
    adv = t([1.0, 1.0, -1.0]).reshape(1, 3)
    mask = torch.ones(1, 3)
    loss, m = policy_loss(theta, anchor, behavior, adv, mask, tis_clip=2.0, tis_clip_low=0.2)
    w = [2.0, 0.2, 1.5]                                  # capped, floored, kept
    assert loss.item() == pytest.approx((-2.0 - 0.2 + 1.5) / 3)
    assert m["train/tis_clip_fraction"] == pytest.approx(2 / 3)
    assert m["train/tis_ess_ratio"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))
    assert m["train/logprob_mismatch"] == pytest.approx((L(3) + abs(L(0.1)) + L(1.5)) / 3)
    k3 = [rho - 1 - L(rho) for rho in (3.0, 0.1, 1.5)]
    assert m["train/logprob_kl"] == pytest.approx(sum(k3) / 3)
    assert m["train/ppo_clip_fraction"] == 0.0
    loss.backward()
    # w is detached: the gradient is −w·A·r / N per token.
    assert theta.grad.tolist()[0] == pytest.approx([-2.0 / 3, -0.2 / 3, 1.5 / 3])


def test_default_floor_zero_never_clips_small_weights():
    behavior = t([[0.0, 0.0]])
    anchor = t([[L(1e-3), L(2.5)]])
    _, m = policy_loss(anchor.clone(), anchor, behavior, t([1.0]), torch.ones(1, 2))
    assert m["train/tis_clip_fraction"] == pytest.approx(0.5)   # only the cap
    w = [1e-3, 2.0]
    assert m["train/tis_ess_ratio"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)))


def test_use_tis_false_gives_unit_weights():
    behavior = t([[0.0, 0.0]])
    anchor = t([[L(3.0), L(0.5)]])
    loss, m = policy_loss(anchor.clone(), anchor, behavior, t([1.0]), torch.ones(1, 2),
                          use_tis=False)
    assert loss.item() == pytest.approx(-1.0)
    assert m["train/tis_ess_ratio"] == pytest.approx(1.0)


def test_asymmetric_clip_high():
    anchor = t([[0.0, 0.0]])
    theta = anchor + t([[L(1.25), L(1.25)]])
    adv = t([1.0])
    loss_sym, m_sym = policy_loss(theta, anchor, anchor, adv, torch.ones(1, 2))
    loss_hi, m_hi = policy_loss(theta, anchor, anchor, adv, torch.ones(1, 2), eps_clip_high=0.28)
    assert loss_sym.item() == pytest.approx(-1.2) and m_sym["train/ppo_clip_fraction"] == 1.0
    assert loss_hi.item() == pytest.approx(-1.25) and m_hi["train/ppo_clip_fraction"] == 0.0


def test_mask_ignores_garbage_and_broadcasts_advantages():
    torch.manual_seed(0)
    theta = torch.randn(2, 5, dtype=torch.float64) - 2
    anchor = theta + 0.1 * torch.randn(2, 5, dtype=torch.float64)
    behavior = anchor + 0.3 * torch.randn(2, 5, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    adv_B = t([0.7, -1.3])
    loss, m = policy_loss(theta, anchor, behavior, adv_B, mask)
    # Garbage (−inf, nan) at masked positions changes nothing.
    bad = mask == 0
    loss2, m2 = policy_loss(theta.masked_fill(bad, float("nan")),
                            anchor.masked_fill(bad, -float("inf")),
                            behavior.masked_fill(bad, -float("inf")),
                            adv_B[:, None].expand(2, 5), mask)
    assert loss2.item() == pytest.approx(loss.item())
    assert m2 == pytest.approx(m)
    # Reference: an explicit per-token loop.
    total, n = 0.0, 0
    for i in range(2):
        for j in range(5):
            if mask[i, j]:
                w = min(max(math.exp(anchor[i, j] - behavior[i, j]), 0.0), 2.0)
                r = math.exp(theta[i, j] - anchor[i, j])
                a = adv_B[i].item()
                total += -w * min(r * a, min(max(r, 0.8), 1.2) * a)
                n += 1
    assert loss.item() == pytest.approx(total / n)
    ratios = torch.exp(theta - anchor)[mask.bool()]
    assert m["train/ratio_p99"] == pytest.approx(torch.quantile(ratios, 0.99).item())
    assert m["train/ratio_max"] == pytest.approx(ratios.max().item())


def test_empty_mask_gives_zero_loss_connected_to_graph():
    theta = torch.zeros(1, 3, requires_grad=True)
    loss, m = policy_loss(theta, torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1),
                          torch.zeros(1, 3))
    loss.backward()
    assert loss.item() == 0.0 and theta.grad is not None
    assert all(v == 0.0 for v in m.values())


def test_shape_and_setting_errors_name_the_argument():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="anchor_logprobs"):
        policy_loss(x, torch.zeros(1, 2), x, torch.ones(1), x)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, torch.ones(2), x)
    with pytest.raises(ValueError, match="tis_clip_low"):
        policy_loss(x, x, x, torch.ones(1), x, tis_clip_low=3.0)


def test_bf16_logprobs_compute_in_float32():
    theta = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(theta, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1),
                          torch.ones(1, 2))
    assert loss.dtype == torch.float32
    loss.backward()
    assert theta.grad.dtype == torch.bfloat16
