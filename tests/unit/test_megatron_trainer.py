"""The megatron-core trainer end to end on CPU (gloo, test-only CUDA shims): the same loss and
metrics as the torch trainer on the same batch (TP1, and TP2 x PP2 in four processes), the
metrics rank, the lr schedule, and the export path (HF-named tensors gathered over TP/PP).

Marked `megatron` (skipped without megatron-core)."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from rl_async.algo.corrections import corrections_from
from rl_async.plan.load import resolve
from rl_async.train.torch_trainer import TorchTrainer, TorchTrainerConfig
from rl_async.base.types import Group, Sample
from megatron_cpu_shims import megatron_cpu  # noqa: F401  (fixture)

pytestmark = pytest.mark.megatron
torch.set_num_threads(1)

VOCAB = 96
HF = {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "tie_word_embeddings": False}
# Metrics both backends report; they must agree.
SHARED = ("train/loss", "train/ppo_clip_fraction", "train/tis_clip_fraction",
          "train/tis_ess_ratio", "train/ratio_p99", "train/ratio_max", "train/logprob_mismatch",
          "train/logprob_kl", "train/entropy", "train/stale_token_fraction", "train/grad_norm",
          "train/lr", "train/response_tokens", "train/optimizer_steps", "train/step",
          "train/kl_k3_trainer_rollout", "train/logratio_over_ln2_fraction",
          "train/logratio_m2", "train/logratio_m2_kept", "train/masked_fraction",
          "train/masked_fraction_adv_pos", "train/masked_fraction_adv_neg")


MOE = {**HF, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True}


def run_config(hf=HF, **train):
    return resolve({"model": {"hf_config": hf, "init_seed": 3},
                    "run": {"max_steps": 4},
                    "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4},
                    "train": {"lr": 1e-2, "lr_schedule": "cosine", "min_lr_ratio": 0.2,
                              "global_batch_size": 4, "micro_batch_size": 2, **train}})


def torch_trainer(cfg, routing_replay: bool = False) -> TorchTrainer:
    t = cfg.train
    return TorchTrainer(TorchTrainerConfig(
        hf_config=cfg.model.hf_config, seed=cfg.model.init_seed, lr=t.lr,
        weight_decay=t.weight_decay, grad_clip=t.grad_clip, lr_schedule=t.lr_schedule,
        total_steps=cfg.run.max_steps, min_lr_ratio=t.min_lr_ratio,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high,
        tis_clip=t.tis_clip, tis_clip_low=t.tis_clip_low, use_tis=t.use_tis,
        corrections=corrections_from(t), use_rollout_logprobs=t.use_rollout_logprobs, advantage_estimator=t.advantage,
        temperature=cfg.rollout.temperature, routing_replay=routing_replay, device="cpu"))


def groups(seed: int, version: int) -> list[Group]:
    """Two groups of four; behaviour log-probs spread so that TIS clips some tokens, and
    token versions `version` - 1 or `version`, so the stale fraction is neither 0 nor 1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(2):
        prompt = torch.randint(3, VOCAB, (4 + g,), generator=gen).tolist()
        samples = []
        for i in range(4):
            n = 3 + (i + g) % 4
            samples.append(Sample(
                prompt_id=f"p{g}", prompt_ids=prompt,
                response_ids=torch.randint(3, VOCAB, (n,), generator=gen).tolist(),
                token_versions=[version - 1 + (i + k) % 2 for k in range(n)],
                behavior_logprobs=(-3.0 - 3.0 * torch.rand(n, generator=gen)).tolist(),
                reward=float((i * 7 + g) % 3)))
        out.append(Group(group_id=f"g{seed}-{g}", samples=samples))
    return out


def assert_same_metrics(got: dict, want: dict) -> None:
    for key in SHARED:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


def assert_same_weights(got: dict, want) -> None:
    """The trained weights of both backends agree to 1e-4, but for at most one element in a
    thousand, off by at most the learning rate (1e-2). Adam moves an element by about the lr
    whatever its gradient's size, so where a gradient is at rounding level (summed in
    another order it has the other sign) two correct backends step opposite ways: seen on
    one element of 2048 (3.7e-4) on one host and not on another."""
    for name, p in want:
        diff = (got[name] - p).abs()
        off = ~torch.isclose(got[name], p, rtol=1e-4, atol=1e-4)
        assert float(off.float().mean()) <= 1e-3, (name, int(off.sum()), float(diff.max()))
        assert float(diff.max()) <= 1e-2, (name, float(diff.max()))


