"""Log-probs and entropy of tempered logits, over vocabulary chunks: no fp32 copy of the
whole [B, T, V] logits, in the forward or the backward pass.

The plain way (`logits.float() / T`, `logsumexp`, `softmax` for the entropy) keeps about
five fp32 copies of the logits alive: at 2 x 4.6k tokens x 76k vocabulary that is ~2.8 GB
each, ~14-20 GB per micro-batch (docs/memory.md). Here the forward walks the vocabulary in
chunks of `chunk` columns, keeping per position only the running max, the partition sum,
Σ e·z (for the entropy) and the target's logit; the backward recomputes each chunk's
softmax from the (bf16) logits the model already keeps:

    lp   = z_y - logZ,   z = logits / T,   logZ = m + log Σ exp(z - m)
    H    = logZ - Σ p·z
    dlp/dlogits = (onehot(y) - p) / T          (no saved fp32 tensor: p is recomputed)

Tensor parallel (megatron): the vocabulary is split over the TP group; the max, the sums and
the target logit (held by one rank) are all-reduced, as megatron's
vocab_parallel_cross_entropy does. Padded vocabulary columns (megatron pads the vocabulary)
are excluded. Values equal the plain computation's to float rounding
(tests/unit/test_logits.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_CHUNK = 8192


def _reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _TokenLogprobs(torch.autograd.Function):
    """Leading dims are any (`...`): the logits may be a non-contiguous slice of the model's
    output, which is never copied whole."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, first: int,
                vocab_size: int, group, chunk: int, with_entropy: bool):
        v_local = logits.shape[-1]
        m = torch.full(targets.shape, float("-inf"), device=logits.device)
        for lo in range(0, v_local, chunk):
            m = torch.maximum(m, _tempered(logits, lo, chunk, temperature, first,
                                           vocab_size).max(dim=-1).values)
        _reduce(m, dist.ReduceOp.MAX, group)
        sums = torch.zeros(3, *targets.shape, device=logits.device)  # Σe, Σe·(z-m), z_target
        local_t = targets - first
        for lo in range(0, v_local, chunk):
            z = _tempered(logits, lo, chunk, temperature, first, vocab_size)
            shifted = z - m.unsqueeze(-1)
            e = torch.exp(shifted)  # exp(-inf) = 0 on padded columns
            sums[0] += e.sum(-1)
            if with_entropy:
                sums[1] += torch.where(e > 0, e * shifted, 0.0).sum(-1)
            hit = (local_t >= lo) & (local_t < lo + z.shape[-1])
            idx = (local_t - lo).clamp(0, z.shape[-1] - 1).unsqueeze(-1)
            sums[2] += torch.where(hit, z.gather(-1, idx).squeeze(-1), 0.0)
        _reduce(sums, dist.ReduceOp.SUM, group)
        log_z = m + torch.log(sums[0])
        ctx.save_for_backward(logits, targets, log_z)
        ctx.args = (temperature, first, vocab_size, chunk)
        lp = sums[2] - log_z
        if not with_entropy:
            return lp, None
        entropy = torch.log(sums[0]) - sums[1] / sums[0]
        ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp: Tensor, _grad_entropy):
        logits, targets, log_z = ctx.saved_tensors
        temperature, first, vocab_size, chunk = ctx.args
        grad = torch.empty_like(logits)
        local_t = targets - first
        scale = (grad_lp / temperature).unsqueeze(-1)
        for lo in range(0, logits.shape[-1], chunk):
            z = _tempered(logits, lo, chunk, temperature, first, vocab_size)
            g = -torch.exp(z - log_z.unsqueeze(-1))  # -p
            hit = ((local_t >= lo) & (local_t < lo + z.shape[-1])).unsqueeze(-1)
            idx = (local_t - lo).clamp(0, z.shape[-1] - 1).unsqueeze(-1)
            g.scatter_add_(-1, idx, hit.to(g.dtype))  # + onehot(target) where it is here
            grad[..., lo:lo + z.shape[-1]] = (g * scale).to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def _tempered(logits_NV: Tensor, lo: int, chunk: int, temperature: float, first: int,
              vocab_size: int) -> Tensor:
    """fp32 logits / T of columns lo .. lo+chunk, padded vocabulary columns at -inf."""
    z = logits_NV[..., lo:lo + chunk].float() / temperature
    if first + lo + z.shape[-1] > vocab_size:
        cols = torch.arange(first + lo, first + lo + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))
    return z


def token_logprobs(logits_BTV: Tensor, targets_BT: Tensor, temperature: float, *,
                   vocab_size: int | None = None, group=None, first_column: int = 0,
                   chunk: int = DEFAULT_CHUNK, with_entropy: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """(log_softmax(logits / T)[target], entropy or None), both [B, T] fp32.

    `logits_BTV` may hold a TP rank's vocabulary slice starting at `first_column` (`group`
    is then the TP group); `vocab_size` excludes padded columns (default: all are real)."""
    v_local = logits_BTV.shape[-1]
    vocab = vocab_size if vocab_size is not None else first_column + v_local
    return _TokenLogprobs.apply(logits_BTV, targets_BT, float(temperature), first_column,
                                vocab, group, chunk, with_entropy)
