"""Torch trainer on CUDA with bf16 autocast (run on a GPU machine: `pytest -m gpu`)."""

import pytest
import torch

from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig
from rl_async.base.types import Group, Sample

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128)


def groups():
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(4):
        samples = []
        for s in range(4):
            prompt = torch.randint(0, 64, (3 + g,), generator=gen).tolist()
            resp = torch.randint(0, 64, (2 + s,), generator=gen).tolist()
            samples.append(Sample(f"p{g}", resp, [0] * len(resp), [-4.0] * len(resp),
                                  float(s % 2), prompt))
        out.append(Group(f"p{g}", samples))
    return out


def test_bf16_autocast_training_on_cuda():
    trainer = TorchTrainer(TorchTrainerConfig(hf_config=TINY, device="cuda", lr=1e-3,
                                              global_batch_size=16, micro_batch_size=4))
    assert next(trainer.model.parameters()).dtype == torch.float32   # fp32 master weights
    gs = groups()
    for s, lp in zip([s for g in gs for s in g.samples], trainer.score(gs)):
        s.behavior_logprobs = lp
    m = trainer.train_collection(gs, policy_version=0)
    # Anchor and θ come from the same bf16 forward: the ratio is 1 at the first step.
    assert m["train/ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert all(v == v for v in m.values())                           # no NaN
    named = trainer.named_tensors_for_publication("bfloat16")
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for _, t in named)
