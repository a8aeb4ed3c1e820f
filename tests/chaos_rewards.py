"""Reward functions for chaos tests: a verifier that goes down mid-run, as a judge service
does. Importable by the reward actor (tests/ is on the workers' PYTHONPATH)."""

from rl_async.algo.successor import successor_reward

CALLS = {"n": 0}
FAIL_AFTER = 400


def goes_down(sample) -> float:
    CALLS["n"] += 1
    if CALLS["n"] > FAIL_AFTER:
        raise ConnectionError("judge service unavailable: connection refused (chaos)")
    return successor_reward(sample)


def hangs(sample) -> float:
    """A grader stuck on one answer (sympy on a pathological expression): 4 s, far past the
    tests' reward.timeout_s (finite, so a thread left running by the thread path ends)."""
    import time

    time.sleep(4.0)
    return 0.0


def dies(sample) -> float:
    """A grader that crashes its process (a segfault in native code)."""
    import os

    os._exit(3)
