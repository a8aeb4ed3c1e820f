"""Vocabulary-chunked log-probs and entropy (rl_async/train/logits.py) equal the plain
computation (log_softmax over the whole fp32 logits): values, entropy and gradients, with
padded vocabulary columns, a temperature, a non-contiguous slice of the model's output,
bf16 logits, and the vocabulary split over two tensor-parallel ranks (real gloo)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rl_async.train.logits import token_logprobs


def plain(logits_BTV, targets_BT, temperature, vocab_size):
    z = logits_BTV[..., :vocab_size].float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy.detach()


def case(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 9, 100, generator=gen).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 90, (3, 7), generator=gen)
    return full, targets


@pytest.mark.parametrize("chunk", [7, 32, 4096])
def test_chunked_equals_plain_values_entropy_and_gradients(chunk):
    full, targets = case()
    logits = full[:, 1:8]  # a non-contiguous slice, as the trainers pass
    lp, ent = token_logprobs(logits, targets, 0.7, vocab_size=90, chunk=chunk,
                             with_entropy=True)
    weights = torch.randn(3, 7)
    (lp * weights).sum().backward()
    grad = full.grad.clone()
    full.grad = None
    want_lp, want_ent = plain(logits, targets, 0.7, 90)
    (want_lp * weights).sum().backward()
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-6)
    assert torch.allclose(grad, full.grad, atol=1e-6)
    assert grad[..., 90:].abs().max() == 0  # padded columns get no gradient


def test_bf16_logits_give_fp32_results_within_bf16_input_error():
    full, targets = case(torch.bfloat16, seed=1)
    lp, ent = token_logprobs(full[:, :7], targets, 1.0, with_entropy=True)
    assert lp.dtype == torch.float32
    want_lp, want_ent = plain(full[:, :7], targets, 1.0, 100)
    assert torch.allclose(lp, want_lp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    lp.sum().backward()
    assert full.grad.dtype == torch.bfloat16


def _tp_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    full, targets = case(seed=2)
    half = full.shape[-1] // 2  # rank r holds columns [r * 50, (r + 1) * 50)
    local = full[..., rank * half:(rank + 1) * half].detach().requires_grad_(True)
    lp, ent = token_logprobs(local[:, :7], targets, 0.9, vocab_size=90, group=dist.group.WORLD,
                             first_column=rank * half, chunk=16, with_entropy=True)
    lp.sum().backward()
    results.put((rank, lp.detach(), ent, local.grad))
    dist.destroy_process_group()


def test_tensor_parallel_vocab_split_equals_the_whole_vocabulary():
    from two_ranks import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    full, targets = case(seed=2)
    want_lp, want_ent = plain(full[:, :7], targets, 0.9, 90)
    want_lp.sum().backward()
    for rank in (0, 1):
        lp, ent, grad = got[rank]
        assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-6)
        assert torch.allclose(grad, full.grad[..., rank * 50:(rank + 1) * 50], atol=1e-6)
