"""Torch trainer backend on a tiny Llama: anchors, batching, steps, checkpoints, export."""

import math
import random

import pytest
import torch

from rl_async.algo.advantages import group_advantages
from rl_async.algo.loss import policy_loss
from rl_async.state.models import build_causal_lm
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig
from rl_async.base.types import Group, Sample
from rl_async.state.weights import (bucket_named_tensors, flatten_bucket, unflatten_bucket,
                                    weights_checksum)

torch.set_num_threads(1)

TINY = dict(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)


def make_groups(n_groups=2, group_size=4, seed=0, version=0):
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        for s in range(group_size):
            prompt = [rng.randrange(32) for _ in range(rng.randint(2, 5))]
            resp = [rng.randrange(32) for _ in range(rng.randint(1, 6))]
            samples.append(Sample(prompt_id=f"p{g}", prompt_ids=prompt, response_ids=resp,
                                  behavior_logprobs=[-3.0] * len(resp),
                                  token_versions=[version] * len(resp), reward=float(s % 2)))
        groups.append(Group(f"p{g}", samples))
    return groups


def samples_of(groups):
    return [s for g in groups for s in g.samples]


def set_behavior_from(trainer, groups, offset=0.0):
    for s, lp in zip(samples_of(groups), trainer.score(groups)):
        s.behavior_logprobs = [x + offset for x in lp]


def make(**kw):
    base = dict(hf_config=TINY, lr=1e-2, global_batch_size=8, micro_batch_size=4, device="cpu")
    base.update(kw)
    return TorchTrainer(TorchTrainerConfig(**base))