@pytest.mark.parametrize("train", [
    {}, {"use_tis": False, "use_rollout_logprobs": True},
    # every loss and mask reaches both backends (GSPO: the sequence-mean denominator)
    {"policy_loss": "gspo", "gspo_eps_low": 0.05, "gspo_eps_high": 0.05, "is_mask": "geo_rs",
     "is_mask_low": 0.5, "is_mask_high": 2.0},
    {"policy_loss": "cispo", "is_mask": "seq_mis", "is_mask_high": 1e6},
    {"policy_loss": "m2po", "is_mask": "icepop"}, {"policy_loss": "decoupled_ppo",
                                                    "is_mask": "token_mis"}])
def test_torch_and_megatron_agree_on_loss_and_metrics(megatron_cpu, train):
    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    cfg = run_config(**train)
    ref = torch_trainer(cfg)
    mcfg = trainer_config_from_run(cfg, 4)
    mcfg.use_distributed_optimizer = False  # CUDA-only in megatron-core
    hf_config, weights = hf_weights_from_run(cfg)
    meg = MegatronTrainer(hf_config, weights, mcfg)
    assert meg.reports_metrics
    # Two collections of two optimizer steps: the anchor, the lr schedule and the updated
    # weights all come into play; the cosine lr falls between steps.
    lrs = []
    for version, seed in ((1, 11), (2, 12)):
        want = ref.train_collection(groups(seed, version), version)
        got = meg.train_collection(groups(seed, version), version)
        assert_same_metrics(got, want)
        lrs.append(got["train/lr"])
        assert (0 < want["train/tis_clip_fraction"] < 1 or not cfg.train.use_tis
                or cfg.train.policy_loss != "ppo_tis")
        assert 0 < want["train/stale_token_fraction"] < 1
    assert lrs[0] > lrs[1] > 0.2 * 1e-2
    exported = dict(meg.named_tensors_for_publication())
    assert_same_weights(exported, ref.named_tensors_for_publication())


ROUTING_COUNTS = ("train/routing_replayed_tokens", "train/routing_unreplayed_tokens",
                  "train/routing_replayed_samples", "train/routing_replay_bytes")


def with_routes(gs: list[Group], seed: int) -> list[Group]:
    """The engine's experts on every sample but the last of each group (it keeps the
    trainer's own routing): [prompt + response - 1 positions, 2 MoE layers, top-2]."""
    import dataclasses

    from rl_async.state.moe_routing import pack_routed

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in gs:
        samples = []
        for i, s in enumerate(g.samples):
            fed = len(s.prompt_ids) + len(s.response_ids) - 1
            ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(fed * 2)])
            routed = pack_routed(ids.view(fed, 2, 2)) if i < len(g.samples) - 1 else None
            samples.append(dataclasses.replace(s, routed_experts=routed))
        out.append(dataclasses.replace(g, samples=samples))
    return out


def test_qwen3_moe_with_routing_replay_agrees_with_the_torch_trainer(megatron_cpu):
    """Both trainers force the same recorded experts (megatron: megatron_replay.py; torch:
    state/moe_routing.py); loss, metrics and the updated weights (experts and routers
    included) agree."""
    from rl_async.train.megatron_backend import (MegatronTrainer, hf_weights_from_run,
                                                 trainer_config_from_run)

    cfg = run_config(hf=MOE)
    ref = torch_trainer(cfg, routing_replay=True)
    from rl_async.plan.moe import replay_for

    mcfg = trainer_config_from_run(cfg, 4, replay_for(cfg, cfg.train.routing_replay))
    assert mcfg.parallel.routing_replay  # "auto" is on for an MoE model
    mcfg.use_distributed_optimizer = False
    meg = MegatronTrainer(*hf_weights_from_run(cfg), mcfg)
    for version, seed in ((1, 11), (2, 12)):
        batch = with_routes(groups(seed, version), seed)
        got, want = meg.train_collection(batch, version), ref.train_collection(batch, version)
        assert_same_metrics(got, want)
        for key in ROUTING_COUNTS:
            assert got[key] == want[key] > 0, key
    # On-policy samples (every token of the trainer's version): both measure how often
    # the trainer's own top-k equals the recorded one, in the first step of a collection.
    batch = [dataclasses.replace(g, samples=[dataclasses.replace(
        s, token_versions=[3] * len(s.response_ids)) for s in g.samples])
        for g in with_routes(groups(13, 3), 13)]
    got, want = meg.train_collection(batch, 3), ref.train_collection(batch, 3)
    assert 0 < want["train/routing_agreement"] < 1
    assert got["train/routing_agreement"] == pytest.approx(want["train/routing_agreement"])
    exported = dict(meg.named_tensors_for_publication())
    assert "model.layers.1.mlp.experts.gate_up_proj" in exported
    assert_same_weights(exported, ref.named_tensors_for_publication())


