"""Routing replay (R3) on real transformers MoE models: record in the embedded engine's own
forwards, replay in the trainer's scoring forward.

The test that fails without replay: the engine's router is perturbed (its top-k drawn from
probabilities plus noise, as near-tie flips between kernels do), and the trainer's log-probs
with the recorded experts equal the engine's behaviour log-probs (fp32, 1e-5) while its own
routing does not."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_async.base.types import Group, RoutedExperts, Sample
from rl_async.engine.base import SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.plan.moe import moe_dims, routing_replay_on
from rl_async.state.models import build_causal_lm
from rl_async.state.moe_routing import Routing, RoutingError, pack_routed, unpack_routed
from rl_async.train.batching import TrainItem, pack, token_logprobs
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig

QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 32,
             "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
             "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
             "tie_word_embeddings": False, "norm_topk_prob": True}
FAMILIES = {
    "qwen3_moe": QWEN3_MOE,
    "qwen2_moe": {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 16,
                  "norm_topk_prob": False},
    "olmoe": {**QWEN3_MOE, "model_type": "olmoe", "intermediate_size": 16},
    "mixtral": {k: v for k, v in {**QWEN3_MOE, "model_type": "mixtral", "num_local_experts": 8,
                                  "intermediate_size": 16}.items()
                if k not in ("num_experts", "moe_intermediate_size")},
}


def _model(config: dict, seed: int = 0) -> torch.nn.Module:
    model = build_causal_lm(config, None, seed, "float32", "cpu")
    model.requires_grad_(False)
    return model


def _ids(batch: int = 3, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 32, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_the_recorded_experts_reproduces_the_forward(family):
    config = FAMILIES[family]
    assert moe_dims(config) is not None and routing_replay_on("auto", config)
    model = _model(config)
    routing = Routing(model)
    ids = _ids()
    routing.begin()
    reference = model(input_ids=ids).logits
    recorded = routing.take()
    assert recorded.shape == (ids.numel(), 2, 2)
    with routing.replay(recorded):  # the same experts: bit-identical
        assert torch.equal(model(input_ids=ids).logits, reference)
    shifted = (recorded + 1) % 8  # other experts: another function
    with routing.replay(shifted):
        assert not torch.allclose(model(input_ids=ids).logits, reference, atol=1e-4)
    with routing.replay(torch.full_like(recorded, -1)):  # nothing forced: own routing
        assert torch.equal(model(input_ids=ids).logits, reference)


def test_a_dense_model_and_a_router_of_another_form_are_refused_by_name():
    dense = {k: v for k, v in {**QWEN3_MOE, "model_type": "qwen3"}.items()
             if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    assert moe_dims(dense) is None and not routing_replay_on("auto", dense)
    with pytest.raises(RoutingError, match="dense"):
        Routing(_model(dense))
    model = _model(QWEN3_MOE)
    router = model.model.layers[0].mlp.gate
    original = router.forward
    router.forward = lambda h: (lambda out: (out[0], out[1] * 0.5, out[2]))(original(h))
    with pytest.raises(RoutingError, match="not a softmax top-2 router"):
        Routing(model)


def test_routed_experts_pack_compactly_and_round_trip():
    ids = torch.randint(0, 8, (5, 2, 2))
    routed = pack_routed(ids)
    assert routed.nbytes == 20 and routed.itemsize == 1
    assert torch.equal(unpack_routed(routed), ids)
    assert RoutedExperts.from_rows(routed.rows()) == routed
    wide = pack_routed(torch.tensor([[[300, 2]]]))
    assert wide.itemsize == 2 and unpack_routed(wide).tolist() == [[[300, 2]]]
    with pytest.raises(ValueError, match="bytes for 2 positions"):
        RoutedExperts(b"\x00" * 3, 2, 1, 2)


def _generate(perturb: float, prompts: list[list[int]], new: int = 6,
              config: dict = QWEN3_MOE) -> list:
    engine = EmbeddedEngine(EmbeddedEngineConfig(
        hf_config=config, max_running_requests=4, onednn_linear=False,
        forward_in_thread=False, record_routing=True, routing_perturb=perturb))

    async def run():
        try:
            return await asyncio.gather(*[engine.generate(
                p, SamplingParams(max_new_tokens=new, temperature=1.0, seed=i))
                for i, p in enumerate(prompts)])
        finally:
            await engine.close()

    return asyncio.run(run())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_records_every_fed_token_and_the_trainer_replays_it(family):
    """A perturbed engine router: with the recorded experts the trainer scores exactly what
    the engine sampled from; with its own routing it does not. Four prompts, two of them the
    same (a group's shared prefill and the prompt cache hand both the same routing)."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [1, 2, 3, 4, 5], [9, 10, 11, 12]]
    outs = _generate(perturb=0.5, prompts=prompts, config=FAMILIES[family])
    items = []
    for prompt, out in zip(prompts, outs):
        out.check("test")
        routed = out.routed_experts
        assert routed is not None and (routed.layers, routed.k) == (2, 2)
        assert routed.positions == len(prompt) + len(out.output_ids) - 1
        items.append(TrainItem(prompt, list(out.output_ids), list(out.output_logprobs), [],
                               routed=routed))
    model = _model(FAMILIES[family])  # the trainer's copy: the same weights, no perturbation
    Routing(model)
    replayed = token_logprobs(model, pack(items, "cpu", routing_layers=(2, 2)), 1.0)[0]
    own = token_logprobs(model, pack(items, "cpu"), 1.0)[0]
    batch = pack(items, "cpu")
    behaviour = batch.behavior_BT[batch.mask_BT]
    assert torch.allclose(replayed[batch.mask_BT], behaviour, atol=1e-5, rtol=0)
    assert (own[batch.mask_BT] - behaviour).abs().max() > 1e-3


def test_the_trainer_reports_agreement_and_both_mismatches():
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9]] * 2
    outs = _generate(perturb=0.5, prompts=prompts)
    samples = [Sample(prompt_id=str(i), prompt_ids=p, response_ids=list(o.output_ids),
                      behavior_logprobs=list(o.output_logprobs),
                      token_versions=list(o.token_versions), reward=float(i % 2),
                      routed_experts=o.routed_experts)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    trainer = TorchTrainer(TorchTrainerConfig(hf_config=QWEN3_MOE, global_batch_size=4,
                                              micro_batch_size=2, routing_replay=True))
    metrics = trainer.train_collection([Group("g0", samples=samples)], 0)
    assert metrics["train/routing_replayed_tokens"] == sum(len(o.output_ids) for o in outs)
    assert 0.0 < metrics["train/routing_agreement"] < 1.0  # the perturbation flipped some
    assert metrics["train/routing_logprob_mismatch_replay"] < 1e-5
    assert metrics["train/routing_logprob_mismatch_own"] > 1e-3
