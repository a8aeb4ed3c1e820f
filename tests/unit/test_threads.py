"""The thread balancer (rl_async/loop/threads.py): which side bounds, what it gets, and that a
trial that does not pay is reverted."""

from __future__ import annotations

from rl_async.loop.threads import (Split, ThreadBalancer, Usage, balances, describe,
                                   usage_from)
from rl_async.plan.load import load_config


class Feed:
    """Cumulative usage as a run produces it: per window, cores used and seconds/update."""

    def __init__(self, balancer: ThreadBalancer):
        self.b = balancer
        self.engine = self.trainer = self.loop = self.wall = 0.0
        self.updates = 0

    def window(self, engine_cores: float, trainer_cores: float, s_per_update: float,
               updates: int = 3) -> Split | None:
        out = None
        for _ in range(updates):
            self.wall += s_per_update
            self.loop += s_per_update
            self.engine += engine_cores * s_per_update
            self.trainer += trainer_cores * s_per_update
            self.updates += 1
            got = self.b.observe(Usage(self.engine, self.trainer, self.loop, self.updates,
                                       self.wall))
            out = got if got is not None else out
        return out


def balancer(**kw) -> ThreadBalancer:
    return ThreadBalancer(2.0, 1, 1, Split(1, 1), min_updates=3, min_seconds=1.0, **kw)


def test_a_bound_trainer_gets_the_idle_engine_core_and_keeps_it_when_faster():
    b = balancer()
    f = Feed(b)
    f.window(0.1, 0.97, 10.0, updates=1)  # opens the window (the first collection)
    assert f.window(0.1, 0.97, 10.0) == Split(engine=1, trainer=2)
    assert (b.state, b.bound) == ("trial", "trainer")
    assert f.window(0.15, 1.8, 6.0) is None
    assert b.state == "settled" and b.split == Split(1, 2)
    assert "10 -> 6 s per update" in b.decision
    assert b.metrics()["threads/trainer"] == 2.0
    assert f.window(0.15, 1.8, 6.0) is None  # settled: never revisited


def test_a_trial_that_does_not_pay_is_reverted():
    b = balancer()
    f = Feed(b)
    f.window(0.1, 0.97, 10.0, updates=1)
    assert f.window(0.1, 0.97, 10.0) == Split(1, 2)
    assert f.window(0.1, 1.9, 9.8) == Split(1, 1)  # 2% faster is noise, not a win
    assert b.state == "settled" and b.split == Split(1, 1)
    assert "did not make it faster" in b.decision


def test_a_bound_engine_gets_the_idle_trainer_core():
    b = balancer()
    f = Feed(b)
    f.window(0.95, 0.2, 1.0, updates=1)
    assert f.window(0.95, 0.2, 1.0) == Split(engine=2, trainer=1)
    assert b.bound == "engine"


def test_a_core_half_used_is_lent_as_a_trial():
    # SmolLM2 with the filter off: the engine used 0.52 of its core; 2 threads paid
    b = balancer()
    f = Feed(b)
    f.window(0.52, 1.0, 5.9, updates=1)
    assert f.window(0.52, 1.0, 5.9) == Split(engine=1, trainer=2)


def test_no_core_is_lent_that_the_other_side_uses():
    # the engine uses 0.8 of its core: lending it would oversubscribe the machine
    b = balancer()
    f = Feed(b)
    f.window(0.8, 0.97, 2.0, updates=1)
    assert f.window(0.8, 0.97, 2.0) is None
    assert (b.state, b.bound, b.split) == ("settled", "both", Split(1, 1))
    assert "the machine is full" in b.decision


def test_both_busy_or_neither_busy_keeps_the_plan():
    for engine, trainer, bound in ((0.95, 0.95, "both"), (0.3, 0.3, "neither")):
        b = balancer()
        f = Feed(b)
        f.window(engine, trainer, 1.0, updates=1)
        assert f.window(engine, trainer, 1.0) is None
        assert (b.state, b.bound, b.split) == ("settled", bound, Split(1, 1))


def test_windows_need_updates_and_seconds_and_leave_out_an_evaluation():
    b = ThreadBalancer(2.0, 1, 1, Split(1, 1), min_updates=3, min_seconds=5.0)
    f = Feed(b)
    f.window(0.1, 0.97, 1.0, updates=1)
    assert f.window(0.1, 0.97, 1.0, updates=3) is None  # 3 updates but 3 s < 5 s
    assert b.state == "measuring"
    b.interrupt()
    # the collection after the evaluation (an engine at 1.9 cores) is not counted
    f.window(1.9, 0.97, 1.0, updates=1)
    assert b.state == "measuring"
    assert f.window(0.1, 0.97, 1.0, updates=2) == Split(1, 2)
    assert round(b.engine_cores, 6) == 0.1


def test_counters_that_go_back_leave_that_increment_out():
    b = balancer()
    assert b.observe(Usage(50.0, 50.0, 10.0, 1, 10.0)) is None
    # a restarted engine reports from zero: no negative usage
    assert b.observe(Usage(1.0, 60.0, 20.0, 5, 20.0)) is None
    assert b.state == "measuring" and b._window == [0.0] * 5


def test_several_trainer_workers_share_the_lent_cores():
    b = ThreadBalancer(4.0, 2, 2, Split(1, 1), min_updates=1, min_seconds=0.1)
    f = Feed(b)
    f.window(0.2, 1.9, 1.0, updates=1)
    assert f.window(0.2, 1.9, 1.0, updates=1) == Split(engine=1, trainer=2)  # (4 + 0.75 - 0.2) // 2


def test_usage_sums_engines_and_scales_the_reporting_trainer_rank():
    u = usage_from({"engine/0/cpu_seconds": 3.0, "engine/1/cpu_seconds": 4.0,
                    "engine/0/running": 9.0, "trainer/cpu_seconds": 5.0}, 2, 1.5, 7, 9.0)
    assert u.totals() == (7.0, 10.0, 1.5, 7, 9.0)


def test_one_engine_restarting_among_several_is_seen():
    """Two engines: one restarts (its counter starts again at 0.5) while the other grows by
    more, so the SUM still rises; that window's increment must be left out all the same."""
    b = balancer()
    first = usage_from({"engine/0/cpu_seconds": 20.0, "engine/1/cpu_seconds": 20.0,
                        "trainer/cpu_seconds": 10.0}, 1, 10.0, 1, 10.0)
    restart = usage_from({"engine/0/cpu_seconds": 0.5, "engine/1/cpu_seconds": 45.0,
                          "trainer/cpu_seconds": 20.0}, 1, 20.0, 5, 20.0)
    assert restart.engine_cpu_s > first.engine_cpu_s
    assert b.observe(first) is None and b.observe(restart) is None
    assert b._window == [0.0] * 5  # left out
    gone = usage_from({"engine/1/cpu_seconds": 50.0, "trainer/cpu_seconds": 30.0}, 1, 30.0,
                      9, 30.0)  # engine 0 is down: not in the metrics
    assert gone.restarted_since(restart)


def test_which_runs_balance_and_what_the_plan_says():
    local = load_config("cluster_configs/local.toml")
    assert balances(local) and "auto" in describe(local)
    assert not balances(load_config("cluster_configs/local.toml", ["run.deterministic=true"]))
    fixed = load_config("cluster_configs/local.toml", ["cluster.cpu_threads=fixed"])
    assert not balances(fixed) and "kept for the whole run" in describe(fixed)
