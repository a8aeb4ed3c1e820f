"""Zero-advantage samples (a group whose rewards are all equal) are not run by the torch
trainer: the update and the gradient equal running them (batching.contributing)."""

import random

import pytest
import torch

from rl_async.algo.advantages import group_normalized, mean_only
from rl_async.base.types import Group, Sample
from rl_async.state.models import cache_kwarg
from rl_async.train import torch_trainer
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

torch.set_num_threads(1)

TINY = dict(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)


def groups_with(rewards_per_group, seed=0):
    rng = random.Random(seed)
    out = []
    for g, rewards in enumerate(rewards_per_group):
        prompt = [rng.randrange(32) for _ in range(rng.randint(2, 5))]
        samples = []
        for r in rewards:
            n = rng.randint(1, 6)
            samples.append(Sample(f"p{g}", prompt_ids=list(prompt),
                                  response_ids=[rng.randrange(32) for _ in range(n)],
                                  behavior_logprobs=[-3.3] * n, token_versions=[0] * n,
                                  reward=r))
        out.append(Group(f"p{g}", samples))
    return out


def train(collections, skip, monkeypatch, **kw):
    """Params, grads and metrics after training on `collections` in turn."""
    with monkeypatch.context() as m:
        if not skip:
            m.setattr(torch_trainer, "contributing", lambda items: list(items))
        config = dict(hf_config=TINY, lr=1e-2, global_batch_size=8, micro_batch_size=4,
                      device="cpu")
        trainer = TorchTrainer(TorchTrainerConfig(**{**config, **kw}))
        cache_kwarg(trainer.model)  # resolved off the real forward's signature, before the wrap
        rows = []
        forward = trainer.model.forward

        def counting(*args, **kwargs):
            rows.append(kwargs["input_ids"].shape[0])
            return forward(*args, **kwargs)

        trainer.model.forward = counting
        metrics = [trainer.train_collection(c, policy_version=0) for c in collections]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, grads, metrics, sum(rows)


@pytest.mark.parametrize("kw", [{}, {"global_batch_size": 4}])  # one step, and two (anchor)
def test_skipping_zero_advantage_samples_changes_no_update(monkeypatch, kw):
    collection = groups_with([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    p_run, g_run, m_run, rows_run = train([collection], False, monkeypatch, **kw)
    p_skip, g_skip, m_skip, rows_skip = train([collection], True, monkeypatch, **kw)
    for name in p_run:
        torch.testing.assert_close(g_skip[name], g_run[name], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(p_skip[name], p_run[name], atol=1e-7, rtol=1e-5)
    assert rows_skip < rows_run  # the all-equal group's 4 samples were not run
    assert m_skip[0]["train/skipped_samples"] > 0 == m_run[0]["train/skipped_samples"]
    for key in ("train/grad_norm", "train/response_tokens"):
        assert m_skip[0][key] == pytest.approx(m_run[0][key], rel=1e-5, abs=1e-7), key


def test_a_step_with_no_contributing_sample_still_moves_adams_momentum(monkeypatch):
    """After an informative step, a collection of all-equal groups: AdamW steps on a zero
    gradient, which still moves the weights, exactly as running the samples would."""
    informative = groups_with([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]], seed=1)
    flat = groups_with([[1.0] * 4, [0.0] * 4], seed=2)
    p_run, _, _, _ = train([informative, flat], False, monkeypatch)
    p_skip, _, m_skip, rows_skip = train([informative, flat], True, monkeypatch)
    before, _, _, _ = train([informative], True, monkeypatch)
    moved = any(not torch.equal(p_skip[n], before[n]) for n in p_skip)
    assert moved
    for name in p_run:
        torch.testing.assert_close(p_skip[name], p_run[name], atol=1e-7, rtol=1e-5)
    assert m_skip[1]["train/skipped_samples"] == 7  # one kept: the backward still runs


@pytest.mark.parametrize("fn", [group_normalized, mean_only])
def test_equal_rewards_give_exact_zero_advantages(fn):
    assert fn([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]  # fsum/3 of 0.1s is not 0.1 exactly
    assert all(a != 0.0 for a in fn([0.1, 0.2, 0.4]))
