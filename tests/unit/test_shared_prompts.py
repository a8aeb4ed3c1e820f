"""Shared prompts (rl_async/train/prefix.py): each distinct prompt runs once, and the scores,
entropies and gradients equal the plain forward's, on a tiny random Llama and on batches with
mixed prompt and response lengths, an empty response and a trajectory's loss mask."""

import random

import pytest
import torch

from rl_async.base.types import Group, Sample
from rl_async.state.models import build_causal_lm, cache_kwarg
from rl_async.train.batching import TrainItem, pack, token_logprobs
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

torch.set_num_threads(1)

TINY = dict(model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=96)


def items_of(prompts_and_sizes, seed=0):
    """Groups of samples sharing a prompt; response lengths vary (0 included)."""
    rng = random.Random(seed)
    out = []
    for prompt_len, size in prompts_and_sizes:
        prompt = [rng.randrange(1, 48) for _ in range(prompt_len)]
        for s in range(size):
            n = rng.choice([0, 1, 3, 7, 11]) if s else 5
            resp = [rng.randrange(1, 48) for _ in range(n)]
            mask = [rng.randint(0, 1) for _ in range(n)] if s == 2 else None
            out.append(TrainItem(list(prompt), resp, [-2.0] * n, [], advantage=rng.gauss(0, 1),
                                 loss_mask=mask))
    return out


@pytest.fixture(scope="module")
def model():
    m = build_causal_lm(TINY, seed=3)
    m.eval()
    return m


def scores_and_grads(model, items, share):
    batch = pack(items, "cpu", share_prompts=share)
    assert (batch.shared is not None) == share
    model.zero_grad(set_to_none=True)
    lp_BT, ent_BT = token_logprobs(model, batch, temperature=0.7, with_entropy=True)
    weights_BT = torch.linspace(-1.0, 1.0, lp_BT.numel()).reshape(lp_BT.shape)
    (lp_BT * weights_BT * batch.mask_BT).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return lp_BT.detach(), ent_BT, batch.mask_BT, grads


@pytest.mark.parametrize("layout", [
    [(9, 4), (5, 4)],              # two groups, different prompt lengths
    [(2, 3), (13, 2), (6, 1)],     # a one-token prefix, and a prompt seen once
])
def test_shared_prompts_give_the_plain_scores_entropies_and_gradients(model, layout):
    items = items_of(layout)
    lp_a, ent_a, mask, grads_a = scores_and_grads(model, items, share=False)
    lp_b, ent_b, mask_b, grads_b = scores_and_grads(model, items, share=True)
    assert torch.equal(mask, mask_b)
    rows_with_tokens = sum(1 for it in items if it.response_len)
    assert rows_with_tokens < len(items)  # the empty response is in the batch
    response_BT = torch.zeros_like(mask)
    for i, it in enumerate(items):  # every response position, masked ones too
        b, e = pack(items, "cpu").spans[i]
        response_BT[i, b:e] = True
    torch.testing.assert_close(lp_b[response_BT], lp_a[response_BT], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent_b[response_BT], ent_a[response_BT], atol=2e-5, rtol=1e-5)
    assert (lp_b[~response_BT] == 0).all()
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_the_prefix_runs_once_per_distinct_prompt(model):
    items = items_of([(9, 4), (5, 4)])
    cache_kwarg(model)  # resolved off the real forward's signature, before the wrap
    widths = []
    forward = model.forward

    def counting(*args, **kwargs):
        widths.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    model.forward = counting
    try:
        token_logprobs(model, pack(items, "cpu", share_prompts=True), temperature=1.0)
    finally:
        del model.forward
    # 2 distinct prefixes of up to 8 tokens, then 8 rows of up to 11 response positions.
    assert widths == [(2, 8), (8, 11)]


@pytest.mark.parametrize("layout", [[(5, 1), (7, 1)], [(1, 4)]])
def test_no_sharing_where_no_prompt_repeats_or_a_prompt_is_one_token(layout):
    assert pack(items_of(layout), "cpu", share_prompts=True).shared is None


def test_the_trainer_takes_the_same_step_either_way():
    """A whole optimizer step (loss, clipping, AdamW) lands on the same weights."""
    rng = random.Random(1)
    groups = []
    for g in range(2):
        prompt = [rng.randrange(1, 48) for _ in range(rng.randint(4, 12))]
        samples = []
        for s in range(4):
            n = rng.randint(1, 9)
            samples.append(Sample(f"p{g}", prompt_ids=list(prompt),
                                  response_ids=[rng.randrange(1, 48) for _ in range(n)],
                                  behavior_logprobs=[-3.5] * n, token_versions=[0] * n,
                                  reward=float(s % 2)))
        groups.append(Group(f"p{g}", samples))
    after = []
    for share in (False, True):
        trainer = TorchTrainer(TorchTrainerConfig(
            hf_config=TINY, lr=1e-3, global_batch_size=8, micro_batch_size=4, device="cpu",
            share_prompts=share))
        metrics = trainer.train_collection(groups, policy_version=0)
        after.append(({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                      metrics))
    (params_a, m_a), (params_b, m_b) = after
    for name, p in params_a.items():
        torch.testing.assert_close(params_b[name], p, atol=1e-6, rtol=1e-5, msg=name)
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/response_tokens"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-6), key
