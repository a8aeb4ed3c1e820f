"""`rl-async doctor FILE` (launch/doctor.py) on this CPU machine: the GPU files name what a
GPU run would lack here (GPUs, NCCL, SGLang, Transformer Engine) and exit 2; the CPU demo
file has no blocker; a machine with everything has none either; a separate SGLang
interpreter is probed on its own."""

from __future__ import annotations

import json
import sys

from click.testing import CliRunner

from launch.cli import main
from launch.doctor import Probe, requirement_rows
from rl_async.plan.load import load_config


def _doctor(*args: str) -> tuple[int, dict[str, dict]]:
    result = CliRunner().invoke(main, ["doctor", *args, "--json"])
    out = json.loads(result.output.strip().splitlines()[-1])
    return result.exit_code, {row["what"]: row for row in out["rows"]}


def test_three_node_names_what_this_cpu_machine_lacks():
    code, rows = _doctor("cluster_configs/three_node.toml")
    assert code == 2
    blockers = {w for w, r in rows.items() if r["status"] == "BLOCKER"}
    assert {"trainers on GPU", "NCCL for the trainers and publication",
            "SGLang importable by the engines", "engines on GPU",
            "Transformer Engine (train.transformer_impl)"} <= blockers, blockers
    assert "sglang==0.5.23" in rows["SGLang importable by the engines"]["detail"]
    assert rows["megatron-core (train.backend = 'megatron')"]["status"] == "ok"
    assert "torch 2" in rows["run: versions"]["detail"]
    assert rows["run: pip check"]["status"] in ("ok", "warn")
    assert "none visible" in rows["run: GPUs"]["detail"]


def test_node_needs_gpus_and_sglang_but_no_megatron():
    code, rows = _doctor("cluster_configs/node.toml")
    assert code == 2
    assert rows["SGLang importable by the engines"]["status"] == "BLOCKER"
    assert rows["trainers on GPU"]["status"] == "BLOCKER"
    assert not [w for w in rows if "megatron" in w or "Transformer Engine" in w]


def test_the_cpu_demo_has_no_blocker():
    code, rows = _doctor("cluster_configs/local.toml")
    assert code == 0, rows
    assert not [r for r in rows.values() if r["status"] == "BLOCKER"]


def test_a_separate_sglang_interpreter_is_probed_and_named():
    code, rows = _doctor("cluster_configs/node.toml", "--set", f"sglang.python='{sys.executable}'")
    assert code == 2
    assert "sglang.python: versions" in rows
    assert f"sglang.python = '{sys.executable}'" in rows["SGLang importable by the engines"]["detail"]
    assert "one interpreter for SGLang and the trainers" not in rows


def test_a_gpu_node_with_the_whole_stack_has_no_blocker():
    cfg = load_config("cluster_configs/three_node.toml")
    stack = {m: None for m in ("sglang", "megatron.core", "transformer_engine.pytorch",
                               "math_verify")}
    node = Probe("/opt/venv/bin/python", imports=stack, gpus=["NVIDIA H100 80GB HBM3"] * 8,
                 nccl=True, versions={"sglang": "0.5.23", "megatron-core": "0.16.1",
                                      "torch": "2.14.1"})
    rows = requirement_rows(cfg, node, None)
    assert not [r for r in rows if r.status == "BLOCKER"], rows
    # one interpreter for both stacks: said, not a blocker
    assert [r.status for r in rows if r.what.startswith("one interpreter")] == ["warn"]
