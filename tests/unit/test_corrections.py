"""Each train.policy_loss and train.is_mask against a literal transcription of its paper's
formula, written with per-token Python loops on random tensors (1e-6), plus a float64
gradient check (torch.autograd.gradcheck). The references share no code with
rl_async/algo/loss.py or corrections.py."""

import math

import pytest
import torch

from rl_async.algo.corrections import Corrections
from rl_async.algo.loss import policy_loss

EPS, EPS_HIGH, TIS, TIS_LOW = 0.2, 0.28, 2.0, 0.0


def batch(seed: int, spread: float = 0.4, rows: int = 5, cols: int = 7):
    """Random log-probs with rows of different lengths; padding holds garbage (-inf, nan)
    that must not leak into anything."""
    g = torch.Generator().manual_seed(seed)
    anchor = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3 - 0.05
    behavior = anchor - spread * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    theta = anchor + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = [cols, cols - 2, 3, cols - 1, 1][:rows]
    mask = torch.zeros(rows, cols, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    pad = mask == 0
    theta = theta.masked_fill(pad, float("nan"))
    behavior = behavior.masked_fill(pad, -math.inf)
    return theta, anchor, behavior, adv, mask


def tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def ppo_term(r, adv, lo=1 - EPS, hi=1 + EPS_HIGH):
    """min(r·A, clip(r, lo, hi)·A) on scalars (r a 0-dim tensor, so it keeps its gradient)."""
    return torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)


# ---------------------------------------------------------------- literal references
def ref_ppo_tis(theta, a, b, adv, mask):
    """SPEC §8: L = −1/N Σ clamp(exp(a−b), low, cap)·min(r·A, clip(r)·A), r = exp(θ−a)."""
    terms = [clip(math.exp(a[i, t] - b[i, t]), TIS_LOW, TIS)
             * ppo_term(torch.exp(theta[i, t] - a[i, t]), adv[i]) for i, t in tokens(mask)]
    return -sum(terms) / len(terms)


def ref_decoupled(theta, a, b, adv, mask):
    """AReaL eq. 5: J = E[π_prox/π_behav · min(u·A, clip(u, 1−ε, 1+ε)·A)], u = π_θ/π_prox."""
    terms = [math.exp(a[i, t] - b[i, t]) * ppo_term(torch.exp(theta[i, t] - a[i, t]), adv[i])
             for i, t in tokens(mask)]
    return -sum(terms) / len(terms)


def ref_gspo(theta, a, adv, mask, eps_low=3e-4, eps_high=4e-4):
    """GSPO eq. 5: J = 1/G Σ_i min(s_i·A_i, clip(s_i, 1−ε_l, 1+ε_h)·A_i),
    s_i = (π_θ(y_i|x)/π_old(y_i|x))^(1/|y_i|)."""
    total = 0
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    for i in rows:
        ts = [t for t in range(mask.shape[1]) if mask[i, t]]
        log_ratio = sum(theta[i, t] - a[i, t] for t in ts)          # log π_θ(y)/π_old(y)
        s = torch.exp(log_ratio / len(ts))
        total = total + ppo_term(s, adv[i], 1 - eps_low, 1 + eps_high)
    return -total / len(rows)


def ref_cispo(theta, b, adv, mask, low=0.0, high=4.0, accept=None):
    """MiniMax-M1 eq. 4: J = 1/Σ|o| Σ sg(clip(r, low, high))·Â·log π_θ, r = π_θ/π_behav."""
    terms = []
    for i, t in tokens(mask):
        coeff = clip(math.exp(float(theta[i, t].detach()) - b[i, t]), low, high)  # sg()
        gate = 1.0 if accept is None else accept(i, t)
        terms.append(gate * coeff * adv[i] * theta[i, t])
    return -sum(terms) / len(terms)


def ref_m2po(theta, a, b, adv, mask, tau=0.04):
    """M2PO, Algorithm 1: M2 = mean (log π/π_behav)² at the pre-update weights; mask the
    token of largest M2_t while the kept mean exceeds τ; J = 1/Σ|o| Σ M·π_θ/π_behav·A."""
    toks = tokens(mask)
    m2 = {k: (a[k] - b[k]) ** 2 for k in toks}
    kept = set(toks)
    while len(kept) > 1 and sum(m2[k] for k in kept) / len(kept) > tau:
        kept.remove(max(kept, key=lambda k: m2[k]))
    terms = [torch.exp(theta[k] - b[k]) * adv[k[0]] for k in toks if k in kept]
    return -sum(terms) / len(toks)


