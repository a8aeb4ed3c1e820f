"""`rl-async compare`: time to a target reward from summaries' eval curves, and the plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_async.observe.compare import compare, default_target, time_to

ROOT = Path(__file__).resolve().parents[2]


def summary(tmp_path, name, mode, curve, lag=0, seed=0):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"run": {"name": name, "seed": seed, "mode": mode,
                                        "max_weight_staleness": lag},
                                "eval": {"curve": curve}}))
    return str(path)


def test_time_to_target_is_the_first_eval_that_reaches_it():
    curve = [[0, 0.5, 0.0], [50, 10.0, 0.4], [100, 20.0, 0.75], [150, 30.0, 0.7]]
    assert time_to(curve, 0.75) == 20.0 and time_to(curve, 0.4) == 10.0
    assert time_to(curve, 0.8) is None


def test_default_target_is_80_percent_of_the_sync_median(tmp_path):
    paths = [summary(tmp_path, "s1", "sync", [[0, 0, 0], [10, 9, 0.5]]),
             summary(tmp_path, "s2", "sync", [[0, 0, 0], [10, 9, 1.0]]),
             summary(tmp_path, "s3", "sync", [[0, 0, 0], [10, 9, 0.8]]),
             summary(tmp_path, "a", "async", [[0, 0, 0], [10, 5, 0.2]], lag=2)]
    result = compare(paths)
    assert result["target_reward"] == pytest.approx(0.64)
    assert [r["time_to_target_s"] for r in result["runs"]] == [None, 9, 9, None]
    assert result["runs"][3]["run"] == "a (async lag 2, seed 0)"
    assert default_target([json.loads(Path(p).read_text()) for p in paths[3:]]) == \
        pytest.approx(0.16)


def test_cli_prints_a_table_and_draws_the_plot(tmp_path):
    paths = [summary(tmp_path, "sync", "sync", [[0, 0.1, 0.0], [100, 40.0, 0.9]]),
             summary(tmp_path, "async", "async", [[0, 0.1, 0.0], [50, 12.0, 0.8],
                                                  [100, 25.0, 0.9]], lag=1)]
    png = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, "-m", "launch.cli", "compare", *paths, "--plot",
                          str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "target reward 0.720" in out.stdout and "12.0" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "launch.cli", "compare", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no eval.curve" in out.stderr