def grads(trainer):
    """Gradients of the last optimizer step (AdamW's sign-like first update would amplify
    rounding noise, so data-parallel and accumulation tests compare gradients)."""
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_anchor_is_trainer_scoring_and_behavior_is_never_replaced():
    trainer = make()
    groups = make_groups()
    set_behavior_from(trainer, groups, offset=-0.5)
    before = [list(s.behavior_logprobs) for s in samples_of(groups)]
    m = trainer.train_collection(groups, policy_version=0)
    # One optimizer step: the ratio is exactly 1 at the pre-update anchor.
    assert m["train/optimizer_steps"] == 1
    assert m["train/ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert m["train/ppo_clip_fraction"] == 0.0
    # a − b = 0.5 on every token: the mismatch metric sees the engine's values.
    assert m["train/logprob_mismatch"] == pytest.approx(0.5, abs=1e-5)
    assert [s.behavior_logprobs for s in samples_of(groups)] == before
    assert m["train/response_tokens"] == sum(s.response_len for s in samples_of(groups))
    assert trainer.step == 1


def test_one_step_collection_reuses_its_forward_as_the_anchor(monkeypatch):
    """A collection trained in one optimizer step skips the scoring pass (a third of the
    step): its anchor is the training forward detached, which must give the update a
    separately scored anchor gives. With two steps per collection, scoring still runs."""
    groups = make_groups()
    reference = make()
    set_behavior_from(reference, groups, offset=-0.3)
    scored = make()  # same init: anchors scored the old way, before the step
    real_prepare = scored._prepare

    def prepare_with_scored_anchors(gs):
        items = real_prepare(gs)
        for it, anchor in zip(items, scored._score_items(items)):
            it.anchor_logprobs = anchor
        return items

    monkeypatch.setattr(scored, "_prepare", prepare_with_scored_anchors)
    calls = []
    real_score = reference._score_items
    monkeypatch.setattr(reference, "_score_items", lambda items: calls.append(1)
                        or real_score(items))
    m_ref = reference.train_collection(groups, policy_version=0)
    m_scored = scored.train_collection(groups, policy_version=0)
    assert calls == []  # no scoring pass for a one-step collection
    assert m_ref["train/ratio_max"] == 1.0  # exactly: a is this very forward
    assert m_ref["train/logprob_mismatch"] == pytest.approx(m_scored["train/logprob_mismatch"],
                                                             abs=1e-6)
    for name, p in params(reference).items():
        torch.testing.assert_close(p, params(scored)[name], atol=1e-6, rtol=1e-5)
    two_steps = make(global_batch_size=4, micro_batch_size=4)
    real_two = two_steps._score_items
    monkeypatch.setattr(two_steps, "_score_items", lambda items: calls.append(1)
                        or real_two(items))
    assert two_steps.train_collection(groups, policy_version=0)["train/optimizer_steps"] == 2
    assert calls == [1]  # the anchor is scored once, before the first of the two steps


def test_use_rollout_logprobs_takes_anchor_from_behavior():
    trainer = make(use_rollout_logprobs=True)
    groups = make_groups()
    set_behavior_from(trainer, groups, offset=-0.5)
    m = trainer.train_collection(groups, policy_version=0)
    assert m["train/logprob_mismatch"] == 0.0
    # Anchor = behaviour = pre-update scores − 0.5, so r = exp(0.5) on every token.
    assert m["train/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-4)


def test_temperature_scales_logits():
    trainer = make(temperature=2.0)
    groups = make_groups(n_groups=1, group_size=1)
    s = groups[0].samples[0]
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0].float() / 2.0
    ref = torch.log_softmax(logits, -1)
    P = len(s.prompt_ids)
    expected = [ref[P - 1 + j, tok].item() for j, tok in enumerate(s.response_ids)]
    assert trainer.score(groups)[0] == pytest.approx(expected, abs=1e-5)


def test_padding_does_not_change_scores():
    trainer = make(micro_batch_size=8)
    groups = make_groups(n_groups=2, group_size=4, seed=3)
    batched = trainer.score(groups)
    single = [trainer.score([Group("x", [s])])[0] for s in samples_of(groups)]
    for a, b in zip(batched, single):
        assert a == pytest.approx(b, abs=1e-5)


def test_stale_token_fraction_from_recorded_versions():
    trainer = make()
    groups = make_groups()
    set_behavior_from(trainer, groups)
    all_s = samples_of(groups)
    for i, s in enumerate(all_s):
        s.token_versions = [i % 3] * s.response_len      # versions 0, 1, 2
    all_s[0].token_versions = []                          # unknown: excluded
    known = [s for s in all_s if s.token_versions]
    stale = sum(s.response_len for s in known if s.token_versions[0] < 2)
    m = trainer.train_collection(groups, policy_version=2)
    assert m["train/stale_token_fraction"] == pytest.approx(
        stale / sum(s.response_len for s in known))


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    groups = make_groups(seed=5)
    results = []
    for micro in (1, 3, 8):
        trainer = make(micro_batch_size=micro, lr=1e-3)
        set_behavior_from(trainer, groups, offset=-0.2)
        m = trainer.train_collection(groups, policy_version=0)
        results.append((grads(trainer), m))
    (g_ref, m_ref) = results[0]
    for g, m in results[1:]:
        for name in g_ref:
            torch.testing.assert_close(g[name], g_ref[name], atol=1e-6, rtol=1e-4)
        assert m["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
        assert m["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-5)


def test_steps_per_collection_and_partial_last_step():
    trainer = make(global_batch_size=3, micro_batch_size=2)
    groups = make_groups()                                # 8 samples -> steps of 3, 3, 2
    set_behavior_from(trainer, groups)
    m = trainer.train_collection(groups, policy_version=0)
    assert m["train/optimizer_steps"] == 3 and trainer.step == 3


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss():
    # Anchor fixed at the initial weights (use_rollout_logprobs with behaviour = initial
    # scores), so every collection's reported loss is the same objective at the weights
    # before its step, and a last external evaluation measures the weights after.
    clip = dict(eps_clip=0.9, eps_clip_high=5.0)
    trainer = make(use_rollout_logprobs=True, lr=1e-3, **clip)
    groups = make_groups(seed=7)
    set_behavior_from(trainer, groups)
    anchor = [list(s.behavior_logprobs) for s in samples_of(groups)]
    losses = [trainer.train_collection(groups, policy_version=0)["train/loss"]
              for _ in range(4)]

    rows = trainer.score(groups)
    T = max(len(r) for r in rows)
    pad = lambda xs: torch.tensor([list(x) + [0.0] * (T - len(x)) for x in xs])
    mask = pad([[1.0] * len(r) for r in rows])
    adv = torch.tensor([a for adv in group_advantages(groups) for a in adv])
    a = pad(anchor)
    losses.append(policy_loss(pad(rows), a, a, adv, mask, **clip)[0].item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses


def test_checkpoint_round_trip_resumes_identically(tmp_path):
    def train(trainer, seeds):
        for seed in seeds:
            groups = make_groups(seed=seed)
            set_behavior_from(trainer, groups, offset=-0.1)
            trainer.train_collection(groups, policy_version=seed)

    a = make(lr=1e-2)
    train(a, [0, 1])
    path = a.save_checkpoint(tmp_path / "ck", extra={"cursor": 17})
    assert path and not list((tmp_path / "ck").glob(".*tmp*"))
    train(a, [2, 3])

    b = make(lr=1e-2, seed=123)                          # different init: load must overwrite
    assert b.load_checkpoint(tmp_path / "ck") == {"cursor": 17}
    assert (b.step, b.policy_version) == (2, 1)
    train(b, [2, 3])
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert b.step == a.step == 4


def test_load_checkpoint_missing_dir_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="trainer_state.pt"):
        make().load_checkpoint(tmp_path / "nope")


def test_publication_names_order_and_buckets():
    trainer = make()
    named = trainer.named_tensors_for_publication()
    hf_names = [n for n, _ in build_causal_lm(TINY, None, 0, "float32").named_parameters()]
    assert [n for n, _ in named] == hf_names
    assert all(not t.requires_grad for _, t in named)
    # the codec the sender uses (rl_async/state/weights.py), on the trainer's tensors
    buckets = [flatten_bucket(b) for b in bucket_named_tensors(named, 8192)]
    assert len(buckets) > 1
    rebuilt = [pair for b in buckets for pair in unflatten_bucket(*b)]
    assert [n for n, _ in rebuilt] == hf_names
    assert weights_checksum(rebuilt) == weights_checksum(named)
    for flat, names, _, _ in buckets:
        assert flat.numel() <= 8192 or len(names) == 1
    bf16 = trainer.named_tensors_for_publication("bfloat16")
    assert all(t.dtype == torch.bfloat16 for _, t in bf16)
    # Same seed and spec on the engine side gives the same initial weights.
    engine_model = build_causal_lm(TINY, None, 0, "bfloat16")
    assert weights_checksum(engine_model.named_parameters()) == weights_checksum(bf16)


def test_bad_inputs_raise_with_names():
    trainer = make()
    groups = make_groups()
    groups[1].samples[2].behavior_logprobs = [0.0]
    groups[1].samples[2].response_ids = [1, 2]
    with pytest.raises(ValueError, match=r"group 'p1' sample 2: 1 behavior_logprobs for 2"):
        trainer.train_collection(groups, 0)
    with pytest.raises(ValueError, match="not divisible"):
        TorchTrainer(TorchTrainerConfig(hf_config=TINY, global_batch_size=3), 0, 2)
    with pytest.raises(ValueError, match="advantage estimator 'nope'"):
        TorchTrainerConfig(hf_config=TINY, advantage_estimator="nope")
    with pytest.raises(ValueError, match="temperature"):
        TorchTrainerConfig(hf_config=TINY, temperature=0.0)


def test_cosine_schedule_is_a_pure_function_of_the_step():
    from rl_async.train.torch_trainer import TorchTrainerConfig, lr_at

    cfg = TorchTrainerConfig(hf_config={"model_type": "llama"}, lr=1.0, lr_schedule="cosine",
                             total_steps=10, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(1.0)
    assert lr_at(cfg, 5) == pytest.approx(0.55)
    assert lr_at(cfg, 10) == pytest.approx(0.1) == lr_at(cfg, 50)
    flat = TorchTrainerConfig(hf_config={"model_type": "llama"}, lr=0.5)
    assert lr_at(flat, 7) == 0.5
    with pytest.raises(ValueError, match="total_steps"):
        TorchTrainerConfig(hf_config={"model_type": "llama"}, lr_schedule="cosine")


@pytest.mark.parametrize("loss_name", ["ppo_tis", "decoupled_ppo", "gspo", "cispo", "m2po"])
def test_the_configured_loss_is_the_one_trained(loss_name):
    """The trainer's step is the configured loss over the whole step's tokens (GSPO: its
    sequences), whatever the micro-batches: same loss value and gradient as one call of
    policy_loss on the full batch (micro_batch_size = the step, so M2PO's micro-batch mask
    is the batch's)."""
    from rl_async.algo.corrections import Corrections

    corr = Corrections(policy_loss=loss_name, gspo_eps_low=0.05, gspo_eps_high=0.05)
    trainer = make(corrections=corr, micro_batch_size=8)
    groups = make_groups(seed=3)
    rng = random.Random(0)
    for s, lp in zip(samples_of(groups), trainer.score(groups)):
        s.behavior_logprobs = [x - rng.uniform(-0.8, 0.8) for x in lp]
    rows = trainer.score(groups)
    T = max(len(r) for r in rows)
    pad = lambda xs: torch.tensor([list(x) + [0.0] * (T - len(x)) for x in xs],
                                  dtype=torch.float32)
    mask = pad([[1.0] * len(r) for r in rows])
    adv = torch.tensor([a for adv in group_advantages(groups) for a in adv])
    b = pad([s.behavior_logprobs for s in samples_of(groups)])
    want, _ = policy_loss(pad(rows), pad(rows), b, adv, mask, corrections=corr)
    m = trainer.train_collection(groups, policy_version=0)
    assert m["train/loss"] == pytest.approx(want.item(), rel=1e-4, abs=1e-6)
    others = [policy_loss(pad(rows), pad(rows), b, adv, mask,
                          corrections=Corrections(policy_loss=o, gspo_eps_low=0.05,
                                                  gspo_eps_high=0.05))[0].item()
              for o in ("ppo_tis", "gspo", "cispo", "m2po") if o != loss_name]
    assert all(abs(o - want.item()) > 1e-4 for o in others)  # the losses differ here