def ref_masked(theta, a, b, adv, mask, weight):
    """PPO with a per-token behaviour weight from a mask's formula; −1/N Σ weight·min(...)."""
    terms = [weight(i, t) * ppo_term(torch.exp(theta[i, t] - a[i, t]), adv[i])
             for i, t in tokens(mask)]
    return -sum(terms) / len(terms)


def seq_log_rho(a, b, mask, i):
    return sum(float(a[i, t] - b[i, t]) for t in range(mask.shape[1]) if mask[i, t])


def token_mis(a, b, mask, low, high):
    """Liu, Li et al. token MIS: ρ_t·1[low <= ρ_t <= high]."""
    def w(i, t):
        rho = math.exp(a[i, t] - b[i, t])
        return rho if low <= rho <= high else 0.0
    return w


def seq_mis(a, b, mask, low, high):
    """Seq-MIS: ρ(y)·1[low <= ρ(y) <= high], ρ(y) = Π_t ρ_t, on every token of y."""
    def w(i, t):
        rho = math.exp(seq_log_rho(a, b, mask, i))
        return rho if low <= rho <= high else 0.0
    return w


def geo_rs(a, b, mask, low, high):
    """Geo-RS-Token-TIS: 1[low <= (Π ρ_t)^(1/|y|) <= high]·clamp(ρ_t, TIS)."""
    def w(i, t):
        geo = math.exp(seq_log_rho(a, b, mask, i) / float(mask[i].sum()))
        inside = low <= geo <= high
        return clip(math.exp(a[i, t] - b[i, t]), TIS_LOW, TIS) if inside else 0.0
    return w


# ---------------------------------------------------------------- the comparisons
def ours(theta, a, b, adv, mask, **corr):
    return policy_loss(theta, a, b, adv, mask, eps_clip=EPS, eps_clip_high=EPS_HIGH,
                       tis_clip=TIS, tis_clip_low=TIS_LOW, corrections=Corrections(**corr))


def check(reference, seed, spread=0.4, **corr):
    """Value and gradient against the reference at 1e-6; gradcheck of ours in float64."""
    theta, a, b, adv, mask = batch(seed, spread)
    th = theta.clone().requires_grad_(True)
    loss, metrics = ours(th, a, b, adv, mask, **corr)
    loss.backward()
    th_ref = torch.nan_to_num(theta).requires_grad_(True)
    want = reference(th_ref, a, b, adv, mask)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6, rel=1e-6)
    assert metrics["train/loss"] == pytest.approx(want.item(), abs=1e-6, rel=1e-6)
    live = mask.bool()
    assert torch.allclose(th.grad[live], th_ref.grad[live], atol=1e-6, rtol=1e-6)
    assert torch.all(th.grad[~live] == 0)
    clean = torch.nan_to_num(theta).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: ours(x, a, b, adv, mask, **corr)[0], (clean,))
    return metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_tis_matches_spec(seed):
    check(ref_ppo_tis, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_ppo_matches_areal(seed):
    check(ref_decoupled, seed, policy_loss="decoupled_ppo")


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_paper_sequence_objective(seed):
    # The paper's objective has no behaviour weight: on-policy data (b = a) shows it whole.
    def ref(theta, a, b, adv, mask):
        return ref_gspo(theta, a, adv, mask, 0.05, 0.05)
    theta, a, _, adv, mask = batch(seed)
    for eps in ((3e-4, 4e-4), (0.05, 0.05)):  # tight (mostly clipped) and loose
        th = theta.clone().requires_grad_(True)
        loss, m = ours(th, a, a.clone(), adv, mask, policy_loss="gspo",
                       gspo_eps_low=eps[0], gspo_eps_high=eps[1])
        loss.backward()
        th_ref = torch.nan_to_num(theta).requires_grad_(True)
        want = ref_gspo(th_ref, a, adv, mask, *eps)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), abs=1e-6)
        live = mask.bool()
        assert torch.allclose(th.grad[live], th_ref.grad[live], atol=1e-6)
    check(ref, seed, spread=0.0, policy_loss="gspo", gspo_eps_low=0.05, gspo_eps_high=0.05)


@pytest.mark.parametrize("seed", [0, 1])
def test_cispo_matches_minimax_formula_and_gradient(seed):
    theta, a, b, adv, mask = batch(seed, spread=1.2)
    th = theta.clone().requires_grad_(True)
    loss, m = ours(th, a, b, adv, mask, policy_loss="cispo")
    loss.backward()
    clean = torch.nan_to_num(theta)
    th_ref = clean.clone().requires_grad_(True)
    want = ref_cispo(th_ref, b, adv, mask)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    live = mask.bool()
    assert torch.allclose(th.grad[live], th_ref.grad[live], atol=1e-6)
    assert 0 < m["train/ppo_clip_fraction"] < 1  # some weights hit the bound 4
    # sg() makes the weight a constant: gradcheck the surrogate with it frozen at θ0, whose
    # autograd gradient ours matched above.
    frozen = {k: clip(math.exp(clean[k] - b[k]), 0.0, 4.0) for k in tokens(mask)}

    def surrogate(x):
        return -sum(frozen[k] * adv[k[0]] * x[k] for k in tokens(mask)) / len(frozen)
    assert torch.autograd.gradcheck(surrogate, (clean.clone().requires_grad_(True),))