# ---- TP2 x PP2 over gloo, four processes ------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, ckpt_dir: str, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import torch.distributed as dist

    from megatron_cpu_shims import apply_cpu_shims
    from rl_async.train.megatron_backend import MegatronTrainer, trainer_config_from_run
    from rl_async.train.megatron_load import HFCheckpoint
    from transformers import AutoConfig

    torch.set_num_threads(1)
    apply_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = run_config(tensor_parallel=2, pipeline_parallel=2)
    mcfg = trainer_config_from_run(cfg, 4)
    mcfg.use_distributed_optimizer = False
    with HFCheckpoint(ckpt_dir) as ckpt:  # each rank reads only its slices
        trainer = MegatronTrainer(AutoConfig.from_pretrained(ckpt_dir), ckpt, mcfg)
    result = {"loaded": dict(trainer.named_tensors_for_publication()), "metrics": [],
              "reports": trainer.reports_metrics}
    for version, seed in ((1, 11), (2, 12)):
        result["metrics"].append(trainer.train_collection(groups(seed, version), version))
    result["trained"] = dict(trainer.named_tensors_for_publication())
    # The HF export streams the same tensors (rank 0 writes; the others take part): gate and
    # up are views of one fc1, which safetensors refuses unless the export copies them.
    from rl_async.state.hf_export import export_hf

    named = trainer.named_tensors_for_publication()
    if rank == 0:
        export_hf(named, Path(out_dir) / "hf", hf_config=cfg.model.hf_config)
    else:
        for _ in named:
            pass
    if rank != 0:  # gathered on global rank 0 only: the other ranks yield nothing
        assert not result["loaded"] and not result["trained"]
        result.pop("loaded"), result.pop("trained")
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_tp2_pp2_metrics_and_export_match_the_torch_trainer(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from rl_async.state.models import build_causal_lm

    cfg = run_config()
    hf = build_causal_lm(cfg.model.hf_config, None, cfg.model.init_seed, "float32")
    hf.save_pretrained(tmp_path / "ckpt", max_shard_size="50KB")  # several shards
    initial = {k: v.clone() for k, v in hf.state_dict().items()}
    ref = torch_trainer(cfg)
    want = [ref.train_collection(groups(seed, version), version) for version, seed in ((1, 11), (2, 12))]

    mp.spawn(_worker, args=(4, _free_port(), str(tmp_path / "ckpt"), str(tmp_path)), nprocs=4)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    # Ranks 0, 1 are the first stage (TP 0, 1); 2, 3 the last. Only rank 2 reports.
    assert [r["reports"] for r in results] == [False, False, True, False]
    for got, ref_metrics in zip(results[2]["metrics"], want):
        assert_same_metrics(got, ref_metrics)
    # The first stage computes no log-probs: its metrics are zeros (why rank 0 is not used).
    assert results[0]["metrics"][0]["train/loss"] == 0.0
    assert results[0]["metrics"][0]["train/entropy"] == 0.0
    loaded, trained = results[0]["loaded"], results[0]["trained"]
    assert loaded.keys() == initial.keys()
    assert all(torch.equal(loaded[k], initial[k]) for k in initial)
    assert_same_weights(trained, ref.named_tensors_for_publication())
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
