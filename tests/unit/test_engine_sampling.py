"""Batched sampling: truncation, greedy, full-vocabulary log-probs, per-row seeds."""

from __future__ import annotations

import torch

from rl_async.engine.sampling import draw_uniforms, sample_tokens


def _run(logits, temperature, top_p, top_k, seeds):
    b = logits.shape[0]
    return sample_tokens(logits, torch.full((b,), temperature), torch.full((b,), top_p),
                         torch.full((b,), top_k, dtype=torch.long),
                         draw_uniforms([torch.Generator().manual_seed(s) for s in seeds]))


def test_top_k_and_top_p_only_sample_kept_tokens_but_return_full_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    seeds = range(400)
    tokens, logprobs = _run(logits, 1.0, 1.0, 2, seeds)
    assert set(tokens.tolist()) == {0, 1}
    # Full-vocabulary log-probs, NOT renormalised over the kept tokens.
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.3]))[tokens], atol=1e-6)
    tokens, _ = _run(logits, 1.0, 0.7, -1, seeds)  # 0.5 < 0.7 -> keep {0, 1}
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = _run(logits, 1.0, 1.0, -1, seeds)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_untruncated_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    tokens, _ = _run(torch.log(probs).repeat(4000, 1), 1.0, 1.0, -1, range(4000))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_scales_logprobs_and_zero_is_greedy():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = _run(logits, 0.0, 1.0, -1, [1, 2, 3])
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    tokens, logprobs = _run(logits, 0.5, 1.0, -1, [1, 2, 3])
    expected = torch.log_softmax(logits / 0.5, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, expected)


def test_same_seed_same_token_whatever_the_row():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    alone, _ = _run(logits, 1.0, 1.0, -1, [9])
    batch, _ = _run(logits.repeat(5, 1), 1.0, 1.0, -1, [1, 2, 9, 3, 4])
    assert int(batch[2]) == int(alone[0])
