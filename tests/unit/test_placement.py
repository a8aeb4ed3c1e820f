"""The trainers' placement (rl_async/plan/placement.py): with megatron tensor parallelism on
GPUs each TP group is a STRICT_PACK placement group (its ranks on one node, as megatron's
consecutive TP ranks need), otherwise one PACK group."""

from __future__ import annotations

from rl_async.plan.load import load_config
from rl_async.plan.placement import TrainerGroup, trainer_groups


def test_three_node_places_each_tp_pair_on_one_node():
    cfg = load_config("cluster_configs/three_node.toml")
    assert trainer_groups(cfg) == [TrainerGroup([0, 1], "STRICT_PACK"),
                                   TrainerGroup([2, 3], "STRICT_PACK"),
                                   TrainerGroup([4, 5], "STRICT_PACK"),
                                   TrainerGroup([6, 7], "STRICT_PACK")]


def test_without_tensor_parallelism_the_trainers_are_one_pack_group():
    assert trainer_groups(load_config("cluster_configs/node.toml")) == [
        TrainerGroup(list(range(load_config("cluster_configs/node.toml")
                                .cluster.trainer_workers)), "PACK")]
    local = load_config("cluster_configs/local.toml", ["cluster.trainer_workers=2"])
    assert trainer_groups(local) == [TrainerGroup([0, 1], "PACK")]
