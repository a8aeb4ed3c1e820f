"""The shipped Grafana dashboard plots only gauges the run exports, under the names
Prometheus shows (Ray adds `ray_`), and every exported gauge has a panel."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exported_names() -> set[str]:
    # Parsed from the source: importing actors/ray_metrics would import Ray into unit tests.
    text = (ROOT / "actors" / "ray_metrics.py").read_text()
    return {"ray_" + n for n in re.findall(r'"(rl_async_[a-z_]+)"', text)}


def test_dashboard_plots_exactly_the_exported_gauges():
    dash = json.loads((ROOT / "dashboards" / "grafana_rl_async.json").read_text())
    plotted = {t["expr"] for p in dash["panels"] for t in p["targets"]}
    assert plotted == exported_names()
    assert {"ray_rl_async_faults_engine_restarts", "ray_rl_async_trainer_wait_seconds",
            "ray_rl_async_discard_fraction", "ray_rl_async_publication_seconds"} <= plotted
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert all(name in ops for name in plotted)  # the docs name what Prometheus shows
