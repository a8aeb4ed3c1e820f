"""The publication deadline's shares (rl_async/plan/publication_budget.py): validate counts the
transfer itself (rank 0 sends the model once per engine at publication.bytes_per_s), and each
engine's whole receive gets a budget that loses a slow engine before the publication deadline
would stop the run."""

from __future__ import annotations

import tomllib
from pathlib import Path

from rl_async.plan.checks import validate
from rl_async.plan.load import resolve
from rl_async.plan.publication_budget import (engine_receive_budget_s, transfer_budget_s,
                                              transfer_estimate_s)

ROOT = Path(__file__).resolve().parents[2]


def _three_node(**publication):
    data = tomllib.loads((ROOT / "cluster_configs" / "three_node.toml").read_text())
    data["publication"].update(publication)
    return resolve(data)


def test_validate_counts_the_transfer_of_the_model_to_every_engine():
    cfg = _three_node()
    plan = validate(cfg).plan
    # Qwen2.5-7B in bf16 (15.23 GB) to 8 engines at 2 GB/s
    assert round(transfer_estimate_s(cfg, plan)) == 61
    assert not [e for e in validate(cfg).errors if "publication.timeout_s" in e]
    slow = _three_node(bytes_per_s=0.5e9)  # 244 s of transfer: 360 + 244 > 480
    errors = [e for e in validate(slow).errors if "publication.timeout_s" in e]
    assert len(errors) == 1, errors
    assert ("= 240 + 120 + the transfer 244 (8 engines x 15.23 GB at "
            "publication.bytes_per_s = 5e+08) = 604" in errors[0]), errors[0]


def test_each_engines_receive_has_a_budget_inside_the_publication_deadline():
    p = _three_node().publication  # timeout 480, drain 120, channel 60
    assert transfer_budget_s(p) == 480 - 240 - 60
    assert engine_receive_budget_s(p, 1) == 60      # one bucket: one channel deadline
    assert engine_receive_budget_s(p, 16) == 180    # capped by what the deadline leaves
