"""`--dry-run` must accept every shipped run file: the synthetic backends it swaps in have no
model, so settings that need one (the provenance audit of local.toml) are turned off with a
note instead of failing validation."""

from pathlib import Path

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.dry_run import dry_run_config
from rl_async.plan.load import load_config

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "cluster_configs").glob("*.toml"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_shipped_run_file_has_a_valid_dry_run(path):
    cfg, notes = dry_run_config(load_config(path))
    report = validate(cfg)
    assert report.ok, (path.name, report.errors)
    if load_config(path).run.audit_fraction > 0:
        assert cfg.run.audit_fraction == 0
        assert any("run.audit_fraction" in n for n in notes)
