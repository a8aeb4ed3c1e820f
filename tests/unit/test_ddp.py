"""Data parallel on 2 CPU processes (gloo) equals one process on the combined batch."""

import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_async.train.distributed import init_distributed
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig
from rl_async.base.types import Group, Sample

TINY = dict(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)
CFG = dict(hf_config=TINY, lr=1e-3, global_batch_size=8, micro_batch_size=2, device="cpu",
           grad_clip=0.0)


def make_groups(seed=0, n_groups=4, group_size=4):
    """Groups with different response lengths, so the ranks' token counts differ. The even
    groups' samples share their prompt (rank 0 scores them through train/prefix.py's shared
    prefixes), the odd groups' samples each have their own (rank 1: the plain forward)."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        shared = [rng.randrange(32) for _ in range(rng.randint(2, 6))]
        for s in range(group_size):
            prompt = (list(shared) if g % 2 == 0
                      else [rng.randrange(32) for _ in range(rng.randint(2, 6))])
            n = rng.randint(1, 3) if g % 2 == 0 else rng.randint(5, 9)
            resp = [rng.randrange(32) for _ in range(n)]
            samples.append(Sample(f"p{g}", response_ids=resp, prompt_ids=prompt,
                                  behavior_logprobs=[-3.3 + 0.1 * (i % 5) for i in range(n)],
                                  token_versions=[i % 2 for i in range(n)],
                                  reward=float(rng.random())))
        groups.append(Group(f"p{g}", samples))
    return groups


def snapshot(trainer, metrics):
    return {"grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()},
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "metrics": metrics}


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    init_distributed("127.0.0.1", port, rank, world_size, backend="gloo", timeout_s=60)
    try:
        groups = make_groups()
        # Groups 0, 2 to rank 0 (short responses), groups 1, 3 to rank 1 (long responses).
        shard = groups[rank::world_size]
        trainer = TorchTrainer(TorchTrainerConfig(**CFG), rank=rank, world_size=world_size)
        result = snapshot(trainer, trainer.train_collection(shard, policy_version=1))
        # Unequal shards: 4 samples per rank per step, so 8 samples = 2 steps but 4 = 1 step.
        try:
            trainer.train_collection(shard[:2 - rank], policy_version=1)
            result["error"] = None
        except ValueError as e:
            result["error"] = str(e)
        # A bad sample on rank 1 only: both ranks raise (rank 0 names the other rank).
        if rank == 1:
            shard[0].samples[0].reward = None
        try:
            trainer.train_collection(shard, policy_version=1)
            result["bad_shard_error"] = None
        except (ValueError, RuntimeError) as e:
            result["bad_shard_error"] = f"{type(e).__name__}: {e}"
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        # Both ranks past their last collective before either tears gloo down: a rank that
        # destroyed the group while the other's gloo threads were still mid-operation aborted
        # that process ("terminate called without an active exception") once in CI.
        dist.barrier()
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single_process():
    torch.set_num_threads(1)
    groups = make_groups()
    trainer = TorchTrainer(TorchTrainerConfig(**CFG))
    # Same sample order as the two ranks' concatenation does not matter for a token mean.
    return snapshot(trainer, trainer.train_collection(groups, policy_version=1))


def test_two_gloo_ranks_match_one_process_on_the_combined_batch(ranks, single_process):
    ref = single_process
    for r in ranks:
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(r["params"][name], ref["params"][name],
                                       atol=1e-6, rtol=1e-4)
        m, m_ref = r["metrics"], ref["metrics"]
        for key in ("train/loss", "train/tis_ess_ratio", "train/tis_clip_fraction",
                    "train/logprob_mismatch", "train/logprob_kl", "train/entropy",
                    "train/stale_token_fraction", "train/grad_norm", "train/ratio_max"):
            assert m[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
        assert m["train/response_tokens"] == m_ref["train/response_tokens"]
        # 16 samples, 8 per step: each rank's step k holds its half of the same samples.
        assert m["train/optimizer_steps"] == m_ref["train/optimizer_steps"] == 2


def test_unequal_shards_raise_on_every_rank_instead_of_hanging(ranks):
    for r in ranks:
        assert "optimizer steps per collection differs across trainer ranks" in r["error"]


def test_a_shard_rejected_on_one_rank_stops_every_rank(ranks):
    assert "another trainer rank rejected its shard" in ranks[0]["bad_shard_error"]
    assert "ValueError: group 'p1' sample 0 has reward None" in ranks[1]["bad_shard_error"]
