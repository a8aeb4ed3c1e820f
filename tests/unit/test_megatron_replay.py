"""Routing replay in the megatron backend (rl_async/train/megatron_replay.py): a megatron
Qwen3-MoE forced to given experts scores exactly what the HF model scores with the same
experts forced (rl_async/state/moe_routing.py), and unrecorded positions keep their own."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rl_async.state.moe_routing import Routing
from rl_async.train import megatron_model as mm
from rl_async.train.megatron_replay import MegatronRouting
from megatron_cpu_shims import megatron_cpu  # noqa: F401  (fixture)

pytestmark = pytest.mark.megatron
torch.set_num_threads(1)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


def _models(norm_topk_prob: bool):
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, norm_topk_prob=norm_topk_prob)).eval()
    cfg = mm.MegatronParallelConfig(vocab_divisible_by=128, routing_replay=True)
    mm.initialize_parallel(cfg)
    model = mm.build_gpt_model(hf.config, cfg)
    mm.load_hf_weights(model, {k: v.detach().clone() for k, v in hf.state_dict().items()},
                       hf.config, cfg)
    return hf, model.eval()


def _grid(B: int, L: int) -> torch.Tensor:
    """[B, L, 2 layers, top-2] distinct expert ids per position; row 1's tail unrecorded."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(B * L * 2)])
    grid = ids.view(B, L, 2, 2)
    grid[1, -3:] = -1
    return grid


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_logits_equal_hf_with_the_same_experts_forced(megatron_cpu, norm_topk_prob):
    hf, model = _models(norm_topk_prob)
    B, L = 2, 9
    ids = torch.randint(0, 96, (B, L), generator=torch.Generator().manual_seed(3))
    grid = _grid(B, L)
    routing = MegatronRouting(model, first_layer=0, moe_layers=2, top_k=2)
    hf_routing = Routing(hf)
    with torch.no_grad():
        own = mm.forward_logits(model, ids)[..., :96]
        with routing.replay(grid):
            forced = mm.forward_logits(model, ids)[..., :96]
        after = mm.forward_logits(model, ids)[..., :96]
        with hf_routing.replay(grid.view(B * L, 2, 2)):
            ref = hf(input_ids=ids).logits
        ref_own = hf(input_ids=ids).logits
    torch.testing.assert_close(forced, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(own, ref_own, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(after, own)  # the slot is cleared after the block
    assert (forced[0] - own[0]).abs().max() > 1e-3  # the forced experts did change things


def test_replay_gradients_reach_the_router_and_shapes_are_checked(megatron_cpu):
    _, model = _models(True)
    routing = MegatronRouting(model, first_layer=0, moe_layers=2, top_k=2)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    model.train()
    with routing.replay(_grid(2, 9)):
        mm.forward_logits(model, ids)[..., :96].logsumexp(-1).sum().backward()
    router = dict(model.named_parameters())["decoder.layers.0.mlp.router.weight"]
    assert router.grad is not None and router.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"\(MoE layers, top-k\).*\(2, 2\)"):
        routing.force(torch.zeros(2, 9, 3, 2, dtype=torch.long))
