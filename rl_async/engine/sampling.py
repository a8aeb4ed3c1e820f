"""Batched sampling with per-request settings and per-request random streams.

Returned log-probs. For every sampled token we return
`log_softmax(logits / temperature)[token]` over the FULL vocabulary: exactly what the
trainer computes for the same token (SPEC §8), so with top_p = 1 and top_k = -1 it is the true
log-probability of the sampling distribution. With top-p / top-k truncation the token is drawn
from the truncated, renormalised distribution, whose log-prob is larger than the returned
value by `-log(kept probability mass)`; the returned number is then the trainer-comparable
"untruncated" log-prob, NOT the true behaviour log-prob. This is why mixed-policy refresh and
exact importance weights require top_p = 1 and top_k = -1. With temperature 0 (greedy) the
returned log-prob is `log_softmax(logits)` (temperature 1).

Randomness. Each request owns a `torch.Generator` (seeded from `SamplingParams.seed`, or from
the engine's seed stream when None) and draws one uniform per token; the token is found by
inverse-CDF on the (truncated) distribution. A seeded request therefore gets the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import torch


def draw(rows: list, logits_BV: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token per row of the embedded engine's batch: `rows` are its requests (each with
    `.params`, SamplingParams, and `.generator`, its own random stream)."""
    params = [r.params for r in rows]
    device = logits_BV.device
    tokens_B, logprobs_B = sample_tokens(
        logits_BV,
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        draw_uniforms([r.generator for r in rows]))
    return tokens_B.tolist(), logprobs_B.tolist()


def draw_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) per row from that row's generator (float64, on CPU)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
                  top_k_B: torch.Tensor, uniform_B: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens_B int64, logprobs_B float32), see module doc.

    `temperature_B` 0 means greedy; `top_k_B` -1 means off; `top_p_B` 1 means off.
    """
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    safe_temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    logprobs_BV = torch.log_softmax(logits_BV / safe_temp_B[:, None], dim=-1)
    # Decided per row: a row without truncation draws from the unsorted CDF whatever the other
    # rows ask for, so a seeded request's tokens never depend on its batch-mates' settings.
    tokens_B = _inverse_cdf(logprobs_BV.double().exp(), uniform_B)
    rows = ((top_k_B > 0) | (top_p_B < 1)).nonzero().squeeze(1)  # on the logits' device
    if len(rows):
        tokens_B[rows] = _sample_truncated(logprobs_BV[rows], top_p_B[rows], top_k_B[rows],
                                           uniform_B[rows.cpu()])
    tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


def _inverse_cdf(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """Index of the first token whose cumulative mass exceeds u * total (zero-mass tokens are
    never chosen: `right=True` skips flat steps of the CDF)."""
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    target_B1 = (uniform_B.to(cdf_BV.device) * cdf_BV[:, -1])[:, None]
    index_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(1)
    return index_B.clamp(max=probs_BV.shape[-1] - 1)


def _sample_truncated(logprobs_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor,
                      uniform_B: torch.Tensor) -> torch.Tensor:
    sorted_lp_BV, order_BV = logprobs_BV.sort(dim=-1, descending=True)
    probs_BV = sorted_lp_BV.double().exp()
    rank_V = torch.arange(probs_BV.shape[-1], device=probs_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, probs_BV.shape[-1]))
    keep_BV = rank_V[None, :] < k_B[:, None].to(probs_BV.device)
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays).
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
    keep_BV &= mass_before_BV < top_p_B[:, None].to(probs_BV.device).double()
    keep_BV[:, 0] = True
    index_B = _inverse_cdf(probs_BV * keep_BV, uniform_B)
    return order_BV.gather(1, index_B[:, None]).squeeze(1)
