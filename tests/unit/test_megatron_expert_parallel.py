"""Expert parallelism in the megatron backend on CPU: two gloo processes, DP 2 x EP 2, a tiny
Qwen3-MoE whose 4 experts are split 2 per rank. Each rank's forward (tokens travel to the
other rank's experts through the alltoall dispatcher) equals the HF model's; the lazy
checkpoint load gives each rank the same experts as the in-memory conversion; the export
gathers every expert back under its HF name; and the trainer, each rank with one group,
gives the torch trainer's metrics and weights on both groups. With two pipeline stages
instead, each stage replays its own MoE layer of the grid. Marked `megatron`."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.megatron

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import Qwen3MoeForCausalLM

    from megatron_cpu_shims import apply_cpu_shims
    from rl_async.train import megatron_model as mm
    from rl_async.train.megatron_export import stream_hf_tensors
    from rl_async.train.megatron_load import HFCheckpoint

    torch.set_num_threads(1)
    apply_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hf = Qwen3MoeForCausalLM.from_pretrained(ckpt).eval()
    cfg = mm.MegatronParallelConfig(vocab_divisible_by=128, expert_parallel_size=2)
    mm.initialize_parallel(cfg)
    model = mm.build_gpt_model(hf.config, cfg).eval()
    mm.load_hf_weights(model, dict(hf.state_dict()), hf.config, cfg)
    from_dict = {k: v.clone() for k, v in mm._tensor_state(model).items()}
    with HFCheckpoint(ckpt) as lazy:
        mm.load_hf_checkpoint(model, lazy, hf.config, cfg)
    same_load = all(torch.equal(v, from_dict[k]) for k, v in mm._tensor_state(model).items())
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(10 + rank))
    with torch.no_grad():
        got = mm.forward_logits(model, ids)[..., :96]
        want = hf(input_ids=ids).logits
    exported = dict(stream_hf_tensors(model, hf.config, cfg))
    ps.destroy_model_parallel()
    trained = _train(rank)
    torch.save({"trained": trained,"ep_rank": ps.get_expert_model_parallel_rank(), "same_load": same_load,
                "local_fc1": from_dict["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
                "max_err": float((got - want).abs().max()), "exported": exported},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _train(rank: int) -> dict:
    """Two collections (one optimizer step each) with this rank's group and routing replay."""
    from test_megatron_trainer import MOE, groups, run_config, with_routes

    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    cfg = run_config(hf=MOE, global_batch_size=8, expert_parallel=2)
    mcfg = trainer_config_from_run(cfg, 8, routing_replay=True)
    mcfg.use_distributed_optimizer = False
    trainer = MegatronTrainer(*hf_weights_from_run(cfg), mcfg)
    metrics = [trainer.train_collection(with_routes(groups(seed, version), seed)[rank:rank + 1],
                                        version) for version, seed in ((1, 11), (2, 12))]
    return {"metrics": metrics, "weights": dict(trainer.named_tensors_for_publication()),
            "reports": trainer.reports_metrics}


def test_two_ranks_split_the_experts_and_match_hf(tmp_path):
    pytest.importorskip("megatron.core")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY))
    hf.save_pretrained(tmp_path / "ckpt")
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["ep_rank"] for r in results] == [0, 1]
    assert all(r["same_load"] for r in results)
    for r, res in enumerate(results):  # local expert 1 of EP rank r is expert 2r + 1
        assert torch.equal(res["local_fc1"], state["model.layers.0.mlp.experts.gate_up_proj"][2 * r + 1])
        assert res["max_err"] < 1e-4, res["max_err"]
    exported = results[0]["exported"]
    assert not results[1]["exported"]  # gathered on global rank 0 only
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)

    from test_megatron_trainer import (MOE, ROUTING_COUNTS, assert_same_metrics,
                                       assert_same_weights, groups, run_config,
                                       torch_trainer, with_routes)

    ref = torch_trainer(run_config(hf=MOE, global_batch_size=8), routing_replay=True)
    trained = results[0]["trained"]
    assert trained["reports"] and not results[1]["trained"]["reports"]
    for (version, seed), got in zip(((1, 11), (2, 12)), trained["metrics"]):
        want = ref.train_collection(with_routes(groups(seed, version), seed), version)
        assert_same_metrics(got, want)
        for key in ROUTING_COUNTS:  # summed over the two data-parallel ranks
            assert got[key] == want[key], key
    assert_same_weights(trained["weights"], ref.named_tensors_for_publication())


def _pp_worker(rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch.distributed as dist

    from megatron_cpu_shims import apply_cpu_shims

    torch.set_num_threads(1)
    apply_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from test_megatron_trainer import MOE, groups, run_config, with_routes

    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    cfg = run_config(hf=MOE, pipeline_parallel=2)
    mcfg = trainer_config_from_run(cfg, 4, routing_replay=True)
    mcfg.use_distributed_optimizer = False
    trainer = MegatronTrainer(*hf_weights_from_run(cfg), mcfg)
    first = trainer.routing.slots[0].layer  # stage 1's router is MoE layer 1 of the grid
    metrics = [trainer.train_collection(with_routes(groups(seed, version), seed), version)
               for version, seed in ((1, 11), (2, 12))]
    torch.save({"first": first, "metrics": metrics, "reports": trainer.reports_metrics,
                "weights": dict(trainer.named_tensors_for_publication())},
               Path(out) / f"pp{rank}.pt")
    dist.destroy_process_group()


def test_two_pipeline_stages_replay_their_own_layers(tmp_path):
    """PP 2: each stage forces its own MoE layer's experts from the grid of all layers."""
    pytest.importorskip("megatron.core")
    from test_megatron_trainer import (MOE, ROUTING_COUNTS, assert_same_metrics,
                                       assert_same_weights, groups, run_config,
                                       torch_trainer, with_routes)

    mp.spawn(_pp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"pp{r}.pt") for r in range(2)]
    assert [r["first"] for r in results] == [0, 1]
    assert [r["reports"] for r in results] == [False, True]
    ref = torch_trainer(run_config(hf=MOE), routing_replay=True)
    for (version, seed), got in zip(((1, 11), (2, 12)), results[1]["metrics"]):
        want = ref.train_collection(with_routes(groups(seed, version), seed), version)
        assert_same_metrics(got, want)
        assert all(got[k] == want[k] for k in ROUTING_COUNTS)
    assert_same_weights(results[0]["weights"], ref.named_tensors_for_publication())
