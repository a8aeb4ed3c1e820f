"""megatron-core backend on a GPU: optimizer steps, publication export round trip.

Marked `gpu` and `megatron`; skipped without CUDA or megatron-core. One process (world size
1, NCCL). Run: pytest tests/gpu/test_megatron_gpu.py -m "gpu and megatron".
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_async.base.types import Group, Sample

pytestmark = [
    pytest.mark.gpu, pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
VOCAB = 96


@pytest.fixture(scope="module")
def trainer_parts():
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    yield hf.config, state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _groups(n_groups=2, size=4):
    gen = torch.Generator().manual_seed(5)
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        samples = []
        for i in range(size):
            resp = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
            samples.append(Sample(prompt_id=f"p{g}", prompt_ids=prompt, response_ids=resp,
                                  token_versions=[0] * 6, behavior_logprobs=[-4.5] * 6,
                                  reward=float(i % 2)))
        groups.append(Group(group_id=f"p{g}", samples=samples))
    return groups


def _objective(trainer, groups):
    """Σ_i A_i · mean log-prob of sample i under the current weights (what PPO increases)."""
    items = trainer._items(groups)
    trainer.model.eval()
    trainer._score_anchors(items)
    return sum(it.advantage * sum(it.anchor_logprobs) / len(it.anchor_logprobs) for it in items)


def test_steps_improve_objective_export_and_checkpoint(trainer_parts, tmp_path):
    from rl_async.train.megatron_backend import MegatronTrainer, MegatronTrainerConfig

    hf_config, state = trainer_parts
    trainer = MegatronTrainer(hf_config, state, MegatronTrainerConfig(
        global_batch_size=8, micro_batch_size=2, lr=1e-3, clip_grad=1.0))
    exported = dict(trainer.named_tensors_for_publication())
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k].cpu(), state[k]) for k in state)

    groups = _groups()
    before = _objective(trainer, groups)
    for v in range(3):
        metrics = trainer.train_collection(groups, policy_version=v)
        assert metrics["train/optimizer_steps"] == 1.0
        assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))
        assert metrics["train/update_skipped"] == 0.0
    after = _objective(trainer, groups)
    assert after > before

    trainer.save_checkpoint(tmp_path, extra={"note": 1})
    saved = dict(trainer.named_tensors_for_publication())
    trainer.train_collection(groups, policy_version=3)
    assert trainer.load_checkpoint(tmp_path) == {"note": 1}
    restored = dict(trainer.named_tensors_for_publication())
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    m1 = trainer.train_collection(groups, policy_version=3)
    trainer.load_checkpoint(tmp_path)
    m2 = trainer.train_collection(groups, policy_version=3)
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-5)
