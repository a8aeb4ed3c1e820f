"""`rl-async compare SUMMARY_JSON...`: eval reward against wall time, run by run.

Reads run summaries (`rl-async run --summary-json`), whose `eval.curve` is a list of
[step, wall seconds since the controller loop started, held-out reward] from the initial eval
to the final one (evals and drains included in the wall time, actor start-up not). Reports
per run the final and best reward and the wall time to a target reward; `--plot PATH` draws
the curves (matplotlib, the `plot` extra).

Time to target: the wall time of the first evaluation at or above the target (an eval
schedule coarser than the curve's rise makes it later, never earlier; compare runs with the
same `eval.every_steps`). The default target is 80% of the sync runs' median final reward
(all runs' when none is sync), the same rule as benchmarks/time_to_reward.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def load_summary(path: str | Path) -> dict[str, Any]:
    summary = json.loads(Path(path).read_text())
    curve = summary.get("eval", {}).get("curve")
    if not curve:
        raise ValueError(f"{path}: no eval.curve (a summary written by `rl-async run "
                         f"--summary-json` of a finished run)")
    return summary


def mode_of(summary: dict[str, Any]) -> str | None:
    """'sync' or 'async lag L' (None for a summary that does not say)."""
    run = summary.get("run")
    if not run:
        return None
    return "sync" if run["mode"] == "sync" else f"async lag {run['max_weight_staleness']}"


def label(summary: dict[str, Any], path: str | Path) -> str:
    run = summary.get("run")
    if not run:
        return Path(path).stem
    return f"{run['name']} ({mode_of(summary)}, seed {run['seed']})"


def time_to(curve: list, target: float) -> float | None:
    """Wall seconds of the first evaluation whose reward reaches `target`; None if none."""
    return next((wall for _step, wall, reward in curve if reward >= target), None)


def default_target(summaries: list[dict[str, Any]], fraction: float = 0.8) -> float:
    sync = [s for s in summaries if s.get("run", {}).get("mode") == "sync"] or summaries
    return fraction * statistics.median(s["eval"]["curve"][-1][2] for s in sync)


def compare(paths: list[str], target: float | None = None) -> dict[str, Any]:
    summaries = [load_summary(p) for p in paths]
    target = default_target(summaries) if target is None else target
    rows = []
    for path, s in zip(paths, summaries):
        curve = s["eval"]["curve"]
        rows.append({"run": label(s, path), "mode": mode_of(s) or label(s, path),
                     "path": str(path),
                     "final_reward": curve[-1][2], "best_reward": max(c[2] for c in curve),
                     "wall_seconds": curve[-1][1], "time_to_target_s": time_to(curve, target),
                     "curve": curve})
    return {"target_reward": target, "runs": rows}


def plot(result: dict[str, Any], path: str | Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'rl-async[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    # One colour per mode (sync, async lag L; or per run when summaries do not say), one
    # legend entry per mode: seeds of a mode read as a band, modes stay apart.
    modes = list(dict.fromkeys(row["mode"] for row in result["runs"]))
    colours = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    labelled: set[str] = set()
    for row in result["runs"]:
        xs, ys = [c[1] for c in row["curve"]], [c[2] for c in row["curve"]]
        mode = row["mode"]
        ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, alpha=0.8,
                color=colours[mode], label=None if mode in labelled else mode,
                linestyle="--" if mode == "sync" else "-")
        labelled.add(mode)
    ax.axhline(result["target_reward"], color="grey", linewidth=0.8, linestyle=":",
               label=f"target {result['target_reward']:.2f}")
    ax.set_xlabel("wall seconds (controller loop, evals included)")
    ax.set_ylabel("held-out eval reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def table(result: dict[str, Any]) -> str:
    lines = [f"target reward {result['target_reward']:.3f}",
             f"{'run':<48} {'final':>6} {'best':>6} {'wall s':>8} {'to target s':>12}"]
    for r in result["runs"]:
        t = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"{r['run'][:48]:<48} {r['final_reward']:>6.3f} {r['best_reward']:>6.3f} "
                     f"{r['wall_seconds']:>8.1f} {t:>12}")
    return "\n".join(lines)
