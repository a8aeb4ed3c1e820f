"""One decode step of a Llama-family model without Hugging Face's per-forward Python.

Profile (the tiny test model, 2026-12-07): on small models the engine's decode step is
framework Python, not compute: `LlamaModel.forward` builds a causal mask, runs output-capturing
and kwarg-merging decorators, and every layer dispatches its attention through the attention
registry, about 1.4 ms per step for 2 layers of 128. A decode step feeds one token per row
and needs none of that: the mask is the rows' padding, the positions are given.

`FastDecode` runs the same modules in the same order (each module's own forward: norms,
projections, MLP, rotary embedding, embedding and output layer, so hub kernels and the
oneDNN linears still apply), the same `apply_rotary_pos_emb` and the same SDPA attention
function, and writes the same cache layers. Only the orchestration around them is ours. It
serves Llama, Qwen2 and Qwen3 layouts with full attention (SmolLM2 is a Llama; Qwen3 adds a
norm of each head's queries and keys), dense or mixture-of-experts (Qwen3-MoE: the layer's
own MLP module runs, routers and their routing replay hooks included); anything else, or a
model whose step does not match the stock forward at start (`check`), keeps the stock forward.
Inference only (the engine's forwards run under `torch.inference_mode`).
"""

from __future__ import annotations

import sys

import torch

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} (fast decode knows {SUPPORTED})"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention {config._attn_implementation!r} (sdpa only)"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window layers"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "an unexpected module layout"
    return None


class FastDecode:
    """`step(ids_B1, mask_BL, positions_B1, cache) -> logits_BV` for one decode step: the
    mask already includes the fed token's column; the cache is the engine's (one layer per
    decoder layer, appended to by `update`)."""

    def __init__(self, model: torch.nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self._rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        self._attention = sdpa_attention_forward
        self._qk_norm = hasattr(self.layers[0].self_attn, "q_norm")

    def step(self, ids_B1: torch.Tensor, mask_BL: torch.Tensor, positions_B1: torch.Tensor,
             cache) -> torch.Tensor:
        inner = self.inner
        hidden = inner.embed_tokens(ids_B1)
        cos, sin = inner.rotary_emb(hidden, positions_B1)
        # rows attend to their real positions only (the fed token's column included)
        allowed_B11L = mask_BL.bool()[:, None, None, :]
        batch = ids_B1.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (batch, 1, -1, attn.head_dim)
            q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
            if self._qk_norm:  # Qwen3: RMSNorm of every head's queries and keys
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            k, v = cache.layers[i].update(k, v)
            out, _ = self._attention(attn, q, k, v, allowed_B11L, dropout=0.0,
                                     scaling=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(batch, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(inner.norm(hidden))[:, -1]

    def check(self) -> float:
        """Max |logit| difference of one padded two-row decode step against the stock
        forward (the engine keeps the stock forward unless this is within 1e-4 of scale)."""
        from rl_async.engine.kv_batch import new_cache
        from rl_async.state.models import cache_kwarg

        generator = torch.Generator().manual_seed(0)
        vocab = int(self.model.config.vocab_size)
        device = next(self.model.parameters()).device
        ids = torch.randint(0, vocab, (2, 5), generator=generator).to(device)
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        fed = torch.randint(0, vocab, (2, 1), generator=generator).to(device)
        mask2 = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        positions2 = mask2.sum(1, keepdim=True) - 1
        results = []
        with torch.inference_mode():
            for fast in (False, True):
                cache = new_cache()
                self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=True, **{cache_kwarg(self.model): cache})
                if fast:
                    results.append(self.step(fed, mask2, positions2, cache))
                else:
                    results.append(self.model(input_ids=fed, attention_mask=mask2,
                                              position_ids=positions2, use_cache=True,
                                              **{cache_kwarg(self.model): cache}).logits[:, -1])
        stock, fast = results
        scale = float(stock.abs().max()) or 1.0
        return float((stock - fast).abs().max()) / scale


def fast_decode_for(model: torch.nn.Module) -> tuple[FastDecode | None, str]:
    """The fast step for `model`, or None and why the stock forward stays."""
    reason = unsupported_reason(model)
    if reason is not None:
        return None, reason
    fast = FastDecode(model)
    error = fast.check()
    if not error <= 1e-4:
        return None, f"differs from the stock forward by {error:.2g} of the logits' scale"
    return fast, "on"