@pytest.mark.parametrize("seed,spread", [(0, 0.4), (1, 0.15), (2, 1.0)])
def test_m2po_matches_algorithm_1(seed, spread):
    m = check(ref_m2po, seed, spread, policy_loss="m2po")
    assert m["train/logratio_m2_kept"] <= 0.04 + 1e-12
    if m["train/logratio_m2"] > 0.04:
        assert m["train/masked_fraction"] > 0


@pytest.mark.parametrize("kind,low,high,weight", [
    ("token_mis", 0.0, 2.0, token_mis), ("icepop", 0.5, 5.0, token_mis),
    ("seq_mis", 0.0, 2.0, seq_mis), ("geo_rs", 0.8, 1.25, geo_rs)])
def test_masks_match_their_formulas(kind, low, high, weight):
    any_rejected = any_accepted = False  # the seeds together exercise both
    for seed in (0, 1, 2):
        theta, a, b, adv, mask = batch(seed, spread=0.6)
        w = weight(a, b, mask, low, high)
        rejected = [k for k in tokens(mask) if w(*k) == 0.0]
        any_rejected |= bool(rejected)
        any_accepted |= len(rejected) < len(tokens(mask))
        explicit = {} if kind in ("token_mis", "icepop", "seq_mis") else {
            "is_mask_low": low, "is_mask_high": high}
        m = check(lambda th, a_, b_, adv_, m_: ref_masked(th, a_, b_, adv_, m_, w), seed, 0.6,
                  is_mask=kind, **explicit)
        assert m["train/masked_fraction"] == pytest.approx(len(rejected) / len(tokens(mask)))
    assert any_rejected and any_accepted


def test_a_mask_only_gates_losses_whose_ratio_is_against_behaviour():
    theta, a, b, adv, mask = batch(3, spread=0.6)

    def accept(i, t):
        return 1.0 if 0.5 <= math.exp(a[i, t] - b[i, t]) <= 5.0 else 0.0
    th = theta.clone().requires_grad_(True)
    loss, _ = ours(th, a, b, adv, mask, policy_loss="cispo", is_mask="icepop")
    want = ref_cispo(torch.nan_to_num(theta), b, adv, mask, accept=accept)
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)


def test_diagnostics_by_hand():
    L = math.log
    a = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    b = a - torch.tensor([[L(3.0), L(1.5), L(0.4), 0.0]], dtype=torch.float64)  # ρ = 3, 1.5, .4, 1
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    _, m = ours(a.clone(), a, b, adv, torch.ones(1, 4), is_mask="token_mis")
    rhos = [3.0, 1.5, 0.4, 1.0]
    assert m["train/kl_k3_trainer_rollout"] == pytest.approx(
        sum(r * L(r) - r + 1 for r in rhos) / 4)
    assert m["train/logprob_kl"] == pytest.approx(sum(r - 1 - L(r) for r in rhos) / 4)
    assert m["train/logratio_over_ln2_fraction"] == pytest.approx(2 / 4)  # 3 and 0.4
    assert m["train/logratio_m2"] == pytest.approx(sum(L(r) ** 2 for r in rhos) / 4)
    assert m["train/logratio_m2_kept"] == pytest.approx(sum(L(r) ** 2 for r in rhos[1:]) / 3)
    assert m["train/masked_fraction"] == pytest.approx(1 / 4)        # ρ = 3 > 2
    assert m["train/masked_fraction_adv_pos"] == pytest.approx(1 / 2)
    assert m["train/masked_fraction_adv_neg"] == 0.0
    w = [0.0, 1.5, 0.4, 1.0]
    assert m["train/tis_ess_ratio"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))


@pytest.mark.parametrize("kwargs,key", [
    ({"policy_loss": "ppo"}, "train.policy_loss"), ({"is_mask": "tis"}, "train.is_mask"),
    ({"is_mask": "icepop", "is_mask_low": 6.0}, "train.is_mask_low"),
    ({"m2po_tau": 0.0}, "train.m2po_tau"),
    ({"cispo_ratio_low": 5.0}, "train.cispo_ratio_low")])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Corrections(**kwargs)
