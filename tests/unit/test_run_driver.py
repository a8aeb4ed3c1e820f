"""The driver of `rl-async run`: every run's summary lands in its run directory (not only with
--summary-json), and a local run has the Ray dashboard only when asked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from launch import run as driver
from rl_async.plan.load import load_config


def test_the_summary_always_goes_to_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "demo" / "run-1"
    run_dir.mkdir(parents=True)
    driver._write_summary({"steps": 3, "run_dir": str(run_dir)}, None)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    extra = tmp_path / "copies" / "s.json"
    driver._write_summary({"steps": 4, "run_dir": str(run_dir)}, str(extra))
    assert json.loads(extra.read_text())["steps"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4
    assert f"summary written to {run_dir / 'summary.json'}" in capsys.readouterr().out


def test_a_run_directory_on_another_node_is_not_created_here(tmp_path):
    elsewhere = tmp_path / "not-mounted" / "run-1"
    driver._write_summary({"steps": 1, "run_dir": str(elsewhere)}, None)
    assert not elsewhere.exists()


@pytest.mark.parametrize("asked", [False, True])
def test_a_local_run_has_the_dashboard_only_when_asked(monkeypatch, capsys, asked):
    import ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw) or SimpleNamespace(
        dashboard_url="127.0.0.1:8265"))
    assert driver._init_ray(load_config("cluster_configs/local.toml"), asked) is True
    assert calls[0]["include_dashboard"] is asked
    assert calls[0]["dashboard_host"] == "127.0.0.1"
    assert ("Ray dashboard: http://127.0.0.1:8265" in capsys.readouterr().out) is asked
