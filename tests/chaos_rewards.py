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
