"""The human-readable form of a simulation's prediction (`rl-async simulate` without --json)."""

from __future__ import annotations

from typing import Any


def _pct(x: float) -> str:
    return f"{x:.1%}"


def format_prediction(p: dict[str, Any]) -> str:
    lines = [
        f"simulated {p['simulated_steps']} optimizer steps of {p['config']}: "
        f"{p['simulated_seconds']:.0f} simulated s in {p['simulator_cpu_seconds']:.1f} CPU s",
        "",
        f"  trainer wait fraction      {_pct(p['trainer_wait_fraction'])}   "
        f"(trainer wait / whole wall time, evals included)",
        f"  generation idle fraction   {_pct(p['generation_idle_fraction'])}   "
        f"(engines with no running request; slots used {_pct(p['engine_slot_utilisation'])}, "
        f"{p['mean_running_requests_per_engine']:.1f} running per engine)",
        f"  optimizer steps / hour     {p['steps_per_hour']:.1f}",
        f"  useful tokens / s          {p['useful_tokens_per_s']:.0f}",
        f"  mean staleness             {p['mean_staleness']:.2f}   (max {p['max_staleness']}, "
        f"allowed {p['max_weight_staleness']})",
        f"  staleness mean / p99       {p['staleness']['mean_delivered']:.2f} / "
        f"{p['staleness']['p99_delivered']:g}   (in flight {p['staleness']['inflight_mean']:.2f}"
        f" / {p['staleness']['inflight_p99']:g}, in queue {p['staleness']['queue_mean']:.2f} / "
        f"{p['staleness']['queue_p99']:g})",
        f"  trained samples / s        {p['samples_per_s']:.1f}",
        f"  staleness histogram        "
        + ", ".join(f"{k}: {v}" for k, v in p["staleness_histogram"].items()),
        f"  dropped samples (stale)    {_pct(p['dropped_samples_fraction'])}   "
        f"(discarded groups {_pct(p['discarded_groups_fraction'])})",
        f"  evicted / aborted groups   {_pct(p['evicted_groups_fraction'])} / "
        f"{_pct(p['aborted_groups_fraction'])}",
        f"  publication pauses         {p['publication_pause_seconds']:.1f} s over "
        f"{p['publications']} publications ({_pct(p['publication_pause_fraction'])} of the time)",
    ]
    b = p["buffer"]
    lines.append(f"  completed buffer           mean {b['mean_groups']:.1f} / {b['capacity_groups']}"
                 f" groups, peak {b['peak_groups']}, full {_pct(b['full_fraction'])} of the time")
    lines.append("    over time (s: groups)   "
                 + ", ".join(f"{t:.0f}: {n:g}" for t, n in b["timeline"]))
    lines.append("  by response length         bin: delivered / dropped / evicted / aborted")
    for label, row in p["by_response_length"].items():
        lines.append(f"    {label:>12}             {row['delivered']} / {row['dropped']} / "
                     f"{row['evicted']} / {row['aborted']}  (dropped "
                     f"{_pct(row['dropped_fraction'])})")
    led = p["ledger"]
    lines.append(f"  ledger                     submitted {led['submitted_groups']}, delivered "
                 f"{led['delivered_groups']}, discarded {led['discarded_groups']}, failed "
                 f"{led['failed_groups']}, buffered {led['buffered_groups']}, unaccounted "
                 f"{led['unaccounted']}")
    lines.append("")
    lines.append("timings:")
    for key, src in p["timings_source"].items():
        lines.append(f"  {key:<17} {src}")
    return "\n".join(lines)
