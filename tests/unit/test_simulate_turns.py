"""The simulator's multi-turn trajectories (SPEC §12): a run's calibration carries the turn
structure, and the simulated producer plays it through the real trajectory hook."""

import math
from dataclasses import replace
from pathlib import Path

from rl_async.base.types import Group, Sample
from rl_async.observe.calibration import CalibrationStats
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config
from rl_async.sim.calibrate import sim_timings
from rl_async.sim.run import simulate
from rl_async.sim.timings import TurnTiming

DEMO = Path(__file__).resolve().parents[2] / "cluster_configs" / "multiturn.toml"


def test_calibration_records_turns_and_per_turn_lengths():
    # Two trajectories: 2 turns of 3 sampled tokens around 4 env tokens; 3 turns of 2 tokens
    # with two gaps of 4.
    a = Sample("a", prompt_ids=[1] * 5, response_ids=[1] * 10, loss_mask=[1] * 3 + [0] * 4
               + [1] * 3, turns=2)
    b = Sample("b", prompt_ids=[1] * 5, response_ids=[1] * 14,
               loss_mask=[1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1], turns=3)
    stats = CalibrationStats()
    stats.observe_collection([Group("g", [a, b])], train_seconds=1.0)
    stats.observe_metrics({"producer/generation_seconds": 1.0, "producer/env_seconds": 2.5,
                           "producer/turns": 5.0})
    cal = stats.to_dict(wall_seconds=5.0, engines=1, max_running_requests=8,
                        max_response_len=4)
    assert cal["turns"] == {"trajectories": 2, "turns_mean": 2.5, "env_tokens_per_gap": 4.0,
                            "env_seconds_per_turn": 0.5}
    assert cal["response_length"]["mean"] == 2.5  # per turn: 3 and 2 sampled tokens
    t = sim_timings(load_config(DEMO), cal)
    assert t.turns == TurnTiming(2.5, 4.0, 0.5) and "measured" in t.sources["turns"]
    assert "need --calibrate" in sim_timings(load_config(DEMO)).sources["turns"]


def predict(turns: TurnTiming | None, budget: int = 64):
    cfg = load_config(DEMO, ["synthetic.response_len_median=2", "synthetic.response_len_sigma=0",
                             "synthetic.prompt_tokens=4", f"rollout.max_trajectory_tokens={budget}"])
    timings = replace(sim_timings(cfg), turns=turns)
    return simulate(cfg, plan_capacity(cfg)[0], timings, steps=4)


def test_simulated_trajectories_follow_the_calibrated_turns_and_environment_time():
    single = predict(None)
    multi = predict(TurnTiming(2.5, 4.0, 0.5))
    r = multi["rollout"]
    assert r["trajectories"] >= 4 * 128 and abs(r["turns_mean"] - 2.5) < 0.15
    assert math.isclose(r["env_seconds_mean"], 0.5 * r["turns_mean"], rel_tol=1e-6)
    assert r["truncated_fraction"] == 0  # 2-3 turns of 2 tokens + gaps fit in 64
    assert "rollout" not in single
    # The environment's seconds after each turn hold permits: the same steps take longer.
    assert multi["simulated_seconds"] > single["simulated_seconds"] + 1.0
    assert multi["ledger"]["unaccounted"] == 0


def test_the_token_budget_truncates_simulated_trajectories():
    r = predict(TurnTiming(3.0, 8.0, 0.0), budget=16)["rollout"]
    # prompt 4 + 2 + 8 + 2 leaves no room for a third turn within 16 tokens
    assert r["truncated_fraction"] == 1.0 and r["turns_mean"] < 3
